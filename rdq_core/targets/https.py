"""Calling an HTTPS target: one signed POST per attempt, its answer mapped to an outcome.

The request (standard library only: ``http.client`` and ``ssl``):

* TLS verified against the system's CAs (or the binding's ``ca_file``), host name checked;
* the envelope (``envelope.py``) as the JSON body; ``Idempotency-Key``, ``Rdq-Task-Id``,
  ``Rdq-Attempt``, ``Rdq-Signature`` (``signing.py``) and the W3C ``traceparent``/``tracestate``
  when the task carries a well-formed one;
* one time budget for everything: the task's run deadline (its ``timeout_seconds``, or less when
  the run must end sooner) minus a small margin. Connecting and the TLS handshake get at most
  ``connect_timeout_seconds`` of it; a timer shuts the socket at the budget's end, so a server
  that trickles its answer cannot hold the worker past it;
* a ``307``/``308`` to the same origin (scheme, host, port) is followed, at most twice; any other
  redirect is refused, never followed.

The answer:

* 2xx: success; the body, up to ``max_result_bytes``, is the result (parsed when it is JSON);
* 429 or 503 with a ``Retry-After`` (seconds or an HTTP date; at most an hour is honoured):
  a snooze, the retry budget unspent;
* 408, 429/503 without ``Retry-After``, 5xx, and a 4xx the binding retries: a failed attempt,
  retried with the queue's backoff;
* another 4xx: dead-lettered at once (``"on_4xx": "retry"`` retries them instead);
* no answer in time, or no connection: a failed attempt, retried.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import ssl
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any, Callable
from urllib.parse import urljoin, urlsplit

from ..engine.handlers import Snooze, TaskContext
from ..engine.outcomes import result_problem
from .config import HttpsTarget
from .envelope import envelope_bytes, idempotency_key
from .errors import (
    TargetHttpError,
    TargetRedirectRefused,
    TargetRejected,
    TargetTimeout,
    TargetUnreachable,
)
from .secret_refs import SecretSource
from .signing import SIGNATURE_HEADER, signature_header

log = logging.getLogger("rdq.targets")

#: Kept from the run's deadline so the call is over, and its outcome decided, before the engine's
#: own watchdog would count the run as overdue.
DEADLINE_MARGIN_SECONDS = 0.1
MAX_SAME_ORIGIN_REDIRECTS = 2
#: The longest ``Retry-After`` honoured as a snooze; a longer one snoozes this long.
MAX_RETRY_AFTER_SECONDS = 3600.0
#: How much of an error answer's body goes into the attempt's error message.
ERROR_BODY_CHARS = 300
USER_AGENT = "rdq-target/1"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")


class HttpsCaller:
    """The handler function of one HTTPS binding (``binding.py`` registers it)."""

    def __init__(self, target: HttpsTarget, *, secrets: SecretSource | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.target = target
        self.secrets = secrets or SecretSource(target.secrets)
        self.clock = clock
        self.wall_clock = wall_clock
        self._tls = ssl.create_default_context(cafile=target.ca_file)

    def __call__(self, payload: Any, ctx: TaskContext) -> Any:
        target = self.target
        started = self.clock()
        budget = ctx.remaining_seconds() - DEADLINE_MARGIN_SECONDS
        if budget <= 0:
            raise TargetTimeout(f"{target.handler} -> {target.describe()}: no time left to call it")
        deadline = started + budget
        body = envelope_bytes(target.handler, payload, ctx, budget)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "Idempotency-Key": idempotency_key(ctx),
            "Rdq-Task-Id": ctx.task_id,
            "Rdq-Attempt": str(ctx.attempt),
            SIGNATURE_HEADER: signature_header(self.secrets.values(), int(self.wall_clock()), body),
        }
        if ctx.traceparent and _TRACEPARENT.fullmatch(ctx.traceparent):
            headers["traceparent"] = ctx.traceparent
            if ctx.tracestate and _TRACESTATE.fullmatch(ctx.tracestate):
                headers["tracestate"] = ctx.tracestate
        url = target.url
        for hops in range(MAX_SAME_ORIGIN_REDIRECTS + 1):
            status, answer_headers, data, complete = self._post(url, body, headers, deadline)
            if status not in (307, 308):
                break
            location = urljoin(url, answer_headers.get("location", ""))
            if hops == MAX_SAME_ORIGIN_REDIRECTS or not _same_origin(url, location):
                raise TargetRedirectRefused(self._said(status, started, f"redirect to {_origin(location)} refused "
                                                                        "(only the same origin is followed, twice)"))
            url = location
        return self._outcome(status, answer_headers, data, complete, started)

    # -- the request --------------------------------------------------------------------------
    def _post(self, url: str, body: bytes, headers: dict[str, str],
              deadline: float) -> tuple[int, dict[str, str], bytes, bool]:
        """One POST: (status, lower-cased headers, body up to the result bound + 1 byte, whether
        that is the whole body)."""
        parts = urlsplit(url)
        left = deadline - self.clock()
        if left <= 0:
            raise TargetTimeout(self._said(None, deadline, "no time left for the request"))
        connect_within = min(self.target.connect_timeout_seconds, left)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=connect_within,
                                               context=self._tls)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=connect_within)
        cutter = _SocketCutter(conn)
        timer = threading.Timer(left, cutter.cut)
        timer.daemon = True
        timer.start()
        started = self.clock()
        try:
            conn.connect()  # TCP and the TLS handshake, within connect_within
            assert conn.sock is not None
            conn.sock.settimeout(max(deadline - self.clock(), 0.001))
            conn.request("POST", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body, headers)
            response = conn.getresponse()
            limit = self.target.max_result_bytes
            data = response.read(limit + 1)
            if cutter.was_cut:  # what was read ended at the cut, not where the receiver ended it
                raise TimeoutError
            answer_headers = {key.lower(): value for key, value in response.getheaders()}
            return response.status, answer_headers, data, len(data) <= limit
        except ssl.SSLCertVerificationError as exc:
            raise TargetUnreachable(self._said(None, started, f"TLS certificate not trusted: {exc.verify_message}")) from None
        except (OSError, http.client.HTTPException) as exc:
            if cutter.was_cut or isinstance(exc, TimeoutError) or self.clock() >= deadline:
                raise TargetTimeout(self._said(None, started, "no answer within the time budget "
                                                              f"({deadline - started:.3g}s)")) from None
            raise TargetUnreachable(self._said(None, started, f"{type(exc).__name__}: {exc}")) from None
        finally:
            timer.cancel()
            cutter.close()

    # -- the answer ---------------------------------------------------------------------------
    def _outcome(self, status: int, headers: dict[str, str], data: bytes, complete: bool, started: float) -> Any:
        target = self.target
        if 200 <= status < 300:
            log.info("%s -> %s answered HTTP %d in %.0f ms", target.handler, target.describe(), status,
                     (self.clock() - started) * 1000,
                     extra={"rdq_target": {"handler": target.handler, "target": target.describe(), "status": status,
                                           "latency_ms": round((self.clock() - started) * 1000, 1)}})
            return _result(data, complete, headers.get("content-type", ""), target.max_result_bytes)
        detail = _text(data[:ERROR_BODY_CHARS])
        said = self._said(status, started, f"body: {detail}" if detail else "")
        if status in (429, 503):
            wait = _retry_after(headers.get("retry-after"), self.wall_clock())
            if wait is not None:
                log.info("%s; snoozed %gs (Retry-After), no retry spent", said, wait)
                raise Snooze(wait)
        if status == 408 or status == 429 or status >= 500:
            raise TargetHttpError(said, status)
        if 400 <= status < 500:
            if status in target.retry_statuses or not target.dead_on_4xx:
                raise TargetHttpError(said, status)
            raise TargetRejected(said, status)
        if 300 <= status < 400:
            raise TargetRedirectRefused(self._said(status, started, "redirect not followed (only 307/308 to the "
                                                                    "same origin are)"))
        raise TargetHttpError(said, status)

    def _said(self, status: int | None, started: float, detail: str) -> str:
        """The attempt's error message: handler, target, status, latency, and what went wrong."""
        answer = f"HTTP {status}" if status is not None else "no answer"
        took = max(self.clock() - started, 0.0) * 1000
        return f"{self.target.handler} -> {self.target.describe()}: {answer} after {took:.0f} ms" + (
            f"; {detail}" if detail else "")


