"""`rdq dev` end to end: a real subprocess on a free port, exercised over HTTP only."""

from __future__ import annotations

import itertools
import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from rdq_core.compliance.support import wait_until
from rdq_testing.servers import stop_process
from tests.loopback import rdq_dev_address

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


class DevProcess:
    """``python -m rdq_core.hosts.cli --storage URL dev --port 0`` as a subprocess this test owns.

    ``--port 0``: the kernel picks a free port at bind time and the banner names it, so no port
    is guessed beforehand (another process could take a guessed one before rdq dev binds it).
    Ready means the banner was printed: it comes after the server is listening.
    stdout (the banner) goes to a file; stderr (the logs) to a file, or to a pseudo-terminal
    with ``tty=True`` so that rdq dev sees a terminal.
    """

    def __init__(self, workdir: Path, env: dict[str, str] | None = None, tty: bool = False) -> None:
        full_env = {**os.environ, "RDQ_DEV_WORKER_EVERY_SECONDS": "0.3", "RDQ_DEV_REAPER_EVERY_SECONDS": "1",
                    "PYTHONPATH": str(REPO)}
        for name in ("RDQ_STORAGE_URL", "RDQ_HANDLERS", "RDQ_WORKER_FUNCTION", "POWERTOOLS_SERVICE_NAME",
                     "RDQ_API_TOKEN", "RDQ_LOG_FORMAT", "RDQ_LOG_LEVEL"):
            full_env.pop(name, None)
        full_env.update(env or {})
        self.stdout_path = workdir / "rdq-dev.out"
        self.stderr_path = workdir / "rdq-dev.err"
        self._terminal: list[bytes] = []
        self._reader: threading.Thread | None = None
        leader = follower = None
        with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr_file:
            stderr: Any = stderr_file
            if tty:
                leader, follower = pty.openpty()
                stderr = follower
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", f"sqlite:///{workdir}/dev.db", "dev", "--port", "0"],
                cwd=workdir, env=full_env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            )
        if tty:
            os.close(follower)
            self._reader = threading.Thread(target=self._drain, args=(leader,), daemon=True)
            self._reader.start()
        self.port = 0

    def _drain(self, leader: int) -> None:
        try:
            while chunk := os.read(leader, 65536):
                self._terminal.append(chunk)
        except OSError:  # EIO: every writer of the terminal has closed it
            pass
        finally:
            os.close(leader)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        if self._reader is not None:
            return b"".join(self._terminal).decode(errors="replace").replace("\r\n", "\n")
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> int:
        def banner() -> int | None:
            if self.process.poll() is not None:
                raise AssertionError(f"rdq dev exited early ({self.process.returncode}): {self.stdout()}{self.stderr()[-3000:]}")
            address = rdq_dev_address(self.stdout())
            return address[1] if address else None

        self.port = wait_until(banner, timeout, what="rdq dev to print its banner")
        return self.port

    def stop(self) -> int:
        stop_process(self.process, timeout=20)  # SIGTERM (rdq dev drains), then SIGKILL
        if self._reader is not None:
            self._reader.join(timeout=10)
        return self.process.returncode


@pytest.fixture
def dev_server(tmp_path):
    dev = DevProcess(tmp_path, env={"RDQ_API_TOKEN": TOKEN, "POWERTOOLS_LOG_LEVEL": "WARNING"})
    try:
        port = dev.wait_ready()
        yield dev, Http(f"http://127.0.0.1:{port}", TOKEN)
    finally:
        dev.stop()


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
        for earlier, later in itertools.pairwise(broken["attempts"])
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
    assert process.stop() == 0
    output = process.stdout() + process.stderr()
    assert "rdq dev: API on http://127.0.0.1:" in output and "curl" in output
    assert "Traceback" not in output


# -- what rdq dev prints: one line per task outcome ---------------------------------------------
FAST = {"initial_seconds": 0.3, "factor": 2, "max_seconds": 1, "jitter": 0}
#: (task id, try, max tries, outcome, dead?) of every outcome the scenario below produces.
EXPECTED_OUTCOMES = [
    ("hello-1", 1, 5, "SUCCESS", False),
    ("flaky-1", 1, 5, "RETRYABLE_FAILURE", False),
    ("flaky-1", 2, 5, "SUCCESS", False),
    ("reject-1", 1, 5, "PERMANENT_FAILURE", True),
    ("broken-1", 1, 2, "RETRYABLE_FAILURE", False),
    ("broken-1", 2, 2, "RETRYABLE_FAILURE", True),
]
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +\S+  \S.*")


def _succeed_retry_and_die(http: Http) -> None:
    status, _, batch = http("POST", "/v1/queues/demo/tasks:batch", {"tasks": [
        {"handler": "greet", "payload": {"name": "Ada"}, "id": "hello-1"},
        {"handler": "flaky", "payload": {"failures": 1}, "id": "flaky-1", "backoff": FAST},
        {"handler": "reject", "payload": {"reason": "bad address"}, "id": "reject-1"},
        {"handler": "fail_until_redrive", "id": "broken-1", "max_attempts": 2, "backoff": FAST},
    ]})
    assert status == 200 and batch["created"] == 4
    for task_id, status in (("hello-1", "SUCCEEDED"), ("flaky-1", "SUCCEEDED"), ("reject-1", "DEAD"), ("broken-1", "DEAD")):
        task_when(http, task_id, status)


