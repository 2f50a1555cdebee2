"""``rdq dev``: the whole serverless system on one machine, driving the real Lambda handlers.

* the API handler (``rdq_core.lambda_host.api``) served over HTTP on 127.0.0.1: each request is
  translated into the API Gateway REST proxy event Lambda would receive, and the proxy result
  back into an HTTP response;
* the worker and reaper handlers invoked on their schedules with EventBridge's scheduled-event
  shape and a Lambda context whose remaining time really counts down;
* the API's worker wake-up and the worker's fan-out run as local asynchronous invocations,
  bounded like the deployed reserved concurrency;
* the embedded SQLite store by default, migrated on start; the example handlers
  (``rdq_core.examples``) loaded unless others are named.

Optional bearer token: set ``RDQ_API_TOKEN`` and every request needs ``Authorization: Bearer …``.

Logs: the Lambda handlers log through this process's own logging (``rdq_core.logs``): one
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
import signal
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from .storage import redact_url  # noqa: F401 - re-exported: banners and tests use it from here

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


def _configure_environment(storage_url: str, handler_modules: list[str] | None) -> None:
    # Set before the Lambda host modules are imported: Powertools reads its settings at import.
    os.environ["RDQ_STORAGE_URL"] = storage_url
    os.environ["RDQ_HANDLERS"] = ",".join(handler_modules or ["rdq_core.examples"])
    os.environ.setdefault("RDQ_WORKER_FUNCTION", "rdq-dev-worker")
    os.environ.setdefault("RDQ_WAKE_DEBOUNCE_SECONDS", "0.2")
    os.environ.setdefault("RDQ_MAX_WORKER_CONCURRENCY", "2")
    os.environ.setdefault("RDQ_AUTH_MODE", "none")
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "rdq-dev")
    os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    # Nothing reads EMF here: record no metrics, so no blob is ever printed (not even
    # Powertools' automatic flush at 100 values, which ignores its own switch).
    os.environ["POWERTOOLS_METRICS_DISABLED"] = "true"
    # The handlers' logs go through this process's logging (rdq_core.logs), not Powertools
    # JSON; and Powertools must not attach its duplicate-suppressing filter to our handler.
    os.environ["RDQ_LOCAL_LOGGING"] = "true"
    os.environ["POWERTOOLS_LOG_DEDUPLICATION_DISABLED"] = "true"
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


class LocalAsyncInvoker:
    """Stands in for ``boto3.client("lambda")``: an ``InvocationType=Event`` invoke runs the
    worker handler on a thread, at most ``limit`` at once (extra invocations are dropped, as a
    throttled reserved-concurrency function would defer them; the schedule picks the work up)."""

    def __init__(self, run_worker: Callable[[dict[str, Any]], None], limit: int) -> None:
        self._run_worker = run_worker
        self._slots = threading.BoundedSemaphore(limit)

    def invoke(self, *, FunctionName: str, InvocationType: str = "RequestResponse", Payload: bytes = b"{}", **_: Any) -> dict[str, Any]:
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
        from .lambda_host import api, connection, invoker, reaper, worker  # noqa: PLC0415 - after env
        from .lambda_host.local_invoke import LocalLambdaContext, scheduled_event
        from .lambda_host.settings import Settings

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
        self.stopping = threading.Event()
        # The resolver keeps the current event on a module-level app, like one Lambda container
        # serving one request at a time; serialize requests the same way.
        self._api_lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), _request_handler_class(self))
        self.server.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    # -- Lambda invocations ------------------------------------------------------------------
    def call_api(self, event: dict[str, Any]) -> dict[str, Any]:
        with self._api_lock:
            return self._api.lambda_handler(event, self._context("rdq-dev-api", 29))

    def _invoke_worker(self, event: dict[str, Any]) -> None:
        try:
            self._worker.lambda_handler(event, self._context("rdq-dev-worker", self.worker_timeout))
        except Exception as exc:  # noqa: BLE001 - a failed invocation must not stop the dev host
            log.error("worker invocation failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def _invoke_reaper(self) -> None:
        try:
            self._reaper.lambda_handler(self._scheduled_event("rdq-dev-reaper-schedule"), self._context("rdq-dev-reaper", 60))
        except Exception as exc:  # noqa: BLE001
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
            threading.Thread(target=self._schedule, args=(self.worker_every, lambda: self._invoke_worker(self._scheduled_event("rdq-dev-worker-schedule"))), name="rdq-dev-worker-schedule", daemon=True),
            threading.Thread(target=self._schedule, args=(self.reaper_every, self._invoke_reaper), name="rdq-dev-reaper-schedule", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        for thread in self._threads:
            thread.join(timeout=self.worker_timeout)
        self._connection.close_shared_storage()

    def banner(self) -> str:
        auth = ' -H "Authorization: Bearer $RDQ_API_TOKEN"' if self.settings.api_token else ""
        base = self.url
        return "\n".join([
            f"rdq dev: API on {base}  (store: {redact_url(os.environ['RDQ_STORAGE_URL'])}, handlers: {os.environ['RDQ_HANDLERS']})",
            f"  worker every {self.worker_every:g}s, reaper every {self.reaper_every:g}s; Ctrl-C to stop",
            "try:",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json' -d '{{\"handler\": \"greet\", \"payload\": {{\"name\": \"Ada\"}}}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json' -d '{{\"handler\": \"flaky\", \"payload\": {{\"failures\": 2}}}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json' -d '{{\"handler\": \"fail_until_redrive\", \"max_attempts\": 3}}'",
            f"  curl -s{auth} {base}/v1/queues/demo/stats",
            f"  curl -s{auth} {base}/v1/queues/demo/dlq",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/dlq:redrive -H 'Content-Type: application/json' -d '{{\"all\": true}}'",
            f"  curl -s{auth} {base}/v1/tasks/<id>",
        ])


def _check_host(host: str) -> None:
    """The dev API has no TLS; without a token it must stay on the loopback interface."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not os.environ.get("RDQ_API_TOKEN"):
        raise ValueError(f"refusing to serve the dev API on {host} without RDQ_API_TOKEN; use 127.0.0.1 or set a token")


