"""Input validation shared by every entry point (HTTP API, CLI, Python client).

Backends trust what passes here; nothing a caller sends is ever interpreted as query syntax,
because names are restricted to a small charset and values travel as bound parameters.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any, Mapping

from .errors import InvalidInput
from .model import Backoff, DedupeMode, TaskStatus

QUEUE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,119}")
HANDLER_NAME = QUEUE_NAME
TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,127}")
#: concurrency_key, rate_key, group and dedupe_key: plain ASCII, at most 128 bytes, never query syntax.
FLOW_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:-]{0,127}")

#: The task headers that carry the W3C trace context (``rdq_core.engine.tracecontext``). They are set by
#: the engine only (every ``rdq.`` name is refused from callers) and do not count toward
#: ``Limits.headers_count``.
TRACEPARENT_HEADER = "rdq.traceparent"
TRACESTATE_HEADER = "rdq.tracestate"


class Limits:
    """Documented limits (docs/limits.md). Each violation raises InvalidInput naming the field."""

    payload_bytes = 256 * 1024
    result_bytes = 64 * 1024
    batch_items = 500
    page_size = 500
    headers_count = 32
    header_key_chars = 128
    header_value_chars = 1024
    max_attempts = 100
    max_priority = 9
    delay_seconds = 366 * 86_400
    json_depth = 64
    error_message_chars = 2_000
    error_stack_chars = 8_000
    #: A bulk operation's rate, in tasks a second. The floor keeps one chunk's slot (one task at
    #: the slowest rate) at 100 s: an operation always makes progress a maintenance pass can see,
    #: and its slot arithmetic stays far from any date or duration overflow.
    operation_rate_min = 0.01
    operation_rate_max = 100_000
    #: The name a worker claims under (``Storage.claim(worker=...)``), shown on a running task.
    worker_chars = 200


#: run_at is clamped into this range (see ``run_at``).
RUN_AT_RANGE = (datetime(1, 1, 2, tzinfo=timezone.utc), datetime(9999, 12, 30, tzinfo=timezone.utc))


def queue_name(value: Any, field: str = "queue") -> str:
    if not isinstance(value, str) or not QUEUE_NAME.fullmatch(value):
        raise InvalidInput(f"{field} must match ^[a-z0-9][a-z0-9._-]{{0,119}}$", field)
    return value


def handler_name(value: Any, field: str = "handler") -> str:
    if not isinstance(value, str) or not HANDLER_NAME.fullmatch(value):
        raise InvalidInput(f"{field} must match ^[a-z0-9][a-z0-9._-]{{0,119}}$", field)
    return value


def task_id(value: Any, field: str = "id") -> str:
    if not isinstance(value, str) or not TASK_ID.fullmatch(value):
        raise InvalidInput(f"{field} must match ^[A-Za-z0-9][A-Za-z0-9._~-]{{0,127}}$", field)
    return value


def json_value(value: Any, limit_bytes: int, field: str) -> Any:
    """Checks that ``value`` is plain JSON within size and depth limits; returns it unchanged."""
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{field} is not JSON-serialisable: {exc}", field) from None
    if "\\u0000" in encoded and has_nul(value):
        # PostgreSQL's jsonb (and many consumers) cannot hold NUL; refuse it up front everywhere.
        raise InvalidInput(f"{field} contains a NUL character (\\u0000)", field)
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError:
        # A lone UTF-16 surrogate ("\\ud800") parses as JSON but is not Unicode text: no store can hold it.
        raise InvalidInput(f"{field} contains a lone UTF-16 surrogate; send valid Unicode", field) from None
    if size > limit_bytes:
        raise InvalidInput(f"{field} exceeds {limit_bytes} bytes once encoded as JSON", field)
    if _depth(value) > Limits.json_depth:
        raise InvalidInput(f"{field} nests deeper than {Limits.json_depth} levels", field)
    return value


def without_lone_surrogates(value: str) -> str:
    """``value`` with each lone UTF-16 surrogate replaced by U+FFFD (a well-formed pair is
    joined). ``os.fsdecode`` of undecodable bytes makes such strings; no store can encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # UTF-16 with surrogatepass keeps a well-formed pair; decoding with "replace" turns each
        # unpaired half into U+FFFD.
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return value


def repaired_text(value: str) -> str:
    """``value`` made storable on every backend: each NUL and each lone UTF-16 surrogate becomes
    U+FFFD. For text the engine writes on a handler's behalf (error messages, stacks), where
    refusing would lose the outcome: an OSError about a file named ``report-\\xff.csv`` carries
    a lone surrogate, and a store that cannot encode it must not fail the whole settle."""
    return without_lone_surrogates(value).replace("\x00", "\ufffd")