def _no_lambda_noise(output: str) -> None:
    assert '"_aws"' not in output and "CloudWatchMetrics" not in output, "no EMF metrics blob under rdq dev"
    for lambda_field in ("function_arn", "cold_start", "function_request_id", "xray_trace_id"):
        assert lambda_field not in output
    assert "task started" not in output and "task finished" not in output, "the outcome line is the only one per task"


def test_rdq_dev_prints_one_readable_line_per_outcome_on_a_terminal(tmp_path):
    # A worker tick every 50 ms: within the run below, well over 100 invocations record their
    # claim latency -- the point where Powertools used to print an EMF blob despite
    # POWERTOOLS_METRICS_DISABLED.
    dev = DevProcess(tmp_path, env={"RDQ_DEV_WORKER_EVERY_SECONDS": "0.05"}, tty=True)
    try:
        http = Http(f"http://127.0.0.1:{dev.wait_ready()}", None)
        began = time.monotonic()
        _succeed_retry_and_die(http)
        wait_until(lambda: "broken-1 demo/fail_until_redrive try 2/2" in dev.stderr(), 10, what="the last outcome line")
        time.sleep(max(0.0, began + 8 - time.monotonic()))
    finally:
        assert dev.stop() == 0
    logs, banner = dev.stderr(), dev.stdout()
    lines = [line for line in logs.splitlines() if line.strip()]
    assert lines and all(TEXT_LINE.fullmatch(line) for line in lines), "\n".join(lines)
    assert all(len(line) < 400 for line in lines)
    for task_id, attempt, tries, outcome, dead in EXPECTED_OUTCOMES:
        level = "WARNING" if dead else "INFO   "
        pattern = rf"^\S+ \S+ {level} task  {task_id} demo/\w+ try {attempt}/{tries} {outcome} in \d+ ms.*"
        pattern += "; dead-lettered$" if dead else ("$" if outcome == "SUCCESS" else r"; retry in \d+ ms$")
        found = re.findall(pattern, logs, flags=re.MULTILINE)
        assert len(found) == 1, (pattern, logs)
    assert re.search(r"^.* WARNING task  reject-1 .*: rdq_core\.errors\.PermanentError: bad address; dead-lettered$",
                     logs, re.MULTILINE)
    assert re.search(r"^.* task  broken-1 .* try 2/2 .*: RuntimeError: downstream still broken", logs, re.MULTILINE)
    assert "{" not in logs, "no JSON on a terminal"
    assert "rdq dev: API on http://127.0.0.1:" in banner
    _no_lambda_noise(logs + banner)


def _json_lines(text: str) -> list[dict[str, Any]]:
    documents = []
    for line in text.splitlines():
        if line.strip():
            documents.append(json.loads(line))  # every line is one JSON object
    return documents


def _outcomes(documents: list[dict[str, Any]]) -> list[tuple]:
    return sorted(
        (d["task_id"], d["try"], d["max_tries"], d["outcome"], d["status"] == "DEAD", d["level"])
        for d in documents if d["logger"] == "rdq.task"
    )


def test_rdq_dev_logs_json_lines_when_not_on_a_terminal(tmp_path):
    dev = DevProcess(tmp_path)
    try:
        http = Http(f"http://127.0.0.1:{dev.wait_ready()}", None)
        _succeed_retry_and_die(http)
        wait_until(lambda: '"broken-1 demo/fail_until_redrive try 2/2' in dev.stderr(), 10, what="the last outcome line")
    finally:
        assert dev.stop() == 0
    documents = _json_lines(dev.stderr())
    expected = sorted((t, a, m, o, dead, "WARNING" if dead else "INFO") for t, a, m, o, dead in EXPECTED_OUTCOMES)
    assert _outcomes(documents) == expected
    for document in documents:
        assert {"time", "level", "logger", "message"} <= set(document)
    dead = next(d for d in documents if d.get("task_id") == "reject-1" and d["logger"] == "rdq.task")
    assert dead["error_type"] == "rdq_core.errors.PermanentError" and dead["queue"] == "demo" and dead["handler"] == "reject"
    assert isinstance(dead["duration_ms"], float)
    enqueued = [d for d in documents if d["message"] == "enqueued batch"]
    assert enqueued and enqueued[0]["queue"] == "demo"
    _no_lambda_noise(dev.stderr() + dev.stdout())


def test_rdq_log_format_json_wins_over_a_terminal(tmp_path):
    dev = DevProcess(tmp_path, env={"RDQ_LOG_FORMAT": "json"}, tty=True)
    try:
        http = Http(f"http://127.0.0.1:{dev.wait_ready()}", None)
        http("POST", "/v1/queues/demo/tasks", {"handler": "reject", "id": "reject-1"})
        task_when(http, "reject-1", "DEAD")
        wait_until(lambda: "reject-1 demo/reject try 1/5" in dev.stderr(), 10, what="the outcome line")
    finally:
        assert dev.stop() == 0
    documents = _json_lines(dev.stderr())
    assert _outcomes(documents) == [("reject-1", 1, 5, "PERMANENT_FAILURE", True, "WARNING")]
