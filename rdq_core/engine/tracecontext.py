"""W3C Trace Context carried from an enqueue to every run of the task.

At enqueue the trace context is stored in the task's headers under two reserved names
(``rdq.traceparent`` and ``rdq.tracestate``; callers cannot set ``rdq.*`` headers themselves):

* from the Python client: an explicit ``traceparent=`` (and ``tracestate=``) argument, else the
  current OpenTelemetry span when OpenTelemetry is in use in the process;
* from the HTTP API: the request's ``traceparent`` (and ``tracestate``) header, else its
  ``X-Amzn-Trace-Id`` header converted (``Root`` and ``Parent`` become the trace and parent ids;
  ``rdq_core/aws/xray.py``).

Every value is checked against the W3C format (version ``00``, and the forward-compatible rule
for later versions); an invalid one is dropped, never refused: tracing must not fail an enqueue.

In the worker, ``attempt_span`` runs the handler inside a span whose parent is the stored
context, when OpenTelemetry is in use; attempt *n* > 1 carries a span link to attempt *n - 1*'s
span. No span id is stored per attempt: an attempt's span id is derived from the trace id, the
task id, the redrive count and the attempt number, so the next attempt can name it. That needs a
tracer with an id generator (the OpenTelemetry SDK's); with any other the spans get the tracer's
own ids and retries carry no link.

OpenTelemetry stays optional and is never imported here: "in use" means ``opentelemetry.trace``
is already imported (an application that configured a tracer provider has imported it; one that
has not could hold no current span and record no span). Without it the stored context still
travels, and ``TaskContext.traceparent`` hands it to the handler.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import sys
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

from ..aws import xray
from ..model import NewTask
from ..validation import TRACEPARENT_HEADER, TRACESTATE_HEADER

log = logging.getLogger("rdq.trace")

#: W3C limits: 32 list members in ``tracestate``; 512 characters is what every system must pass on.
TRACESTATE_MEMBERS = 32
TRACESTATE_CHARS = 512

# version "-" trace-id "-" parent-id "-" trace-flags, all lowercase hex.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACESTATE_KEY = re.compile(
    r"[a-z][a-z0-9_\-*/]{0,255}"  # simple-key
    r"|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}"  # multi-tenant-key
)
# Printable ASCII except "," and "=", the last character not a space; up to 256 characters.
_TRACESTATE_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


@dataclass(frozen=True)
class TraceParent:
    """A valid ``traceparent``: ids as lowercase hex, ``flags`` as an int (bit 0: sampled)."""

    trace_id: str
    parent_id: str
    flags: int

    @property
    def header(self) -> str:
        """The version-00 header (later versions are stored as 00, the one this side speaks)."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)

    @property
    def xray_trace_id(self) -> str:
        """The same trace id in X-Ray's spelling (``1-<8 hex>-<24 hex>``)."""
        return xray.xray_trace_id(self.trace_id)


def parse_traceparent(value: Any) -> TraceParent | None:
    """The ``traceparent`` in ``value``, or None when it is not one (W3C Trace Context, level 1).

    Version ``00`` is exactly 55 characters; a later version (``01``..``fe``) may carry more after
    a ``-``, and its first four fields are read as 00's. Version ``ff``, uppercase hex, all-zero
    trace or parent ids and anything else are refused. Surrounding spaces and tabs (an HTTP
    header's optional whitespace) are ignored."""
    if not isinstance(value, str):
        return None
    text = value.strip(" \t")
    match = _TRACEPARENT.match(text)
    if match is None:
        return None
    version, trace_id, parent_id, flags = match.groups()
    if version == "ff":
        return None
    if version == "00":
        if len(text) != 55:
            return None
    elif len(text) > 55 and text[55] != "-":
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def clean_tracestate(value: Any) -> str | None:
    """``value`` as a valid ``tracestate`` (members joined by ``,``), or None when it is not one.

    Every member must be ``key=value`` in the W3C syntax, keys unique, at most 32 members (empty
    members are skipped). Beyond 512 characters, members over 128 characters are dropped first,
    then members from the end, as the specification allows."""
    if not isinstance(value, str) or len(value) > 8192:
        return None
    members: list[str] = []
    keys: set[str] = set()
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        key, sep, item = member.partition("=")
        if not sep or not _TRACESTATE_KEY.fullmatch(key) or not _TRACESTATE_VALUE.fullmatch(item) or key in keys:
            return None
        keys.add(key)
        members.append(member)
    if not members or len(members) > TRACESTATE_MEMBERS:
        return None
    if len(",".join(members)) > TRACESTATE_CHARS:
        members = [m for m in members if len(m) <= 128]
        while members and len(",".join(members)) > TRACESTATE_CHARS:
            members.pop()
    return ",".join(members) or None