def storable_text(value: str) -> bool:
    """True when every backend can store ``value`` as text: no NUL, no lone UTF-16 surrogate."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _depth(value: Any) -> int:
    # Iterative so hostile nesting cannot blow the interpreter stack.
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level > Limits.json_depth:
            return level
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def headers(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInput("headers must be an object of string to string", "headers")
    if len(value) > Limits.headers_count:
        raise InvalidInput(f"at most {Limits.headers_count} headers", "headers")
    clean: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= Limits.header_key_chars:
            raise InvalidInput(f"header names are 1..{Limits.header_key_chars} characters", "headers")
        if key.startswith("rdq."):
            raise InvalidInput("header names starting with 'rdq.' are reserved", "headers")
        if not isinstance(item, str) or len(item) > Limits.header_value_chars:
            raise InvalidInput(f"header values are strings of at most {Limits.header_value_chars} characters", "headers")
        if not storable_text(key) or not storable_text(item):
            raise InvalidInput("header names and values must be valid Unicode without NUL characters", "headers")
        clean[key] = item
    return clean


def max_attempts(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)  # JSON does not tell 3 from 3.0 (nor does JSON Schema's "integer")
    if type(value) is not int or not 1 <= value <= Limits.max_attempts:
        raise InvalidInput(f"max_attempts must be an integer in 1..{Limits.max_attempts}", "max_attempts")
    return value


def priority(value: Any) -> int:
    """0 (the default, runs first) .. 9."""
    if value is None:
        return 0
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= Limits.max_priority:
        raise InvalidInput(f"priority must be an integer in 0..{Limits.max_priority} (lower runs first)", "priority")
    return value


def flow_key(value: Any, field: str) -> str | None:
    """A concurrency_key, rate_key, group or dedupe_key: absent, or matching ``FLOW_KEY``."""
    if value is None:
        return None
    if not isinstance(value, str) or not FLOW_KEY.fullmatch(value):
        raise InvalidInput(f"{field} must match ^[A-Za-z0-9][A-Za-z0-9._~:-]{{0,127}}$", field)
    return value


def worker_name(value: Any, field: str = "worker") -> str:
    """Who claims (``Storage.claim(worker=...)``): printable text of at most
    ``Limits.worker_chars`` characters; '' names nobody. Printable keeps control characters and
    lone surrogates out of every store and every view that shows it."""
    if not isinstance(value, str) or len(value) > Limits.worker_chars or not value.isprintable():
        raise InvalidInput(f"{field} must be printable text of at most {Limits.worker_chars} characters", field)
    return value


def optional_seconds(value: Any, field: str) -> float | None:
    """A duration in 0..``Limits.delay_seconds``, or None."""
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= Limits.delay_seconds:
        raise InvalidInput(f"{field} must be a number in 0..{Limits.delay_seconds}", field)
    return float(value)


def dedupe_states(value: Any) -> tuple[TaskStatus, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise InvalidInput("dedupe_states must be a non-empty list of task statuses", "dedupe_states")
    try:
        states = tuple(TaskStatus(item) for item in value)
    except ValueError:
        raise InvalidInput(f"dedupe_states holds statuses among {', '.join(s.value for s in TaskStatus)}",
                           "dedupe_states") from None
    return tuple(dict.fromkeys(states))


def dedupe_mode(value: Any) -> DedupeMode:
    if value is None:
        return DedupeMode.SKIP
    try:
        return DedupeMode(value)
    except ValueError:
        raise InvalidInput(f"dedupe_mode must be one of {', '.join(m.value for m in DedupeMode)}", "dedupe_mode") from None


def delay_seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= Limits.delay_seconds:
        raise InvalidInput(f"delay_seconds must be a number in 0..{Limits.delay_seconds}", "delay_seconds")
    return float(value)


def run_at(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidInput("run_at must be an ISO-8601 timestamp with a UTC offset", "run_at") from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidInput("run_at must be an ISO-8601 timestamp with a UTC offset", "run_at")
    try:
        utc = value.astimezone(timezone.utc)
    except OverflowError:  # a valid RFC 3339 instant whose offset takes it past year 1 or 9999 in UTC
        utc = RUN_AT_RANGE[0] if value.year == 1 else RUN_AT_RANGE[1]
    # Clamp to an instant every store round-trips (Redis keeps instants as float scores, which
    # round at the edges of datetime's range): "long ago" is due now either way, and year 9999
    # is as never as year 10000.
    return min(max(utc, RUN_AT_RANGE[0]), RUN_AT_RANGE[1])


def backoff(value: Any) -> Backoff | None:
    if value is None or isinstance(value, Backoff):
        return value
    if not isinstance(value, Mapping):
        raise InvalidInput("backoff must be an object", "backoff")
    allowed = {"initial_seconds": (0.0, 86_400.0), "factor": (1.0, 10.0), "max_seconds": (0.0, 7 * 86_400.0),
               "jitter": (0.0, 1.0)}
    unknown = set(value) - set(allowed)
    if unknown:
        raise InvalidInput(f"unknown backoff fields: {', '.join(sorted(map(str, unknown)))}", "backoff")
    fields = Backoff().to_dict()
    for key, item in value.items():
        low, high = allowed[key]
        if type(item) not in (int, float) or not math.isfinite(item) or not low <= item <= high:
            raise InvalidInput(f"backoff.{key} must be a number in {low:g}..{high:g}", "backoff")
        fields[key] = float(item)
    return Backoff(**fields)


def operation_rate(value: Any, field: str = "rate_per_second") -> float | None:
    """A bulk operation's rate (tasks a second), or None for "as fast as chunks go"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not Limits.operation_rate_min <= value <= Limits.operation_rate_max:
        raise InvalidInput(f"{field} must be a number of tasks a second in "
                           f"{Limits.operation_rate_min:g}..{Limits.operation_rate_max:g}", field)
    return float(value)


def page_size(value: Any) -> int:
    if type(value) is not int or not 1 <= value <= Limits.page_size:
        raise InvalidInput(f"limit must be an integer in 1..{Limits.page_size}", "limit")
    return value
