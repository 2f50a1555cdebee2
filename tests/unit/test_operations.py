"""Bulk operations as jobs: started, advanced in chunks at a rate, resumed after a crash between
acting and recording, cancelled, one per queue; through the Client on SQLite and through the API
of ``rdq dev`` (202, then the operation's routes)."""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

from rdq_core import Client
from rdq_core.engine import operations
from rdq_core.compliance.support import dead_letter, enqueue_n
from rdq_core.errors import TaskConflict, TaskNotFound
from rdq_core.http_client import BearerToken, HttpClient
from rdq_core.model import TaskStatus
from rdq_core.storage.spi import Storage
from tests.rdq_servers import DevServer, dev_server


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    with Client(f"sqlite:///{tmp_path}/ops.db", actor="tester") as rdq:
        yield rdq


def drive(storage: Storage, seconds: float = 60) -> operations.DriveReport:
    return operations.drive_operations(storage, deadline=time.monotonic() + seconds)


def test_a_redrive_operation_acts_on_every_selected_task_once_and_releases_the_queue(client: Client) -> None:
    storage = client.storage
    dead = dead_letter(storage, "ops", 1200, error_type="boom.Fatal")
    other = dead_letter(storage, "ops", 5, error_type="other.Error")
    operation = client.start_operation("redrive", "ops", error_type="boom.Fatal")
    assert (operation.status, operation.matched, operation.done) == ("RUNNING", 1200, 0)
    with pytest.raises(TaskConflict):
        client.start_operation("purge", "ops", all=True)  # one running operation per queue
    report = drive(storage)
    assert operation.id in report.finished and report.acted == 1200 and report.chunks >= 3
    finished = client.get_operation(operation.id)
    assert (finished.status, finished.done, finished.matched) == ("SUCCEEDED", 1200, 1200)
    assert finished.finished_at is not None and finished.actor == "tester"
    for task_id in dead[:50] + dead[-50:]:
        task = client.get(task_id)
        assert task.status is TaskStatus.PENDING and task.redrive_count == 1
    assert client.stats("ops").dead == 5 and all(client.get(t).status is TaskStatus.DEAD for t in other)
    purge = client.start_operation("purge", "ops", all=True)  # the queue is free again
    drive(storage)
    assert client.get_operation(purge.id).done == 5 and client.stats("ops").dead == 0
    (audit_purge, audit_redrive) = client.list_audit(queue="ops").entries
    assert (audit_redrive.action, audit_redrive.count, audit_redrive.selection["operation"]) == ("redrive", 1200, operation.id)
    assert audit_purge.action == "purge"
    listed = client.list_operations(queue="ops")
    assert [op.id for op in listed] == [purge.id, operation.id]