def _request_handler_class(host: DevHost) -> type[BaseHTTPRequestHandler]:
    from .lambda_host.api import problem_title
    from .lambda_host.local_invoke import api_proxy_event, proxy_result_body, proxy_result_headers

    class ProxyRequestHandler(BaseHTTPRequestHandler):
        server_version = "rdq-dev"
        protocol_version = "HTTP/1.1"

        def _handle(self) -> None:
            length_text = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                return self._refuse(411, "send a Content-Length; chunked bodies are not supported")
            try:
                length = int(length_text) if length_text else 0
            except ValueError:
                return self._refuse(400, "Content-Length is not a number")
            if length < 0 or length > MAX_REQUEST_BYTES:
                return self._refuse(413, f"the request exceeds {MAX_REQUEST_BYTES} bytes")
            if sum(len(name) + len(value) for name, value in self.headers.items()) > MAX_HEADER_BYTES:
                return self._refuse(431, f"the request headers exceed {MAX_HEADER_BYTES} bytes")
            body = self.rfile.read(length) if length else b""
            headers: dict[str, str] = {}
            for name, value in self.headers.items():
                headers[name] = f"{headers[name]},{value}" if name in headers else value
            event = api_proxy_event(self.command, self.path, headers, body, source_ip=self.client_address[0])
            result = host.call_api(event)
            payload = proxy_result_body(result)
            self.send_response(int(result.get("statusCode", 500)))
            for name, value in proxy_result_headers(result):
                if name.lower() not in ("content-length", "connection"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _refuse(self, status: int, detail: str) -> None:
            title = problem_title(status)
            body = json.dumps({"type": f"urn:rdq:problem:{title.lower().replace(' ', '-')}", "title": title,
                               "status": status, "detail": detail}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/problem+json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

        def __getattr__(self, name: str) -> Any:
            # Any other method (TRACE, PROPFIND, ...) goes to the API too, which answers 404/405
            # as problem+json, instead of the stdlib's 501 HTML page.
            if name.startswith("do_"):
                return self._handle
            raise AttributeError(name)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            # Requests the stdlib refuses before routing (bad request line, too many or too long
            # headers, URI too long) get a problem+json body like every other error.
            if code == HTTPStatus.NOT_IMPLEMENTED:
                code = HTTPStatus.METHOD_NOT_ALLOWED
            if self.request_version == "HTTP/0.9":  # unparsable request line: still answer with a status line
                self.request_version = "HTTP/1.0"
            self.log_error("code %d, message %s", code, message)
            self._refuse(int(code), message or HTTPStatus(code).phrase)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            http_log.info("%s %s", self.address_string(), format % args)

    return ProxyRequestHandler


def run_dev(storage_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
            handler_modules: list[str] | None = None) -> None:
    """Run the dev host until Ctrl-C or SIGTERM (the ``rdq dev`` command)."""
    from .logs import configure_logging, configured_format, default_log_format, default_log_level

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
    from .storage import default_storage_url

    parser = argparse.ArgumentParser(prog="python -m rdq_core.devhost", description="rdq dev: the local serverless host")
    parser.add_argument("--storage", default=default_storage_url())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--handlers", default="", help="handler modules, comma-separated (default: rdq_core.examples)")
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.handlers.split(",") if m.strip()] or None
    run_dev(args.storage, args.host, args.port, modules)


if __name__ == "__main__":
    main()