def from_xray_header(value: Any) -> TraceParent | None:
    """An ``X-Amzn-Trace-Id`` header (``Root=1-…;Parent=…;Sampled=1``) as a ``traceparent``
    (``rdq_core.aws.xray.traceparent_text``), checked as any other; None without both ``Root``
    and ``Parent``."""
    text = xray.traceparent_text(value)
    return None if text is None else parse_traceparent(text)


def headers_for(traceparent: Any, tracestate: Any = None) -> dict[str, str]:
    """The reserved task headers for a trace context; ``{}`` when ``traceparent`` is invalid (a
    ``tracestate`` alone is never kept; an invalid one is dropped on its own)."""
    parent = parse_traceparent(traceparent)
    if parent is None:
        if traceparent is not None:
            log.debug("dropped an invalid traceparent at enqueue")
        return {}
    out = {TRACEPARENT_HEADER: parent.header}
    state = clean_tracestate(tracestate) if tracestate is not None else None
    if state is not None:
        out[TRACESTATE_HEADER] = state
    elif tracestate is not None:
        log.debug("dropped an invalid tracestate at enqueue")
    return out


def current_headers() -> dict[str, str]:
    """The reserved task headers for the current OpenTelemetry span, ``{}`` when there is none
    (or OpenTelemetry is not in use). Never raises."""
    trace_api = sys.modules.get("opentelemetry.trace")
    if trace_api is None:
        return {}
    try:
        span_context = trace_api.get_current_span().get_span_context()
        if not span_context.is_valid:
            return {}
        state = span_context.trace_state.to_header() if span_context.trace_state else None
        flags = int(span_context.trace_flags) & 0xFF
        return headers_for(f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}", state or None)
    except Exception:  # a tracing library's failure must never fail an enqueue
        log.debug("could not read the current OpenTelemetry span", exc_info=True)
        return {}


#: The context ``use`` set for enqueues in this context (``{}``: none), or None (not set).
_explicit: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("rdq_trace_explicit", default=None)


@contextmanager
def use(traceparent: str | None, tracestate: str | None = None) -> Iterator[None]:
    """Within the block, Python enqueues (``Client`` and ``HttpClient``) carry this trace context
    instead of the current OpenTelemetry span's; ``use(None)`` makes them carry none. The worker
    sets it around a handler when OpenTelemetry is not in use, so the tasks a handler enqueues
    continue its trace."""
    token = _explicit.set(headers_for(traceparent, tracestate) if traceparent is not None else {})
    try:
        yield
    finally:
        _explicit.reset(token)


def enqueue_headers(traceparent: str | None = None, tracestate: str | None = None) -> dict[str, str]:
    """What a Python enqueue stores: the explicit ``traceparent`` when given (an invalid one is
    dropped, and then nothing is stored), else the context of an enclosing ``use`` block, else
    the current OpenTelemetry span's context."""
    if traceparent is not None:
        return headers_for(traceparent, tracestate)
    explicit = _explicit.get()
    if explicit is not None:
        return dict(explicit)
    return current_headers()


def stamped(new_tasks: list[NewTask], trace: Mapping[str, str]) -> list[NewTask]:
    """``new_tasks`` with ``trace`` in their headers (the reserved names replaced); unchanged
    when ``trace`` is empty."""
    if not trace:
        return new_tasks
    return [replace(task, headers=with_trace(task.headers, trace)) for task in new_tasks]


def http_headers(trace: Mapping[str, str]) -> dict[str, str]:
    """The reserved task headers as the HTTP request headers the API reads (``traceparent``,
    ``tracestate``): how ``HttpClient`` sends a trace context."""
    out = {}
    if TRACEPARENT_HEADER in trace:
        out["traceparent"] = trace[TRACEPARENT_HEADER]
        if TRACESTATE_HEADER in trace:
            out["tracestate"] = trace[TRACESTATE_HEADER]
    return out