def test_a_crash_between_acting_and_recording_acts_on_no_task_twice(client: Client,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    storage = client.storage
    dead_letter(storage, "crash", 1100)
    operation = client.start_operation("redrive", "crash", all=True)
    real_update = operations._update
    crashes = iter([True, False, True])

    def dying_update(store: Storage, operation_id: str, change: object) -> operations.Operation:
        if next(crashes, False):
            raise RuntimeError("the advancer died after acting, before recording")
        return real_update(store, operation_id, change)  # type: ignore[arg-type]

    monkeypatch.setattr(operations, "_update", dying_update)
    for _ in range(10):
        try:
            drive(storage)
            break
        except RuntimeError:
            continue  # the next reaper tick picks the operation up again
    monkeypatch.setattr(operations, "_update", real_update)
    drive(storage)
    finished = client.get_operation(operation.id)
    assert finished.status == "SUCCEEDED"
    redriven = storage.list_tasks("crash", status=TaskStatus.PENDING, limit=2000)
    assert len(redriven.tasks) == 1100
    counts = {t.redrive_count for t in redriven.tasks}
    assert counts == {1}, "no task was redriven twice"
    assert client.stats("crash").pending == 1100 and client.stats("crash").dead == 0
    # A chunk cut short by the crash acted once but is not in ``done``: done never overcounts.
    assert finished.done <= 1100


def test_a_task_that_dies_again_is_not_redriven_again_by_the_same_operation(client: Client) -> None:
    storage = client.storage
    dead_letter(storage, "again", 3)
    operation = client.start_operation("redrive", "again", all=True, rate_per_second=1)
    operations.advance_operation(storage, client.get_operation(operation.id))  # the first chunk: 1 task
    (redriven,) = [t for t in client.list_tasks("again", status="PENDING").tasks]
    (claimed,) = storage.claim("again", 1, 30)
    assert claimed.task.id == redriven.id
    from rdq_core.compliance.support import fail_permanently

    storage.settle([fail_permanently(claimed)])  # it dies again, after the operation started
    drive(storage, seconds=10)
    assert client.get(redriven.id).redrive_count == 1 and client.get(redriven.id).status is TaskStatus.DEAD
    assert client.get_operation(operation.id).done == 3


def test_a_rate_limited_operation_keeps_its_rate(client: Client) -> None:
    storage = client.storage
    dead_letter(storage, "rated", 600)
    rate = 200.0
    started = time.monotonic()
    operation = client.start_operation("redrive", "rated", all=True, rate_per_second=rate)
    drive(storage)
    elapsed = time.monotonic() - started
    assert client.get_operation(operation.id).done == 600
    # 600 tasks at 200/s: at least the time the slots take (the first chunk starts at once).
    assert elapsed >= (600 - rate * operations.CHUNK_SECONDS) / rate * 0.95
    stamps = sorted(t.updated_at for t in storage.list_tasks("rated", status=TaskStatus.PENDING, limit=1000).tasks
                    if t.updated_at is not None)
    window = timedelta(seconds=1)
    most = max(sum(1 for s in stamps[i:] if s - stamp < window) for i, stamp in enumerate(stamps))
    assert most <= rate + rate * operations.CHUNK_SECONDS, f"{most} tasks within one second at {rate}/s"


def test_a_cancelled_operation_stops_and_frees_the_queue(client: Client) -> None:
    storage = client.storage
    enqueue_n(storage, "stop", 40, delay_seconds=3600)
    operation = client.start_operation("cancel", "stop", all=True, rate_per_second=10)
    operations.advance_operation(storage, client.get_operation(operation.id))
    stopped = client.cancel_operation(operation.id)
    assert stopped.status == "CANCELLED" and 0 < stopped.done < 40
    drive(storage, seconds=2)
    assert client.get_operation(operation.id).done == stopped.done
    assert client.stats("stop").cancelled == stopped.done
    with pytest.raises(TaskConflict):
        client.cancel_operation(operation.id)
    with pytest.raises(TaskNotFound):
        client.get_operation("NOSUCHOPERATION")
    client.start_operation("cancel", "stop", all=True)  # the lock was released


# -- through the API -----------------------------------------------------------------------------
TOKEN = "operations-token-5"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with dev_server(tmp_path_factory.mktemp("rdq-dev-ops"), token=TOKEN,
                    env={"RDQ_DEV_REAPER_EVERY_SECONDS": "0.5"}) as server:
        yield server


def test_a_large_redrive_through_the_api_becomes_an_operation(dev: DevServer, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rdq = HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)
    with Client(dev.storage_url) as direct:
        dead_letter(direct.storage, "api-ops", 30)
    # A rate alone makes it an operation (a rate is kept over time), however few tasks match.
    request = urllib.request.Request(f"{dev.url}/v1/queues/api-ops/dlq:redrive", method="POST",
                                     data=json.dumps({"all": True, "rate_per_second": 20}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 202
        started = operations.Operation.from_dict(json.loads(answer.read())["operation"])
    assert started.status == "RUNNING" and started.matched == 30
    with pytest.raises(TaskConflict):
        rdq.start_operation("purge", "api-ops", all=True)
    finished = rdq.wait_for_operation(started.id, timeout=60, poll=0.2)
    assert (finished.status, finished.done) == ("SUCCEEDED", 30)
    assert [op.id for op in rdq.list_operations(queue="api-ops")] == [started.id]
    entries = rdq.list_audit(queue="api-ops").entries
    assert entries[0].action == "redrive" and entries[0].selection["operation"] == started.id

    from rdq_core.hosts.cli import main

    for name in ("RDQ_API_URL", "RDQ_API_KEY", "RDQ_API_TOKEN", "RDQ_STORAGE_URL"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    assert main(["--api", dev.url, "--token", TOKEN, "operations", "show", started.id]) == 0
    assert f"operation {started.id}: redrive on queue api-ops at 20/s: SUCCEEDED, 30 of 30 done" in capsys.readouterr().out