class _SocketCutter:
    """Shuts a connection's socket from the deadline timer, so a blocked read returns. Under one
    lock with the close: a socket closed meanwhile (its descriptor perhaps reused) is never touched."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._closed = False
        self.was_cut = False

    def cut(self) -> None:
        with self._lock:
            sock = self._conn.sock
            if self._closed or sock is None:
                return
            self.was_cut = True
            try:
                # The plain socket's shutdown: an SSLSocket's own would tear down its TLS state
                # under the reading thread.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()


def _result(data: bytes, complete: bool, content_type: str, limit: int) -> Any:
    """The task's result from a 2xx body: its JSON when it is JSON, whole, and storable; else its
    text (at most ``limit`` bytes of it); None when empty."""
    if not data:
        return None
    if complete and "json" in content_type.lower():
        try:
            value = json.loads(data)
        except ValueError:
            pass
        else:
            if result_problem(value) is None:
                return value
    return _text(data[:limit])


def _text(data: bytes) -> str:
    # Valid text on every store: undecodable bytes and NUL become U+FFFD.
    return data.decode("utf-8", "replace").replace("\x00", "\ufffd")


def _retry_after(value: str | None, now: float) -> float | None:
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - now
        except (TypeError, ValueError, IndexError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        return "an invalid URL"
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


def _same_origin(a: str, b: str) -> bool:
    return _origin(a) == _origin(b) and urlsplit(b).scheme in ("https", "http")

