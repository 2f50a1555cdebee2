"""rdq's own servers for tests: ``rdq dev`` as a subprocess, a loopback proxy in front of it
that verifies SigV4 signatures with botocore or injects faults, and the names of the test run's
scratch PostgreSQL databases (so that a run killed before it could drop its own is swept later).

Used by ``tests/unit/test_http_client.py`` (HttpClient end to end) and ``tests/browser/`` (the
console in a real browser). Each server binds 127.0.0.1 on a port the kernel picks and is
stopped by its owner (``stop()``, by PID for the subprocess).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import re
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from rdq_testing.servers import stop_process
from rdq_core.compliance.support import wait_until
from tests.loopback import LoopbackHttpServer, rdq_dev_address, without_rdq_settings

REPO = Path(__file__).resolve().parents[1]
#: The credentials the verifying proxy accepts (AWS's documentation example key, not a real one).
ACCESS_KEY, SECRET_KEY, REGION = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "eu-west-1"


class DevServer:
    """``rdq --storage sqlite:///WORKDIR/dev.db dev --port 0`` as a subprocess its creator owns.

    ``token`` sets ``RDQ_API_TOKEN`` (None: no token, loopback Host only); ``handlers`` names the
    handler modules (importable from ``pythonpath``, which is prepended to the repository);
    ``env`` adds or overrides variables."""

    def __init__(self, workdir: Path, *, token: str | None = None, handlers: str | None = None,
                 env: Mapping[str, str] | None = None, pythonpath: Path | None = None,
                 storage_url: str | None = None) -> None:
        self.token = token
        path = os.pathsep.join(str(p) for p in (pythonpath, REPO) if p is not None)
        environ = {**without_rdq_settings(os.environ), "RDQ_DEV_WORKER_EVERY_SECONDS": "0.3",
                   "RDQ_DEV_REAPER_EVERY_SECONDS": "1", "POWERTOOLS_LOG_LEVEL": "WARNING", "PYTHONPATH": path}
        if token is not None:
            environ["RDQ_API_TOKEN"] = token
        environ.update(env or {})
        self.storage_url = storage_url or f"sqlite:///{workdir}/dev.db"
        self.out, self.err = workdir / "dev.out", workdir / "dev.err"
        command = [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", self.storage_url, "dev", "--port", "0"]
        if handlers:
            command += ["--handlers", handlers]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(command, cwd=workdir, env=environ, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

        def ready() -> int | None:
            if self.process.poll() is not None:
                raise AssertionError(f"rdq dev exited: {self.out.read_text()}{self.err.read_text()[-2000:]}")
            address = rdq_dev_address(self.out.read_text(errors="replace"))
            return address[1] if address else None

        self.port: int = wait_until(ready, 30, what="rdq dev's banner")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.process, timeout=20)  # SIGTERM (rdq dev drains), then SIGKILL


@contextmanager
def dev_server(workdir: Path, **options: Any) -> Iterator[DevServer]:
    """``rdq dev`` (``DevServer`` options) for the length of a ``with`` block, stopped however it ends:
    the body of a module fixture."""
    server = DevServer(workdir, **options)
    try:
        yield server
    finally:
        server.stop()


def status_of(client: Any, task_id: str, status: Any, timeout: float = 30) -> Any:
    """The task once it has ``status`` (read through ``client``), or a failure at the deadline."""
    return wait_until(lambda: (task := client.get(task_id)).status is status and task, timeout,
                      what=f"{task_id} {status.value}")


def sigv4_valid(method: str, path: str, headers: Any, body: bytes, *, access_key: str = ACCESS_KEY,
                secret_key: str = SECRET_KEY, region: str = REGION) -> bool:
    """Recompute the signature with the known secret, over exactly the headers the client signed."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    found = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
                         r"SignedHeaders=([a-z0-9;-]+), Signature=([0-9a-f]{64})", headers.get("Authorization") or "")
    if not found or found[1] != access_key or found[3] != region or found[4] != "execute-api":
        return False
    stamp = headers.get("X-Amz-Date") or ""
    try:
        signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return False
    if abs(datetime.now(timezone.utc) - signed_at) > timedelta(minutes=5):
        return False
    signed = found[5].split(";")
    if "host" not in signed or any(headers.get(name) is None for name in signed):
        return False
    request = AWSRequest(method=method, url=f"http://{headers['Host']}{path}", data=body,
                         headers={name: headers[name] for name in signed})
    request.context["timestamp"] = stamp
    signer = SigV4Auth(Credentials(access_key, secret_key), "execute-api", region)
    expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    return hmac.compare_digest(expected, found[6])


