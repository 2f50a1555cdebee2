"""Local HTTP serving: what ``rdq dev`` and ``rdq console`` share, the two servers rdq runs on a
loopback address.

* ``BoundedHTTPServer``: a thread per connection, bounded in connections, in time per request
  and in request bodies buffered at once;
* ``GuardedRequestHandler``: framing decided on the headers alone, one way to take a request
  body (``_with_body``: a bounded Content-Length, within the server's budget, read as it
  arrives), problem+json refusals that close the connection cleanly, the console's static
  files with their Content-Security-Policy (``console.assets``), request lines logged escaped;
* ``loopback_refusal`` and ``cross_origin_refusal``: DNS rebinding and other local pages;
* ``serve_until_stopped``: a server's process, until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from ..problems import PROBLEM_JSON, problem_json
from ..text import printable
from .console.assets import Asset, asset_for
from .signals import stop_on_signals

log = logging.getLogger("rdq.localhttp")

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
#: The Host names a loopback server answers when nothing else (a token) tells its callers apart.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
_HOST_PORT = re.compile(r"^(\[[^\]]*\]|[^:\[\]]*)(?::([0-9]{1,5}))?$")


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
        self._serving: threading.Thread | None = None
        threading.Thread(target=self._enforce_deadlines, name="rdq-http-deadlines", daemon=True).start()

    @property
    def base_url(self) -> str:
        """``http://host:port``, with the port the system chose for port 0."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self, thread_name: str) -> None:
        """Serve on a thread of its own until ``close``."""
        self._serving = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name=thread_name,
                                         daemon=True)
        self._serving.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, close the socket, and wait up to ``timeout`` for the serving thread."""
        self.closing.set()
        self.shutdown()
        self.server_close()
        if self._serving is not None:
            self._serving.join(timeout=timeout)

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
    connection without the kernel resetting it. A subclass writes ``_handle`` and names the
    logger its request lines go to (``request_log``)."""

    server: BoundedHTTPServer  # the server that made this handler (socketserver sets it)
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_SECONDS  # applied to the socket: every read and write
    request_log = log

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

    # -- the request -------------------------------------------------------------------------
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

    def _with_body(self, limit: int, answer: Callable[[bytes], None]) -> None:
        """Read the request's body (at most ``limit`` bytes, within the server's budget of bodies
        buffered at once) and call ``answer`` with it while it still counts against that budget.
        A refused body is answered here; a client that stops sending gets no answer."""
        length = self._declared_length(limit)
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
            # Handed over, not kept: ``answer`` may drop the bytes once it has what it needs.
            received = [body]
            del body
            answer(received.pop())
        finally:
            self.server.release_body(length)
        return None

    # -- answers -----------------------------------------------------------------------------
    def _send(self, status: int, headers: Mapping[str, str] | list[tuple[str, str]], payload: bytes, *,
              unread: bool = False) -> None:
        """One answer; ``unread``: the request's body was not read, so the connection closes."""
        self.send_response(status)
        given: set[str] = set()
        for name, value in (headers.items() if isinstance(headers, Mapping) else headers):
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

    def _send_json(self, status: int, value: Any) -> None:
        """A JSON answer to a request whose body is not read (a GET)."""
        self._send(status, {"Content-Type": "application/json"}, json.dumps(value).encode(), unread=self._declares_body())

    def _send_asset_of(self, path: str) -> bool:
        """Answer a GET or HEAD of one of the console's static files (``console.assets``) with its
        headers (the Content-Security-Policy among them); False when ``path`` names none."""
        asset: Asset | None = asset_for(path) if self.command in ("GET", "HEAD") else None
        if asset is None:
            return False
        # A GET with a body: it was not read, so this connection cannot carry another request.
        self._send(200, asset.headers(), asset.body, unread=self._declares_body())
        return True

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

    def _loggable(self, line: str) -> str:
        """The request line as it may be logged (a subclass hides what must not be)."""
        return line

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        # The request line is the client's text: escape it, as the stdlib's own log_message
        # does, so it cannot drive the operator's terminal or forge a log line.
        self.request_log.info("%s %s", self.address_string(), printable(self._loggable(format % args)))


# -- who may call ------------------------------------------------------------------------------
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
    ("without RDQ_API_TOKEN the dev API").

    DNS rebinding: a web page on ``attacker.example`` re-points that name at 127.0.0.1 once
    loaded, and its scripts then reach the server as a same-origin site -- with
    ``Host: attacker.example:PORT``. Binding to loopback does not stop it; naming the host does."""
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


# -- the process -------------------------------------------------------------------------------
def serve_until_stopped(name: str, start: Callable[[], None], stop: Callable[[], None], banner: str) -> None:
    """Start, print ``banner``, and serve until Ctrl-C or SIGTERM (caught on the main thread
    only); then say so and stop. ``name`` starts the closing line."""
    stop_requested = threading.Event()
    stop_on_signals(stop_requested.set)
    start()
    print(banner, flush=True)
    try:
        while not stop_requested.wait(0.5):
            pass
    finally:
        print(f"{name}: stopping", flush=True)
        stop()
