"""Helpers for tests that run rdq itself as a process: its address, and its environment; and a
scripted loopback HTTP server for tests that stand in for an API.

Servers (PostgreSQL, Redis, nx-27017) are started, owned and stopped by
``rdq_testing.servers``, not here.
"""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

#: The first line ``rdq dev`` prints once it serves: its real address, so a test can start it
#: with ``--port 0`` (the kernel picks a free port at bind time) instead of guessing a free port
#: beforehand and racing every other process for it.
_DEV_BANNER = re.compile(r"rdq dev: API on http://(\S+):(\d+)\s")

#: Variables the test harness itself reads (which servers to use); never host settings.
_HARNESS_PREFIXES = ("RDQ_TEST_", "RDQ_BENCH_")


def rdq_dev_address(output: str) -> tuple[str, int] | None:
    """(host, port) from ``rdq dev``'s banner in ``output``, or None if not printed yet."""
    found = _DEV_BANNER.search(output)
    return (found.group(1), int(found.group(2))) if found else None


def rdq_settings(environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that configure an rdq host (every ``RDQ_*`` but the harness's
    own): a test that sets up a host clears these first, so the caller's shell cannot leak in.
    Derived from the prefix, not listed, so a new setting can never be missed."""
    return [name for name in environ if name.startswith("RDQ_") and not name.startswith(_HARNESS_PREFIXES)]


def without_rdq_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for an rdq subprocess, with no host setting of the caller's."""
    settings = set(rdq_settings(environ))
    return {name: value for name, value in environ.items() if name not in settings}


#: A scripted server's answer: status, headers and body.
Answer = tuple[int, dict[str, str], bytes]


class LoopbackHttpServer:
    """``handler`` served on a free loopback port, on a daemon thread, until ``stop()``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class ScriptedHttpServer(LoopbackHttpServer):
    """An HTTP/1.1 server on a free loopback port whose every answer the test chooses:
    ``answer(method, path, headers, body)``, for any method. Stopped with ``stop()``."""

    def __init__(self, answer: Callable[[str, str, dict[str, str], bytes], Answer]) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def respond(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, payload = answer(self.command, self.path, dict(self.headers.items()), body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = do_OPTIONS = do_TRACE = respond

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(Handler)


def raw_request(port: int, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw request (the path is sent exactly as given): status, headers (lower-case), body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        connection.putrequest(method, path, skip_host="Host" in (headers or {}), skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()
