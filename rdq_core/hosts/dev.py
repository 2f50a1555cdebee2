"""``rdq dev``: the whole serverless system on one machine, driving the real Lambda handlers.

* the API handler (``rdq_core.hosts.aws_lambda.api``) served over HTTP on 127.0.0.1: each request is
  translated into the API Gateway REST proxy event Lambda would receive, and the proxy result
  back into an HTTP response, so the routes are the deployed API's (``lambda_host/routes.py``);
  the server's own refusals are problem+json from the same builder (``rdq_core.problems``);
* the worker and reaper handlers invoked on their schedules with EventBridge's scheduled-event
  shape and a Lambda context whose remaining time really counts down;
* the API's worker wake-up and the worker's fan-out run as local asynchronous invocations,
  bounded like the deployed reserved concurrency;
* the embedded SQLite store by default, migrated on start; the example handlers
  (``rdq_core.examples``) loaded unless others are named;
* the operator console (``rdq_core.hosts.console``) at ``/``: its static files (GET/HEAD of ``/``,
  ``/index.html`` and the asset names in ``console.assets.ASSETS``, nothing else) with a strict
  Content-Security-Policy; the page calls the API at ``v1/...`` on the same origin.

Optional bearer token: set ``RDQ_API_TOKEN`` and every API request needs ``Authorization: Bearer …``
(checked before the body is read); the console's static files are served without it, and the
page asks for the token. Without one, only ``Host: 127.0.0.1``, ``localhost`` or ``[::1]``
is served (DNS rebinding). Slow clients are bounded: see ``BoundedHTTPServer``.

Logs: the Lambda handlers log through this process's own logging (``rdq_core.engine.logs``): one
readable line per task outcome on a terminal, JSON lines otherwise or with ``--log-format json``
(``RDQ_LOG_FORMAT``). None of the Lambda context fields, and no EMF metrics: Powertools metrics
are off here (the deployed functions keep both).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from .console.assets import Asset, asset_for
from ..errors import ConfigurationError
from ..problems import PROBLEM_JSON, problem_json
from ..storage import redact_url  # re-exported: banners and tests use it from here
from ..text import printable

DEFAULT_PORT = 8787
log = logging.getLogger("rdq.dev")
http_log = logging.getLogger("rdq.dev.http")
#: Requests above this are refused by the local server before the handler sees them
#: (API Gateway's own hard limit is 10 MB; the API handler's body limit is lower still).
MAX_REQUEST_BYTES = 6 * 1024 * 1024
#: Request headers (names plus values) above this are refused with 431, as API Gateway refuses a
#: REST request whose request line and header values exceed 10,240 bytes. The stdlib parser
#: already caps the count at 100 headers (also answered 431).
MAX_HEADER_BYTES = 10_240
#: A connection that sends nothing for this long is closed (any single read or write).
IDLE_TIMEOUT_SECONDS = 10.0
#: A request must have arrived in full (request line, headers, body) this long after the server
#: started waiting for it, so a client trickling one byte per idle period is cut off too.
REQUEST_DEADLINE_SECONDS = 30.0
#: Connections served at once; the rest wait in the listen backlog (no thread, no buffer).
MAX_CONNECTIONS = 32
#: Request bodies buffered at once, all connections together, counted by declared length: a
#: request that does not fit is refused with 503 before its body is read.
MAX_BUFFERED_BODY_BYTES = 32 * 1024 * 1024
#: Without a token, only these Host names are served (DNS rebinding: see _host_refusal).
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
_HOST_PORT = re.compile(r"^(\[[^\]]*\]|[^:\[\]]*)(?::([0-9]{1,5}))?$")


def _configure_environment(storage_url: str, handler_modules: list[str] | None) -> None:
    # Set before the Lambda host modules are imported: Powertools reads its settings at import.
    os.environ["RDQ_STORAGE_URL"] = storage_url
    os.environ["RDQ_HANDLERS"] = ",".join(handler_modules or ["rdq_core.examples"])
    os.environ.setdefault("RDQ_WORKER_FUNCTION", "rdq-dev-worker")
    os.environ.setdefault("RDQ_WAKE_DEBOUNCE_SECONDS", "0.2")
    os.environ.setdefault("RDQ_MAX_WORKER_CONCURRENCY", "2")
    os.environ.setdefault("RDQ_AUTH_MODE", "none")
    # Large payloads (rdq_core/engine/payloads.py): without a bucket, a directory next to the store stands
    # in for it (same references; the API's upload and download URLs are file: URLs into it).
    if not os.environ.get("RDQ_PAYLOAD_BUCKET"):
        database = storage_url.split("?")[0][len("sqlite:///"):] if storage_url.startswith("sqlite:///") else ""
        home = os.path.dirname(os.path.abspath(database)) if database and database != ":memory:" else os.getcwd()
        os.environ.setdefault("RDQ_PAYLOAD_DIR", os.path.join(home, "rdq-payloads"))
    # Each reaper tick advances bulk operations until the next tick is due: a running operation
    # keeps its rate, and reaping keeps its cadence.
    os.environ.setdefault("RDQ_OPERATION_SECONDS", os.environ.get("RDQ_DEV_REAPER_EVERY_SECONDS", "5"))
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "rdq-dev")
    os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    # Nothing reads EMF here: record no metrics, so no blob is ever printed (not even
    # Powertools' automatic flush at 100 values, which ignores its own switch).
    os.environ["POWERTOOLS_METRICS_DISABLED"] = "true"
    # The handlers' logs go through this process's logging (rdq_core.engine.logs), not Powertools
    # JSON; and Powertools must not attach its duplicate-suppressing filter to our handler.
    os.environ["RDQ_LOCAL_LOGGING"] = "true"
    os.environ["POWERTOOLS_LOG_DEDUPLICATION_DISABLED"] = "true"
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # Lifecycle events (rdq_core/events.py) are on: without a bus the reaper logs each one and
    # GET /v1/events shows them.
    os.environ.setdefault("RDQ_EVENTS", "on")


class LocalAsyncInvoker:
    """Stands in for ``boto3.client("lambda")``: an ``InvocationType=Event`` invoke runs the
    worker handler on a thread, at most ``limit`` at once (extra invocations are dropped, as a
    throttled reserved-concurrency function would defer them; the schedule picks the work up)."""

    def __init__(self, run_worker: Callable[[dict[str, Any]], None], limit: int) -> None:
        self._run_worker = run_worker
        self._slots = threading.BoundedSemaphore(limit)

    def invoke(
        self, *, FunctionName: str, InvocationType: str = "RequestResponse", Payload: bytes = b"{}", **_: Any
    ) -> dict[str, Any]:
        if not self._slots.acquire(blocking=False):
            return {"StatusCode": 429}
        event = json.loads(Payload or b"{}")

        def run() -> None:
            try:
                self._run_worker(event)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="rdq-dev-async-worker", daemon=True).start()
        return {"StatusCode": 202}


class DevHost:
    def __init__(self, storage_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 handler_modules: list[str] | None = None) -> None:
        _check_host(host)
        _configure_environment(storage_url, handler_modules)
        from .aws_lambda import api, connection, invoker, reaper, worker  # after env
        from .aws_lambda.local_invoke import LocalLambdaContext, scheduled_event
        from .aws_lambda.settings import Settings

        self._api, self._worker, self._reaper = api, worker, reaper
        self._context, self._scheduled_event = LocalLambdaContext, scheduled_event
        self.settings = Settings.from_env()
        self.storage = connection.shared_storage(self.settings)
        self.storage.migrate()
        self._connection = connection
        self.worker_every = float(os.environ.get("RDQ_DEV_WORKER_EVERY_SECONDS", "1"))
        self.reaper_every = float(os.environ.get("RDQ_DEV_REAPER_EVERY_SECONDS", "5"))
        self.worker_timeout = float(os.environ.get("RDQ_DEV_WORKER_TIMEOUT_SECONDS", "30"))
        invoker.invoker.client = LocalAsyncInvoker(self._invoke_worker, self.settings.max_worker_concurrency)
        from ..events import LogPublisher

        # Without a bus the reaper delivers the outbox here: a log line per event, kept for the route.
        self.events = LogPublisher()
        if not os.environ.get("RDQ_EVENT_BUS"):
            reaper.publisher = self.events
        # Schedules (rdq_core.engine.schedules): fired here from the local schedules file, with the ids a
        # deployed stack's EventBridge Scheduler trigger and `rdq worker` use.
        from ..client import Client
        from ..engine.schedules import LocalScheduleBook, ScheduleFirer

        self.schedules_every = float(os.environ.get("RDQ_DEV_SCHEDULES_EVERY_SECONDS", "1"))
        self.schedule_firer = ScheduleFirer(Client(self.storage), LocalScheduleBook())
        self.stopping = threading.Event()
        # The resolver keeps the current event on a module-level app, like one Lambda container
        # serving one request at a time; serialize requests the same way.
        self._api_lock = threading.Lock()
        self.server = BoundedHTTPServer((host, port), _request_handler_class(self))
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- Lambda invocations ------------------------------------------------------------------
    def api_unauthorized(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The API's own token check, run on the headers alone (before the body is read)."""
        return self._api._unauthorized(self.settings, event)

    def call_api(self, event: dict[str, Any]) -> dict[str, Any]:
        with self._api_lock:
            answer: dict[str, Any] = self._api.lambda_handler(event, self._context("rdq-dev-api", 29))
            return answer

    def _invoke_worker(self, event: dict[str, Any]) -> None:
        try:
            self._worker.lambda_handler(event, self._context("rdq-dev-worker", self.worker_timeout))
        except Exception as exc:  # a failed invocation must not stop the dev host
            log.error("worker invocation failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def _invoke_reaper(self) -> None:
        try:
            self._reaper.lambda_handler(self._scheduled_event("rdq-dev-reaper-schedule"), self._context("rdq-dev-reaper", 60))
        except Exception as exc:
            log.error("reaper invocation failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def _schedule(self, every: float, invoke: Callable[[], None]) -> None:
        next_run = time.monotonic()
        while not self.stopping.wait(max(0.0, next_run - time.monotonic())):
            invoke()
            next_run = max(next_run + every, time.monotonic())

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, name="rdq-dev-http", daemon=True),
            threading.Thread(
                target=self._schedule,
                args=(self.worker_every, lambda: self._invoke_worker(self._scheduled_event("rdq-dev-worker-schedule"))),
                name="rdq-dev-worker-schedule", daemon=True),
            threading.Thread(target=self._schedule, args=(self.reaper_every, self._invoke_reaper),
                             name="rdq-dev-reaper-schedule", daemon=True),
            threading.Thread(target=self.schedule_firer.run, args=(self.stopping, self.schedules_every),
                             name="rdq-dev-schedules", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.closing.set()
        self.server.shutdown()
        self.server.server_close()
        for thread in self._threads:
            thread.join(timeout=self.worker_timeout)
        self._connection.close_shared_storage()

    def banner(self) -> str:
        auth = ' -H "Authorization: Bearer $RDQ_API_TOKEN"' if self.settings.api_token else ""
        base = self.url
        return "\n".join([
            f"rdq dev: API on {base}  (store: {redact_url(os.environ['RDQ_STORAGE_URL'])},"
            f" handlers: {os.environ['RDQ_HANDLERS']})",
            f"  console: {base}/" + ("  (it asks for RDQ_API_TOKEN)" if self.settings.api_token else ""),
            f"  worker every {self.worker_every:g}s, reaper every {self.reaper_every:g}s,"
            f" schedules from {self.schedule_firer.book.path} every {self.schedules_every:g}s; Ctrl-C to stop",
            f"  lifecycle events: logged as the reaper delivers them, and at {base}{EVENTS_PATH}",
            "try:",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"greet\", \"payload\": {\"name\": \"Ada\"}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"flaky\", \"payload\": {\"failures\": 2}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"fail_until_redrive\", \"max_attempts\": 3}'",
            f"  curl -s{auth} {base}/v1/queues/demo/stats",
            f"  curl -s{auth} {base}/v1/queues/demo/dlq",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/dlq:redrive -H 'Content-Type: application/json'"
            " -d '{\"all\": true}'",
            f"  curl -s{auth} {base}/v1/tasks/<id>",
        ])


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most ``MAX_CONNECTIONS`` of them; idle sockets time out
    (the handler's ``timeout``), requests that take too long to arrive are cut off, and request
    bodies buffered at once are bounded. Without these, clients that declare a large body and
    never finish it hold a thread and a buffer each for as long as they like."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting for a slot wait here, in the kernel

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.closing = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._buffered = 0
        self._deadlines: dict[socket.socket, float] = {}
        threading.Thread(target=self._enforce_deadlines, name="rdq-dev-http-deadlines", daemon=True).start()

    # -- connection slots --------------------------------------------------------------------
    def process_request(self, request: Any, client_address: Any) -> None:
        # Runs on the accepting thread: while every slot is busy, accept nothing more.
        while not self._slots.acquire(timeout=0.2):
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (or was cut off) mid-request is not a server error.
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    # -- body budget -------------------------------------------------------------------------
    def reserve_body(self, length: int) -> bool:
        with self._lock:
            if self._buffered + length > MAX_BUFFERED_BODY_BYTES:
                return False
            self._buffered += length
            return True

    def release_body(self, length: int) -> None:
        with self._lock:
            self._buffered -= length

    # -- request deadlines -------------------------------------------------------------------
    def watch(self, connection: socket.socket) -> None:
        with self._lock:
            self._deadlines[connection] = time.monotonic() + REQUEST_DEADLINE_SECONDS

    def unwatch(self, connection: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(connection, None)

    def _enforce_deadlines(self) -> None:
        while not self.closing.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the handler ends
                except OSError:
                    pass


class GuardedRequestHandler(BaseHTTPRequestHandler):
    """What rdq's two loopback servers (``rdq dev`` and ``rdq console``) share: a deadline on every
    connection (``BoundedHTTPServer.watch``), framing decided on the headers alone, a bounded
    Content-Length, bodies read as they arrive, and problem+json refusals that close the
    connection without the kernel resetting it. A subclass writes ``_handle``."""

    server: BoundedHTTPServer  # the server that made this handler (socketserver sets it)
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_SECONDS  # applied to the socket: every read and write

    _refused_unread = False

    def _handle(self) -> None:
        raise NotImplementedError

    def _dispatch(self) -> None:
        self._handle()  # looked up on the instance: the subclass's

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _dispatch

    def __getattr__(self, name: str) -> Any:
        # Any other method (TRACE, PROPFIND, ...) is handled too, answered as problem+json,
        # instead of with the stdlib's 501 HTML page.
        if name.startswith("do_"):
            return self._handle
        raise AttributeError(name)

    def handle_one_request(self) -> None:
        self.server.watch(self.connection)
        try:
            super().handle_one_request()
        finally:
            self.server.unwatch(self.connection)

    def finish(self) -> None:
        super().finish()
        if self._refused_unread:
            self._drain()

    def _drain(self) -> None:
        # Closing a socket with unread input makes the kernel send a reset, which can destroy the
        # answer before the client reads it. Say we are done, then discard a bounded amount of
        # what is still arriving (at most 64 KiB, for at most a second).
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            discarded = 0
            while discarded < 65536 and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                discarded += len(chunk)
        except OSError:
            pass

    def _framing_refusal(self) -> tuple[int, str] | None:
        """Why the request line and headers alone refuse this request (before a byte of body is
        read), or None."""
        if not self.path.isascii() or not self.path.isprintable():
            # Raw bytes past ASCII (the stdlib reads them as Latin-1) name no route, and would
            # fail later where the path is encoded again: a clear 400 instead.
            return 400, "the request target must be ASCII; percent-encode other characters"
        if sum(len(name) + len(value) for name, value in self.headers.items()) > MAX_HEADER_BYTES:
            return 431, f"the request headers exceed {MAX_HEADER_BYTES} bytes"
        if self.headers.get_all("Transfer-Encoding"):
            # Any coding at all (``gzip, chunked``, two headers, ...): a body framed by anything
            # but Content-Length could hold a second, smuggled request.
            return 411, "send a Content-Length; Transfer-Encoding is not supported"
        return None

    def _declared_length(self, limit: int) -> int | tuple[int, str]:
        """The body's declared length, or why it is refused."""
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) > 1:
            return 400, "send one Content-Length header"
        try:
            length = int(lengths[0]) if lengths else 0
        except ValueError:
            return 400, "Content-Length is not a number"
        if length < 0 or length > limit:
            return 413, f"the request exceeds {limit} bytes"
        return length

    def _declares_body(self) -> bool:
        return (self.headers.get("Content-Length") or "0").strip() not in ("", "0")

    def _read_body(self, length: int) -> bytes | None:
        # In pieces, as they arrive: memory follows what was sent, not what was declared.
        body = bytearray()
        while len(body) < length:
            chunk = self.rfile.read1(min(65536, length - len(body)))
            if not chunk:
                return None
            body += chunk
        return bytes(body)

    def _send(self, status: int, headers: Any, payload: bytes, *, unread: bool = False) -> None:
        """One answer; ``unread``: the request's body was not read, so the connection closes."""
        self.send_response(status)
        given: set[str] = set()
        for name, value in (headers.items() if hasattr(headers, "items") else headers):
            if name.lower() not in ("content-length", "connection"):
                self.send_header(name, value)
                given.add(name.lower())
        # Answers are per caller and per moment, and never to be sniffed into HTML; the static
        # files say their own Cache-Control.
        for name, value in (("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")):
            if name.lower() not in given:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        if unread:
            self.send_header("Connection", "close")
            self.close_connection = True
            self._refused_unread = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _refuse(self, status: int, detail: str, extra_headers: dict[str, str] | None = None) -> None:
        self._send(status, {"Content-Type": PROBLEM_JSON, **(extra_headers or {})}, problem_json(status, detail).encode(),
                   unread=True)  # whatever the client still sends was not read

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Requests the stdlib refuses before routing (bad request line, too many or too long
        # headers, URI too long) get a problem+json body like every other error.
        if code == HTTPStatus.NOT_IMPLEMENTED:
            code = HTTPStatus.METHOD_NOT_ALLOWED
        if self.request_version == "HTTP/0.9":  # unparsable request line: still answer with a status line
            self.request_version = "HTTP/1.0"
        self.log_error("code %d, message %s", code, message)
        self._refuse(int(code), message or HTTPStatus(code).phrase)


def _host_refusal(headers: Any) -> tuple[int, str] | None:
    """Without a token, the status and reason this request's ``Host`` (or ``Origin``) is
    refused with, else ``None``.

    DNS rebinding: a web page on ``attacker.example`` re-points that name at 127.0.0.1 once
    loaded, and its scripts then reach this server as a same-origin site -- with
    ``Host: attacker.example:PORT``. Binding to loopback does not stop it; naming the host does.
    A page on another loopback port is another origin too: without a token nothing else tells
    its requests from the console's own, so its ``Origin`` is refused as well.
    """
    return (loopback_refusal(headers, "without RDQ_API_TOKEN the dev API")
            or cross_origin_refusal(headers, "without RDQ_API_TOKEN the dev API"))


def cross_origin_refusal(headers: Any, who: str) -> tuple[int, str] | None:
    """The refusal (403, reason) of a request a page of another origin sent, even one on another
    loopback port: an ``Origin`` that is not ``http://<Host>``, or a ``Sec-Fetch-Site`` of
    ``cross-site``/``same-site``. Requests without either (curl, rdq's clients) pass."""
    host = (headers.get("Host") or "").strip().lower()
    for origin in headers.get_all("Origin") or []:
        if origin.strip().lower().rstrip("/") != f"http://{host}":
            return 403, f"{who} refuses requests from other origins"
    site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
    if site in ("cross-site", "same-site"):
        return 403, f"{who} refuses requests from other sites"
    return None


def loopback_refusal(headers: Any, who: str) -> tuple[int, str] | None:
    """The refusal (status, reason) of a request whose ``Host`` is not a loopback name or whose
    ``Origin`` is not a loopback origin, else ``None``; ``who`` starts the reason
    ("without RDQ_API_TOKEN the dev API")."""
    hosts = headers.get_all("Host") or []
    if len(hosts) != 1:
        return 400, "send exactly one Host header"
    match = _HOST_PORT.match(hosts[0].strip().lower())
    if not match or match.group(1) not in LOOPBACK_HOSTS:
        return 421, f"{who} answers only Host 127.0.0.1, localhost or [::1]"
    # A cross-site page's request carries its own origin: refuse it, whatever its Host.
    for origin in headers.get_all("Origin") or []:
        scheme, _, rest = origin.strip().lower().partition("://")
        origin_host = _HOST_PORT.match(rest.rstrip("/"))
        if scheme not in ("http", "https") or not origin_host or origin_host.group(1) not in LOOPBACK_HOSTS:
            return 403, f"{who} refuses requests from other origins"
    return None


def _check_host(host: str) -> None:
    """The dev API has no TLS; without a token it must stay on the loopback interface."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not os.environ.get("RDQ_API_TOKEN"):
        raise ConfigurationError(f"refusing to serve the dev API on {host} without RDQ_API_TOKEN; use 127.0.0.1 or set a token")


#: The dev host's own route: the lifecycle events its reaper delivered (not on a deployed API).
EVENTS_PATH = "/v1/events"


def events_query(path: str) -> tuple[int, int]:
    """``after`` (a number, default 0) and ``limit`` (1..1000, default 100) of an events request."""
    query = parse_qs(urlsplit(path).query, keep_blank_values=True)
    unknown = set(query) - {"after", "limit"}
    if unknown:
        raise ValueError(f"unknown query parameter {sorted(unknown)[0]!r}; use after and limit")
    values: dict[str, int] = {}
    for name, default, low, high in (("after", 0, 0, 2**63 - 1), ("limit", 100, 1, 1000)):
        given = query.get(name, [str(default)])
        if len(given) != 1 or not given[0].isascii() or not given[0].isdigit() or not low <= int(given[0]) <= high:
            raise ValueError(f"{name} must be a whole number in [{low}, {high}]")
        values[name] = int(given[0])
    return values["after"], values["limit"]


def _request_handler_class(host: DevHost) -> type[BaseHTTPRequestHandler]:
    from .aws_lambda.local_invoke import api_proxy_event, proxy_result_body, proxy_result_headers

    class ProxyRequestHandler(GuardedRequestHandler):
        server_version = "rdq-dev"

        def _handle(self) -> None:
            # Everything that can be decided from the headers is, before a byte of body is read.
            refusal = self._framing_refusal()
            if refusal:
                return self._refuse(*refusal)
            if not host.settings.api_token:
                refusal = _host_refusal(self.headers)
                if refusal:
                    return self._refuse(*refusal)
            if self.command in ("GET", "HEAD"):
                # The console's static files need no token: the page asks for it, then sends it.
                asset = asset_for(self.path.split("?", 1)[0])
                if asset is not None:
                    return self._send_asset(asset)
            headers: dict[str, str] = {}
            for name, value in self.headers.items():
                headers[name] = f"{headers[name]},{value}" if name in headers else value
            denied = host.api_unauthorized({"headers": headers, "path": self.path.split("?")[0]})
            if denied is not None:
                return self._send_result(denied, close=True)
            if self.command in ("GET", "HEAD") and self.path.split("?", 1)[0] == EVENTS_PATH:
                return self._send_events()
            length = self._declared_length(MAX_REQUEST_BYTES)
            if isinstance(length, tuple):
                return self._refuse(*length)
            if not self.server.reserve_body(length):
                return self._refuse(503, "too many request bodies in progress; retry later", {"Retry-After": "5"})
            try:
                body = self._read_body(length)
                self.server.unwatch(self.connection)  # it has arrived
                if body is None:
                    self.close_connection = True  # the client stopped sending: nothing to answer
                    return None
                event = api_proxy_event(self.command, self.path, headers, body, source_ip=self.client_address[0])
                del body
                self._send_result(host.call_api(event))
            finally:
                self.server.release_body(length)
            return None

        def _send_result(self, result: dict[str, Any], close: bool = False) -> None:
            self._send(int(result.get("statusCode", 500)), list(proxy_result_headers(result)), proxy_result_body(result),
                       unread=close)

        def _send_events(self) -> None:
            """``GET /v1/events?after=&limit=``: the events this host delivered, oldest first, each
            numbered (``seq``); ``next_after`` is the number to ask after next time."""
            try:
                after, limit = events_query(self.path)
            except ValueError as exc:
                return self._refuse(400, str(exc))
            found, last = host.events.page(after, limit)
            body = json.dumps({"events": found, "next_after": last}).encode()
            self._send(200, {"Content-Type": "application/json"}, body, unread=self._declares_body())
            return None

        def _send_asset(self, asset: Asset) -> None:
            # A GET with a body: it was not read, so this connection cannot carry another request.
            self._send(200, asset.headers(), asset.body, unread=self._declares_body())

        def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
            # The request line is the client's text: escape it, as the stdlib's own log_message
            # does, so it cannot drive the operator's terminal or forge a log line.
            http_log.info("%s %s", self.address_string(), printable(format % args))

    return ProxyRequestHandler


def run_dev(storage_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
            handler_modules: list[str] | None = None) -> None:
    """Run the dev host until Ctrl-C or SIGTERM (the ``rdq dev`` command)."""
    from ..engine.logs import configure_logging, configured_format, default_log_format, default_log_level

    if configured_format() is None:  # ``rdq dev`` configured it already; ``python -m`` did not
        configure_logging(default_log_format(), default_log_level())
    dev = DevHost(storage_url, host, port, handler_modules)
    stop_requested = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop_requested.set())
    dev.start()
    print(dev.banner(), flush=True)
    try:
        while not stop_requested.wait(0.5):
            pass
    finally:
        print("rdq dev: stopping", flush=True)
        dev.stop()


def main(argv: list[str] | None = None) -> None:
    from ..storage import default_storage_url

    parser = argparse.ArgumentParser(prog="python -m rdq_core.hosts.dev", description="rdq dev: the local serverless host")
    parser.add_argument("--storage", default=default_storage_url())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--handlers", default="", help="handler modules, comma-separated (default: rdq_core.examples)")
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.handlers.split(",") if m.strip()] or None
    run_dev(args.storage, args.host, args.port, modules)


if __name__ == "__main__":
    main()