def request_headers(header: Callable[[str], str | None]) -> dict[str, str]:
    """What an HTTP enqueue stores, from ``header(name)`` (case-insensitive): ``traceparent`` (with
    ``tracestate``) when valid, else ``X-Amzn-Trace-Id`` converted (a header with a ``Root`` but no
    ``Parent`` takes its parent from the function's own ``_X_AMZN_TRACE_ID`` of the same root),
    else nothing."""
    try:
        found = headers_for(header("traceparent"), header("tracestate")) if header("traceparent") else {}
        if not found:
            xray_value = header("x-amzn-trace-id")
            converted = from_xray_header(xray_value)
            if converted is None:
                # API Gateway adds a header with a Root only; the API function's own trace header
                # (``_X_AMZN_TRACE_ID``, set by Lambda for each invocation) has that root and the
                # function's segment as Parent.
                own = from_xray_header(xray.lambda_trace_header())
                root = xray.root_trace_id(xray.header_fields(xray_value))
                converted = own if own is not None and root is not None and own.trace_id == root else None
            if converted is not None:
                found = {TRACEPARENT_HEADER: converted.header}
        return found
    except Exception:  # never let a header fail an enqueue
        log.debug("could not read the request's trace headers", exc_info=True)
        return {}


def stored(headers: Mapping[str, str]) -> tuple[TraceParent | None, str | None]:
    """The trace context a task carries in its headers (checked again: None when invalid)."""
    parent = parse_traceparent(headers.get(TRACEPARENT_HEADER))
    if parent is None:
        return None, None
    return parent, clean_tracestate(headers.get(TRACESTATE_HEADER))


