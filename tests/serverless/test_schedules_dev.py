"""Schedules under `rdq dev` end to end, with an `rdq worker` firing the same schedules file
beside it: one task per period, whoever fires it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rdq_testing.servers import stop_process
from rdq_core.compliance.support import wait_until
from tests.loopback import without_rdq_settings

from .conftest import REPO
from .test_devhost import TOKEN, DevProcess, Http

FIRED = re.compile(r"schedule (\S+) fired (sched\.\S+)")


@pytest.fixture
def dev(tmp_path: Path):
    process = DevProcess(tmp_path, env={"RDQ_API_TOKEN": TOKEN, "POWERTOOLS_LOG_LEVEL": "WARNING",
                                        "RDQ_LOG_FORMAT": "text"})
    try:
        port = process.wait_ready()
        yield process, Http(f"http://127.0.0.1:{port}", TOKEN)
    finally:
        process.stop()


def _worker(workdir: Path) -> subprocess.Popen[bytes]:
    env = {**without_rdq_settings(os.environ), "PYTHONPATH": str(REPO), "RDQ_LOG_FORMAT": "text"}
    with open(workdir / "worker.err", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", f"sqlite:///{workdir}/dev.db", "worker",
             "--handlers", "rdq_core.examples", "--queues", "ticks"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)


def test_a_seconds_rate_fires_once_per_period_with_rdq_dev_and_rdq_worker_side_by_side(dev, tmp_path):
    process, http = dev
    status, _, body = http("POST", "/v1/schedules", {"name": "tick", "expression": "rate(1 second)",
                                                      "queue": "ticks", "handler": "greet",
                                                      "payload": {"name": "clock"}})
    assert status == 200, body
    assert (tmp_path / "rdq-schedules.json").exists()  # the file both hosts read
    worker = _worker(tmp_path)
    try:
        def succeeded() -> list[dict] | None:
            _, _, page = http("GET", "/v1/queues/ticks/tasks?status=SUCCEEDED&limit=200")
            return page["tasks"] if len(page["tasks"]) >= 6 else None

        tasks = wait_until(succeeded, timeout=30, interval=0.2, what="six scheduled tasks to succeed")
    finally:
        stop_process(worker, timeout=20)

    ids = [t["id"] for t in tasks]
    assert all(re.fullmatch(r"sched\.tick\.\d{8}T\d{6}Z", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    for task_id in ids[:3]:
        _, _, task = http("GET", f"/v1/tasks/{task_id}")
        assert task["status"] == "SUCCEEDED" and len(task["attempts"]) == 1
        assert task["payload"] == {"name": "clock"}

    # Each period was created by exactly one of the two hosts: every id is logged as fired once.
    logs = process.stderr() + (tmp_path / "worker.err").read_text(errors="replace")
    fired = Counter(task_id for _, task_id in FIRED.findall(logs))
    assert fired, logs[-2000:]
    assert max(fired.values()) == 1, fired.most_common(3)
    assert set(ids) <= set(fired)

    # Listed with its next period; removed, it is gone from the list and the file.
    _, _, listed = http("GET", "/v1/schedules")
    assert [s["name"] for s in listed["schedules"]] == ["tick"]
    assert listed["schedules"][0]["next_task_id"].startswith("sched.tick.")
    assert http("DELETE", "/v1/schedules/tick")[0] == 200
    assert http("GET", "/v1/schedules")[2] == {"schedules": []}
    assert http("DELETE", "/v1/schedules/tick")[0] == 404


def test_rdq_schedules_cli_edits_the_file_rdq_dev_fires(dev, tmp_path):
    process, http = dev
    env = {**without_rdq_settings(os.environ), "PYTHONPATH": str(REPO)}
    added = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "schedules", "add", "cli-tick", "rate(1 second)",
                            "--queue", "cli", "--handler", "greet", "--payload", '{"name": "cli"}'],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    assert "sched.cli-tick." in added.stdout

    def fired() -> list[dict] | None:
        _, _, page = http("GET", "/v1/queues/cli/tasks?limit=10")
        return page["tasks"] or None

    assert wait_until(fired, timeout=20, interval=0.2, what="the CLI's schedule to fire")[0]["id"].startswith("sched.cli-tick.")
    listed = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "schedules", "list", "--json"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert '"cli-tick"' in listed.stdout
    through_api = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "--api", f"http://127.0.0.1:{process.port}",
                                  "--token", TOKEN, "schedules", "list", "--json"],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert through_api.returncode == 0, through_api.stderr
    assert [s["name"] for s in json.loads(through_api.stdout)["schedules"]] == ["cli-tick"]  # rdq dev's file
    removed = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "schedules", "remove", "cli-tick"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert removed.returncode == 0, removed.stderr
    missing = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "schedules", "remove", "cli-tick"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3


def test_http_client_schedule_methods_against_rdq_dev(dev, tmp_path):
    from rdq_core import HttpClient
    from rdq_core.errors import InvalidInput
    from rdq_core.http_client import BearerToken
    from rdq_core.engine.schedules import Schedule, ScheduleNotFound

    process, _ = dev
    with HttpClient(f"http://127.0.0.1:{process.port}", auth=BearerToken(TOKEN)) as client:
        stored = client.put_schedule(Schedule("weekly", "cron(0 9 ? * MON *)", "reports", "greet",
                                              timezone="Europe/Paris", payload={"name": "monday"}))
        assert stored.created_at is not None  # stored by rdq dev, in its local file
        assert (stored.expression, stored.timezone, stored.payload) == ("cron(0 9 ? * MON *)", "Europe/Paris",
                                                                        {"name": "monday"})
        assert [s.name for s in client.list_schedules()] == ["weekly"]
        with pytest.raises(InvalidInput) as refused:
            client.put_schedule({"name": "bad", "expression": "cron(0 9 * * * *)", "queue": "q", "handler": "h"})
        assert refused.value.field == "expression"
        client.delete_schedule("weekly")
        with pytest.raises(ScheduleNotFound):
            client.delete_schedule("weekly")
        assert client.list_schedules() == []
