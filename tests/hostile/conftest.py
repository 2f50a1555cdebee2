"""Fixtures for the hostile-input, access-control and limits tests.

* ``DevServer``: a real ``rdq dev`` subprocess on a free loopback port (its output captured to a
  file, so tests can assert on what it logged);
* ``api_call``: the API Lambda handler called in-process with a real REST proxy event, for the
  many small request cases that need no socket;
* ``any_store_url``: one fresh store per backend (SQLite file, PostgreSQL scratch schema, Redis
  key prefix, MongoDB-wire database), from the suite-wide ``fresh_store_url`` (tests/conftest.py).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

# The offline AWS / Powertools environment is set once for the whole suite in tests/conftest.py.
from rdq_core.compliance.support import wait_until
from rdq_testing.servers import stop_process
from tests.loopback import rdq_dev_address, without_rdq_settings

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:No application metrics to publish")
TOKEN = "hostile-test-token-9f3b"
PROBLEM_JSON = "application/problem+json"

class DevServer:
    """``python -m rdq_core.hosts.cli --storage URL dev --port 0`` as a subprocess this test owns.

    ``--port 0``: the kernel picks a free port when rdq dev binds, and the banner names it. (A
    port picked free beforehand can be taken by another process before rdq dev binds it.)
    Ready means the banner is out: rdq dev prints it once it is listening and serving.
    """

    _started = itertools.count(1)

    def __init__(self, workdir: Path, storage_url: str | None = None, token: str | None = TOKEN,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        number = next(self._started)
        self.port = 0
        self.url = ""
        self.token = token
        self.log_path = workdir / f"rdq-dev-{number}.log"
        full_env = without_rdq_settings(os.environ)
        full_env.update({"PYTHONPATH": str(REPO), "POWERTOOLS_LOG_LEVEL": "INFO",
                         "RDQ_DEV_WORKER_EVERY_SECONDS": "0.5", "RDQ_DEV_REAPER_EVERY_SECONDS": "2"})
        full_env.pop("POWERTOOLS_SERVICE_NAME", None)
        if token:
            full_env["RDQ_API_TOKEN"] = token
        full_env.update(env or {})
        storage_url = storage_url or f"sqlite:///{workdir}/dev-{number}.db"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", storage_url, "dev", "--port", "0", *args],
            cwd=workdir, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30) -> "DevServer":
        def banner() -> tuple[str, int] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"rdq dev exited early ({self.process.returncode}): {self.output()[-3000:]}")
            return rdq_dev_address(self.output())

        host, self.port = wait_until(banner, timeout, what="rdq dev to print its banner")
        self.url = f"http://{host}:{self.port}"
        return self

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                content_type: str | None = "application/json", token: str | None | bool = True,
                headers: dict[str, str] | None = None, timeout: float = 15) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None and content_type:
            req.add_header("Content-Type", content_type)
        bearer = self.token if token is True else (token or None)
        if bearer:
            req.add_header("Authorization", f"Bearer {bearer}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def stop(self) -> None:
        stop_process(self.process, timeout=20)  # SIGTERM (rdq dev drains), then SIGKILL
        self._log.close()


@pytest.fixture
def dev_server_factory(tmp_path):
    started: list[DevServer] = []

    def start(**kwargs: Any) -> DevServer:
        server = DevServer(tmp_path, **kwargs)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def dev_server(dev_server_factory) -> DevServer:
    """``rdq dev`` on SQLite with ``RDQ_API_TOKEN`` set."""
    return dev_server_factory()


# -- in-process API calls ----------------------------------------------------------------------
@pytest.fixture
def api_store(tmp_path, monkeypatch, no_rdq_settings) -> str:
    from rdq_core.hosts.aws_lambda import connection

    url = f"sqlite:///{tmp_path}/api.db"
    monkeypatch.setenv("RDQ_STORAGE_URL", url)
    monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
    monkeypatch.setenv("RDQ_WAKE_WORKER", "false")
    monkeypatch.setenv("RDQ_HANDLERS", "rdq_core.examples")
    yield url
    connection.close_shared_storage()


@pytest.fixture
def api_call(api_store) -> Callable[..., tuple[int, dict[str, str], Any]]:
    """Call the API Lambda handler with a REST proxy event; returns (status, headers, parsed body)."""
    from rdq_core.hosts.aws_lambda import api
    from rdq_core.hosts.aws_lambda.local_invoke import LocalLambdaContext, api_proxy_event

    def call(method: str, target: str, body: Any = None, *, raw: bytes | None = None,
             content_type: str | None = "application/json", headers: dict[str, str] | None = None,
             event: dict[str, Any] | None = None) -> tuple[int, dict[str, str], Any]:
        if event is None:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            all_headers = {"Content-Type": content_type} if (data is not None and content_type) else {}
            all_headers.update(headers or {})
            event = api_proxy_event(method, target, all_headers, data)
        result = api.lambda_handler(event, LocalLambdaContext("rdq-api", 29))
        out_headers = {k.lower(): v for k, v in (result.get("headers") or {}).items()}
        for k, values in (result.get("multiValueHeaders") or {}).items():
            out_headers.setdefault(k.lower(), values[0])
        text = result.get("body") or ""
        parsed = json.loads(text) if text else None
        return result["statusCode"], out_headers, parsed

    return call


def assert_problem(status: int, headers: dict[str, str], body: Any, expected: int) -> dict:
    """A precise problem+json error: the status, the content type, and a body that says the same."""
    assert status == expected, (status, body)
    content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    assert content_type.split(";")[0].strip() == PROBLEM_JSON, (content_type, body)
    if isinstance(body, (bytes, str)):
        body = json.loads(body)
    assert body["status"] == expected and body["type"].startswith("urn:rdq:problem:") and body["title"], body
    assert "Traceback" not in json.dumps(body)
    return body


# -- one fresh store per backend ----------------------------------------------------------------
BACKENDS = ("sqlite", "postgresql", "redis", "mongodb")


@pytest.fixture(params=BACKENDS)
def any_store_url(request, fresh_store_url) -> str:
    """A fresh, migrated store of each backend in turn."""
    from rdq_core.storage import open_storage

    url = fresh_store_url(request.param)
    store = open_storage(url)
    try:
        store.migrate()
    finally:
        store.close()
    return url