def with_trace(headers: Mapping[str, str], trace: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with the reserved trace headers replaced by ``trace``'s."""
    kept = {k: v for k, v in headers.items() if k not in (TRACEPARENT_HEADER, TRACESTATE_HEADER)}
    return {**kept, **trace}


# -- the worker side ---------------------------------------------------------------------------
def attempt_span_id(trace_id: str, task_id: str, redrive_count: int, attempt: int) -> int:
    """The span id of one attempt's span: the same inputs always give the same id, so attempt
    *n* can link to attempt *n - 1* without anything stored per attempt. Never zero."""
    digest = hashlib.blake2b(f"{trace_id}/{task_id}/{redrive_count}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


#: The span id the next span of rdq's own tracer gets (set only around its ``start_span``).
_forced_span_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("rdq_forced_span_id", default=None)


class _AttemptIds:
    """Wraps a tracer's id generator: gives the forced span id when one is set, else delegates."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        forced = _forced_span_id.get()
        return forced if forced is not None else int(self.inner.generate_span_id())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_tracer_lock = threading.Lock()
_tracer_cache: tuple[Any, Any, bool] | None = None  # (provider, tracer, span ids derivable)


def _tracer(trace_api: Any) -> tuple[Any, bool]:
    """rdq's tracer from the current tracer provider (fetched again when the provider changes)
    and whether its span ids can be set (its id generator wrapped)."""
    global _tracer_cache
    provider = trace_api.get_tracer_provider()
    cached = _tracer_cache
    if cached is not None and cached[0] is provider:
        return cached[1], cached[2]
    with _tracer_lock:
        tracer = provider.get_tracer("rdq_core")
        generator = getattr(tracer, "id_generator", None)
        derivable = generator is not None and callable(getattr(generator, "generate_span_id", None))
        if derivable and not isinstance(generator, _AttemptIds):
            try:
                tracer.id_generator = _AttemptIds(generator)
            except Exception:  # a tracer that will not take it keeps its own ids
                log.debug("the tracer's id generator cannot be wrapped; retries carry no link", exc_info=True)
                derivable = False
        _tracer_cache = (provider, tracer, derivable)
        return tracer, derivable


def _recording_trace_api() -> Any:
    """``opentelemetry.trace`` when spans would be recorded: imported (by the application, or by
    a library that instruments itself -- redis-py imports it) *and* given a tracer provider. Under
    the API's default provider every span is a no-op, so an attempt runs as without OpenTelemetry
    (the handler still sees, and its enqueues still carry, the task's stored trace context)."""
    trace_api = sys.modules.get("opentelemetry.trace")
    if trace_api is None:
        return None
    try:
        provider = trace_api.get_tracer_provider()
        if isinstance(provider, (trace_api.ProxyTracerProvider, trace_api.NoOpTracerProvider)):
            return None
    except Exception:  # an API without these names: take the provider as a real one
        log.debug("could not tell whether a tracer provider is set", exc_info=True)
    return trace_api


#: What ``attempt_span`` returns for an untraced task in a process without OpenTelemetry.
_UNTRACED: AbstractContextManager[str | None] = nullcontext(None)


def attempt_span(*, task_id: str, queue: str, handler: str, attempt: int, redrive_count: int,
                 headers: Mapping[str, str]) -> AbstractContextManager[str | None]:
    """Run one attempt inside its span; yields the ``traceparent`` the handler runs under.

    With OpenTelemetry in use: a CONSUMER span ``run <handler>``, child of the stored context (a
    root span when the task carries none), current while the body runs; an exception leaving the
    body is recorded on it. Attempt *n* > 1 of a traced task links to attempt *n - 1*'s span.
    Without OpenTelemetry (or with its API but no tracer provider set): no span; yields the stored
    ``traceparent`` (or None), and the handler's own enqueues carry it. An untraced task then costs
    a dictionary lookup and a provider check."""
    trace_api = _recording_trace_api()
    if TRACEPARENT_HEADER not in headers and trace_api is None:
        return _UNTRACED
    return _attempt_span(trace_api, task_id=task_id, queue=queue, handler=handler, attempt=attempt,
                         redrive_count=redrive_count, headers=headers)


@contextmanager
def _attempt_span(trace_api: Any, *, task_id: str, queue: str, handler: str, attempt: int, redrive_count: int,
                  headers: Mapping[str, str]) -> Iterator[str | None]:
    parent, state = stored(headers)
    if trace_api is None:
        # No span to be current: the handler's own enqueues carry the stored context instead.
        trace = {}
        if parent is not None:
            trace[TRACEPARENT_HEADER] = parent.header
            if state is not None:
                trace[TRACESTATE_HEADER] = state
        token = _explicit.set(trace)
        try:
            yield parent.header if parent is not None else None
        finally:
            _explicit.reset(token)
        return
    try:
        opened = _open_span(trace_api, parent, state, task_id=task_id, queue=queue, handler=handler,
                            attempt=attempt, redrive_count=redrive_count)
    except Exception:  # a tracing failure must not fail the task
        log.debug("could not start the attempt's span", exc_info=True)
        yield parent.header if parent is not None else None
        return
    span, span_traceparent = opened
    with trace_api.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield span_traceparent or (parent.header if parent is not None else None)


def _open_span(trace_api: Any, parent: TraceParent | None, state: str | None, *, task_id: str, queue: str,
               handler: str, attempt: int, redrive_count: int) -> tuple[Any, str | None]:
    tracer, derivable = _tracer(trace_api)
    context = None
    links = []
    forced = None
    if parent is not None:
        trace_id = int(parent.trace_id, 16)
        flags = trace_api.TraceFlags(parent.flags)
        trace_state = trace_api.TraceState.from_header([state]) if state else None
        remote = trace_api.SpanContext(trace_id, int(parent.parent_id, 16), is_remote=True, trace_flags=flags,
                                       trace_state=trace_state)
        context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(remote))
        if derivable:
            forced = attempt_span_id(parent.trace_id, task_id, redrive_count, attempt)
            if attempt > 1:
                previous = trace_api.SpanContext(
                    trace_id, attempt_span_id(parent.trace_id, task_id, redrive_count, attempt - 1),
                    is_remote=True, trace_flags=flags)
                links.append(trace_api.Link(previous, {"rdq.link": "previous_attempt", "rdq.attempt": attempt - 1}))
    attributes = {
        "messaging.system": "rdq",
        "messaging.operation.type": "process",
        "messaging.destination.name": queue,
        "messaging.message.id": task_id,
        "rdq.handler": handler,
        "rdq.attempt": attempt,
        "rdq.redrive_count": redrive_count,
    }
    token = _forced_span_id.set(forced)
    try:
        span = tracer.start_span(f"run {handler}", context=context, kind=trace_api.SpanKind.CONSUMER,
                                 attributes=attributes, links=links)
    finally:
        _forced_span_id.reset(token)
    span_context = span.get_span_context()
    if not span_context.is_valid:
        return span, None
    flags_value = int(span_context.trace_flags) & 0xFF
    return span, f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags_value:02x}"
