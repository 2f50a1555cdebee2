"""One poisoned operation does not stop the maintenance pass: in the same pass, expired leases are
reaped, the outbox is delivered and retention deletes old finished tasks -- on the reaper
function and on ``rdq reaper --once``."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Sequence

import pytest

from rdq_core import Client
from rdq_core.hosts import cli
from rdq_core.engine import maintenance, operations
from rdq_core.compliance.support import dead_letter, success
from rdq_core.events import EventSettings, OutboxEvent
from rdq_core.hosts.aws_lambda import connection, reaper
from rdq_core.model import NewTask, TaskFilter, TaskStatus
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage

from .conftest import load_event


class Recording:
    """A publisher that accepts everything and remembers what it got."""

    def __init__(self) -> None:
        self.got: list[OutboxEvent] = []

    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        self.got += list(events)
        return [True] * len(events)


def poisoned_world(storage: Storage) -> dict[str, Any]:
    """A stored rate no start would accept (written straight into the store, as an older version
    could have), next to the work every other step has: a lease to reap, events to deliver, an
    old finished task for retention."""
    storage.configure_events(EventSettings(enabled=True))
    dead_letter(storage, "poisoned", 2)
    operation = operations.start_operation(storage, action="redrive", queue="poisoned", selection=TaskFilter(), all=True)
    current = storage.get_document(operations.OPERATION, operation.id)
    assert current is not None
    storage.put_document(operations.OPERATION, operation.id, {**current.body, "rate_per_second": 5e-324},
                         expected_version=current.version)
    # A second operation whose document cannot even be read.
    dead_letter(storage, "unreadable", 1)
    other = operations.start_operation(storage, action="redrive", queue="unreadable", selection=TaskFilter(), all=True)
    current = storage.get_document(operations.OPERATION, other.id)
    assert current is not None
    storage.put_document(operations.OPERATION, other.id, {**current.body, "next_chunk_at": "garbage"},
                         expected_version=current.version)
    storage.enqueue([NewTask(id="old-done", queue="fine", handler="noop", payload=None)])
    storage.settle([success(c) for c in storage.claim("fine", 1, 30)])
    storage.enqueue([NewTask(id="lapsed", queue="fine", handler="noop", payload=None)])
    assert [c.task.id for c in storage.claim("fine", 1, 0.2)] == ["lapsed"]
    time.sleep(0.6)  # the lease lapses, and old-done is older than the retention below
    return {"operation": operation.id}


def assert_the_rest_was_done(storage: Storage, delivered: list[OutboxEvent]) -> None:
    lapsed = storage.get("lapsed")
    assert lapsed is not None and lapsed.status is TaskStatus.PENDING and lapsed.attempt_count == 1, "reaped"
    assert storage.get("old-done") is None, "retention ran"
    assert any(event.type == "rdq.task.dead" for event in delivered), "the outbox was delivered"


@pytest.fixture
def reaper_function_world(store_url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Storage, Recording, dict[str, Any]]:
    """The reaper function's store holding a poisoned world, and a publisher that records."""
    publisher = Recording()
    monkeypatch.setattr(reaper, "publisher", publisher)
    monkeypatch.setenv("RDQ_RETENTION_HOURS", str(0.3 / 3600))
    monkeypatch.setenv("RDQ_OPERATION_SECONDS", "1")
    storage = connection.shared_storage()
    return storage, publisher, poisoned_world(storage)


def test_the_reaper_function_reaps_delivers_and_applies_retention_past_a_poisoned_operation(
        reaper_function_world: tuple[Storage, Recording, dict[str, Any]], lambda_context: Any) -> None:
    storage, publisher, world = reaper_function_world
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["expired"] == 1 and summary["retention_deleted"] == 1, summary
    assert summary["failed_steps"] == [], summary
    assert_the_rest_was_done(storage, publisher.got)
    # The poisoned operation itself moves on, at the slowest allowed rate rather than never.
    assert operations.get_operation(storage, world["operation"]).done == 1


def test_rdq_reaper_once_reaps_delivers_and_applies_retention_past_a_poisoned_operation(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/rdq.db"
    storage = open_storage(url)
    storage.migrate()
    poisoned_world(storage)
    publisher = Recording()
    monkeypatch.setattr(cli.hosts, "publisher_from_settings", lambda settings: publisher)
    code = cli.main(["--storage", url, "reaper", "--once", "--interval", "1", "--retention-hours", str(0.3 / 3600)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (code, report["reaped"], report["retention_deleted"], report["failed_steps"]) == (0, 1, 1, []), report
    assert report["operations_failed"] == 1, "the unreadable one, logged and skipped"
    assert_the_rest_was_done(storage, publisher.got)
    storage.close()


def test_a_step_that_raises_does_not_stop_the_steps_after_it(
        reaper_function_world: tuple[Storage, Recording, dict[str, Any]], lambda_context: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    storage, publisher, _ = reaper_function_world

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OverflowError("date value out of range")

    monkeypatch.setattr(maintenance, "drive_operations", broken)  # the pass every host runs
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["failed_steps"] == ["operations"], summary
    assert_the_rest_was_done(storage, publisher.got)


def test_every_host_runs_the_same_steps_in_the_same_order(tmp_path: Any) -> None:
    storage = open_storage(f"sqlite:///{tmp_path}/rdq.db")
    storage.migrate()
    seen: list[str] = []
    plan = maintenance.MaintenancePlan(publisher=Recording(), retention_hours=1.0,
                                       host_steps=[("gauges", lambda deadline: seen.append("gauges"))])
    report = maintenance.run_maintenance(storage, plan, deadline=time.monotonic() + 10)
    assert list(report.passed.results) == ["reap", "gauges", *maintenance.STEP_ORDER[1:]]
    assert seen == ["gauges"] and report.failed == {}
    storage.close()


def test_rdq_worker_runs_the_whole_pass_past_a_poisoned_operation(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rdq_core.hosts.process import worker as worker_module
    from rdq_core.hosts.process.worker import Worker, WorkerConfig

    url = f"sqlite:///{tmp_path}/rdq.db"
    storage = open_storage(url)
    storage.migrate()
    poisoned_world(storage)
    publisher = Recording()
    monkeypatch.setattr(worker_module, "publisher_from_settings", lambda settings: publisher)
    monkeypatch.setenv("RDQ_RETENTION_HOURS", str(0.3 / 3600))
    # The worker serves (and so reaps) "fine", paused so that it claims nothing the test then reads.
    Client(storage, payload_store=None).pause("fine")
    worker = Worker(storage, WorkerConfig(queues=["fine"], reap_interval_seconds=0.2, wake_up=False,
                                          schedules_every_seconds=0))
    runner = threading.Thread(target=worker.run_forever)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lapsed = storage.get("lapsed")
            if storage.get("old-done") is None and lapsed is not None and lapsed.status is TaskStatus.PENDING \
                    and any(event.type == "rdq.task.dead" for event in publisher.got):
                break
            time.sleep(0.05)
    finally:
        worker.stop()
        runner.join(timeout=30)
    assert_the_rest_was_done(storage, publisher.got)
    storage.close()