class Proxy(LoopbackHttpServer):
    """A loopback proxy in front of ``upstream`` (an rdq dev), which it calls with the dev's own
    bearer token (if it has one). ``sigv4``: requests whose SigV4 signature does not verify with
    ``SECRET_KEY`` get 403 and are not forwarded. ``faults`` are used up one per request:
    ``"503"`` answers 503 without forwarding, ``"drop"`` forwards and then closes the connection
    without answering (the response is lost). ``log`` records (method, path, upstream status);
    ``seen`` the request headers each request arrived with."""

    def __init__(self, upstream: DevServer, *, sigv4: bool = False, faults: tuple[str, ...] = ()) -> None:
        self.faults = list(faults)
        self.log: list[tuple[str, str, int]] = []
        self.seen: list[dict[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.seen.append(dict(self.headers.items()))
                if sigv4 and not sigv4_valid(self.command, self.path, self.headers, body):
                    return self.answer(403, b'{"title": "Forbidden", "status": 403, "detail": "signature mismatch"}')
                fault = proxy.faults.pop(0) if proxy.faults else None
                if fault == "503":
                    proxy.log.append((self.command, self.path, 503))
                    return self.answer(503, b'{"title": "Service Unavailable", "status": 503, "detail": "injected"}')
                forward = http.client.HTTPConnection("127.0.0.1", upstream.port, timeout=15)
                try:
                    headers = {"Authorization": f"Bearer {upstream.token}"} if upstream.token else {}
                    if self.headers.get("Content-Type"):
                        headers["Content-Type"] = self.headers["Content-Type"]
                    forward.request(self.command, self.path, body=body if body else None, headers=headers)
                    response = forward.getresponse()
                    status, payload = response.status, response.read()
                finally:
                    forward.close()
                proxy.log.append((self.command, self.path, status))
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                return self.answer(status, payload)

            def answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/problem+json" if status >= 400 else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_DELETE = handle_one

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(Handler)


# -- scratch databases of test runs ------------------------------------------------------------------

#: This machine, in a scratch database's name: a sweep judges only the runs of its own machine,
#: whose process ids it can check.
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_SCRATCH_NAME = re.compile(r"^rdq_test_(?P<host>[0-9a-f]{6})_(?P<pid>[0-9]+)_[0-9a-f]{12}$")


def scratch_database_prefix(pid: int | None = None) -> str:
    """The prefix of the scratch database of the test run in process ``pid`` (default: this one)."""
    return f"rdq_test_{HOST_TAG}_{os.getpid() if pid is None else pid}_"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_stale_scratch_databases(admin_url: str) -> list[str]:
    """Drop the scratch databases of this machine's test runs whose process is gone (killed
    before its teardown could run: ``kill -9``, a lost machine, a closed terminal); the names
    dropped. A database someone is still connected to is left alone, as is any whose name does
    not say which run made it."""
    import psycopg
    from psycopg import errors, sql

    dropped: list[str] = []
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
        names = [row[0] for row in admin.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'rdq\\_test\\_%' ORDER BY datname").fetchall()]
        for name in names:
            found = _SCRATCH_NAME.match(name)
            if not found or found["host"] != HOST_TAG or _process_exists(int(found["pid"])):
                continue
            try:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            except errors.ObjectInUse:
                continue
            dropped.append(name)
    return dropped
