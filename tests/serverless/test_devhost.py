"""`rdq dev` end to end: a real subprocess on a free port, exercised over HTTP only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

import pytest

from rdq_core.compliance.support import wait_until
from tests.loopback import free_loopback_port

from .conftest import REPO

TOKEN = "dev-token-123"


class Http:
    def __init__(self, base: str, token: str | None) -> None:
        self.base, self.token = base, token

    def __call__(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                 content_type: str = "application/json", auth: bool = True) -> tuple[int, str, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        if auth and self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, headers, payload = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, payload = error.code, error.headers, error.read()
        assert status < 500, (status, payload[:500])
        text = payload.decode()
        return status, headers.get("Content-Type", ""), json.loads(text) if text else None


@pytest.fixture
def dev_server(tmp_path):
    port = free_loopback_port()
    env = {**os.environ, "RDQ_API_TOKEN": TOKEN, "RDQ_DEV_WORKER_EVERY_SECONDS": "0.3", "RDQ_DEV_REAPER_EVERY_SECONDS": "1",
           "PYTHONPATH": str(REPO), "POWERTOOLS_LOG_LEVEL": "WARNING"}
    for name in ("RDQ_STORAGE_URL", "RDQ_HANDLERS", "RDQ_WORKER_FUNCTION", "POWERTOOLS_SERVICE_NAME"):
        env.pop(name, None)
    process = subprocess.Popen(
        [sys.executable, "-m", "rdq_core.cli", "--storage", f"sqlite:///{tmp_path}/dev.db", "dev", "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    http = Http(f"http://127.0.0.1:{port}", TOKEN)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"rdq dev exited early: {process.stdout.read()}")
        try:
            return http("GET", "/v1/openapi.json")[0] == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        wait_until(ready, 20, what="rdq dev to serve")
        yield process, http
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def task_when(http: Http, task_id: str, status: str, timeout: float = 30) -> dict:
    def reached():
        code, _, task = http("GET", f"/v1/tasks/{task_id}")
        return task if code == 200 and task["status"] == status else None

    return wait_until(reached, timeout, what=f"{task_id} to be {status}")


def test_rdq_dev_end_to_end_over_http(dev_server):
    process, http = dev_server
    fast_backoff = {"initial_seconds": 0.3, "factor": 2, "max_seconds": 2, "jitter": 0}

    # Token: required when RDQ_API_TOKEN is set.
    status, ctype, problem = http("GET", "/v1/queues/demo/stats", auth=False)
    assert (status, ctype, problem["status"]) == (401, "application/problem+json", 401)

    # Single and batch enqueue -> SUCCEEDED with results.
    status, _, task = http("POST", "/v1/queues/demo/tasks", {"handler": "greet", "payload": {"name": "Ada"}, "id": "hello-1"})
    assert status == 201
    status, _, batch = http("POST", "/v1/queues/demo/tasks:batch", {"tasks": [
        {"handler": "greet", "payload": {"name": "Grace"}, "id": "hello-2"},
        {"handler": "flaky", "payload": {"failures": 1}, "id": "flaky-1", "backoff": fast_backoff},
        {"handler": "fail_until_redrive", "id": "broken-1", "max_attempts": 3, "backoff": fast_backoff},
        {"handler": "reject", "payload": {"reason": "bad address"}, "id": "reject-1"},
        {"handler": "reject", "id": "reject-2"},
        {"handler": "greet", "id": "later-1", "delay_seconds": 3600},
    ]})
    assert status == 200 and batch["created"] == 6

    assert task_when(http, "hello-1", "SUCCEEDED")["result"]["greeting"] == "hello, Ada"
    assert task_when(http, "hello-2", "SUCCEEDED")["result"]["greeting"] == "hello, Grace"
    flaky = task_when(http, "flaky-1", "SUCCEEDED")
    assert [a["outcome"] for a in flaky["attempts"]] == ["RETRYABLE_FAILURE", "SUCCESS"]

    # A failing handler: retried with backoff, then DEAD with its full history.
    broken = task_when(http, "broken-1", "DEAD", timeout=40)
    assert [a["attempt_no"] for a in broken["attempts"]] == [1, 2, 3]
    assert {a["outcome"] for a in broken["attempts"]} == {"RETRYABLE_FAILURE"}
    assert broken["last_error"]["type"] == "RuntimeError"
    gaps = [
        (datetime.fromisoformat(later["started_at"]) - datetime.fromisoformat(earlier["finished_at"])).total_seconds()
        for earlier, later in zip(broken["attempts"], broken["attempts"][1:])
    ]
    assert all(gap >= 0.25 for gap in gaps), f"retries wait for their backoff: {gaps}"
    rejected = task_when(http, "reject-1", "DEAD")
    assert [a["outcome"] for a in rejected["attempts"]] == ["PERMANENT_FAILURE"], "PermanentError is not retried"
    task_when(http, "reject-2", "DEAD")

    # Page the DLQ two at a time: every dead task exactly once.
    seen, cursor = [], ""
    while True:
        status, _, page = http("GET", f"/v1/queues/demo/dlq?limit=2{'&cursor=' + cursor if cursor else ''}")
        assert status == 200 and len(page["tasks"]) <= 2
        seen += [t["id"] for t in page["tasks"]]
        if not page["next_cursor"]:
            break
        cursor = page["next_cursor"]
    assert sorted(seen) == ["broken-1", "reject-1", "reject-2"]
    status, _, filtered = http("GET", "/v1/queues/demo/dlq?handler=reject")
    assert {t["id"] for t in filtered["tasks"]} == {"reject-1", "reject-2"}

    # Redrive the broken one: it now succeeds, history kept and numbered on.
    status, _, redriven = http("POST", "/v1/queues/demo/dlq:redrive", {"ids": ["broken-1"]})
    assert (status, redriven) == (200, {"redriven": 1})
    fixed = task_when(http, "broken-1", "SUCCEEDED")
    assert fixed["redrive_count"] == 1 and [a["attempt_no"] for a in fixed["attempts"]] == [1, 2, 3, 4]
    assert fixed["attempts"][-1]["outcome"] == "SUCCESS"

    status, _, purged = http("POST", "/v1/queues/demo/dlq:purge", {"handler": "reject"})
    assert (status, purged) == (200, {"purged": 2})

    # Cancel the delayed task; a second cancel conflicts.
    status, _, cancelled = http("DELETE", "/v1/tasks/later-1")
    assert status == 200 and cancelled["status"] == "CANCELLED"
    assert http("DELETE", "/v1/tasks/later-1")[0] == 409

    status, _, stats = http("GET", "/v1/queues/demo/stats")
    assert status == 200 and stats["succeeded"] == 4 and stats["dead"] == 0 and stats["cancelled"] == 1

    # Bad input: a precise 4xx with a problem document, never a 5xx.
    for args, kwargs, expected in [
        (("POST", "/v1/queues/demo/tasks"), {"raw": b"{not json"}, 400),
        (("POST", "/v1/queues/demo/tasks", {"handler": "greet", "payload": "x" * (300 * 1024)}), {}, 413),
        (("POST", "/v1/queues/demo/tasks", {"handler": "greet"}), {"content_type": "text/plain"}, 415),
        (("POST", "/v1/queues/Bad Queue!/tasks".replace(" ", "%20"), {"handler": "greet"}), {}, 422),
        (("POST", "/v1/queues/demo/tasks", {"handler": "greet", "max_attempts": 0}), {}, 422),
        (("GET", "/v1/tasks/does-not-exist"), {}, 404),
        (("GET", "/v1/no/such/route"), {}, 404),
        (("DELETE", "/v1/queues/demo/stats"), {}, 405),
    ]:
        status, ctype, problem = http(*args, **kwargs)
        assert (status, ctype) == (expected, "application/problem+json"), (args[:2], status, problem)
        assert problem["status"] == expected

    # Stops cleanly on SIGTERM.
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    output = process.stdout.read()
    assert "rdq dev: API on http://127.0.0.1:" in output and "curl" in output
    assert "Traceback" not in output
