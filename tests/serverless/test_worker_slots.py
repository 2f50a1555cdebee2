"""The worker function under its store-enforced cap: every invocation takes a worker slot before it
claims, leaves at once without one, frees it at the end (also after an error), and fans out only
into free slots; API wake-ups count against the same cap; an invocation uses one PostgreSQL
connection and leaves none open."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from rdq_core import Client
from rdq_core.hosts.aws_lambda import connection, worker
from rdq_core.hosts.aws_lambda.invoker import FANOUT_SOURCE, invoker
from rdq_core.storage.spi import WorkerStart

from . import slot_handlers
from .conftest import load_event
from .test_api import call, request
from .test_worker_and_reaper import RecordingLambdaClient

FLEET = "rdq-worker"


def fanned_out_event(queue: str) -> dict[str, Any]:
    return {"source": FANOUT_SOURCE, "detail-type": "rdq.fanout", "detail": {"queues": [queue], "index": 0}}


@pytest.fixture
def client(store_url, monkeypatch) -> Client:
    monkeypatch.setenv("RDQ_HANDLERS", "tests.serverless.slot_handlers")
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", FLEET)
    monkeypatch.setattr(invoker, "_client", RecordingLambdaClient())
    return Client(connection.shared_storage())


def test_overlapping_invocations_never_run_more_than_the_cap(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "2")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "1")
    slot_handlers.RUNNING.update(now=0, peak=0)
    client.enqueue_many("slots", [{"handler": "held-for-a-while", "payload": 0.2} for _ in range(8)])
    summaries: list[dict[str, Any]] = []
    invocations = [threading.Thread(target=lambda: summaries.append(
        worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 20)))) for _ in range(6)]
    for invocation in invocations:
        invocation.start()
    for invocation in invocations:
        invocation.join(30)
    assert slot_handlers.RUNNING["peak"] <= 2, "more handlers ran at once than the cap of 2 workers"
    assert sum(1 for s in summaries if s["slot"] is not None) >= 1
    assert [s["claimed"] for s in summaries if s["slot"] is None] == [0] * sum(s["slot"] is None for s in summaries)
    assert client.stats("slots").succeeded + client.stats("slots").pending == 8
    assert client.storage.worker_slots_held(FLEET) == 0, "every slot was freed"


def test_an_invocation_without_a_free_slot_leaves_within_one_round_trip(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "2")
    storage = client.storage
    held = [storage.take_worker_slot(FLEET, 2, 60) for _ in range(2)]
    assert all(held)
    client.enqueue("slots", "quick", id="waits")
    before = storage.round_trips
    summary = worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 20))
    assert summary["slot"] is None and summary["claimed"] == 0
    assert storage.round_trips - before == 1
    assert client.get("waits").status.value == "PENDING"


def test_a_scheduler_firing_enqueues_its_task_even_when_every_slot_is_held(client, lambda_context, monkeypatch):
    from rdq_core.aws.scheduler import SCHEDULED_TIME, target_input
    from rdq_core.engine.schedules import Schedule

    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "1")
    assert client.storage.take_worker_slot(FLEET, 1, 60)
    schedule = Schedule("tick", "cron(0 * * * ? *)", "scheduled", "quick", payload={"n": 1})
    event = __import__("json").loads(target_input(schedule.to_dict()).replace(SCHEDULED_TIME, "2026-12-03T17:00:00Z"))
    summary = worker.run_worker_invocation(event, lambda_context(FLEET, 10))
    assert summary["slot"] is None and summary["scheduled"]["created"] is True
    assert client.get("sched.tick.20261203T170000Z").status.value == "PENDING", "enqueued, left for a worker"


def test_the_slot_is_freed_at_the_end_and_after_an_error(client, lambda_context, monkeypatch):
    client.enqueue("slots", "quick", id="runs")
    summary = worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 20))
    assert summary["slot"] is not None and summary["claimed"] == 1
    assert client.storage.worker_slots_held(FLEET) == 0

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the runner could not start")

    monkeypatch.setattr(worker, "BatchRunner", broken)
    client.enqueue("slots", "quick", id="never-runs")
    with pytest.raises(RuntimeError):
        worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 20))
    assert client.storage.worker_slots_held(FLEET) == 0, "an error frees the slot too"


def test_the_slot_lease_covers_the_invocation_plus_the_grace(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_LEASE_GRACE_SECONDS", "30")
    taken: list[Any] = []
    storage = client.storage
    real_take = type(storage).take_worker_slot

    def recording_take(self: Any, fleet: str, cap: int, lease_seconds: float) -> Any:
        slot = real_take(self, fleet, cap, lease_seconds)
        taken.append(slot)
        return slot

    monkeypatch.setattr(type(storage), "take_worker_slot", recording_take)
    before = storage.now()
    worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 12))
    (slot,) = taken
    assert timedelta(seconds=12 + 30 - 2) <= slot.expires_at - before <= timedelta(seconds=12 + 30 + 1)


def test_fan_out_starts_no_more_workers_than_free_slots(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "4")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    assert client.storage.take_worker_slot(FLEET, 4, 60), "another worker runs"
    client.enqueue_many("slots", [{"handler": "quick", "payload": n} for n in range(40)])
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context(FLEET, 30))
    assert summary["fanned_out"] == 2, "4 slots: one held elsewhere, one by this worker"
    assert len(recorder.invocations) == 2


def test_a_worker_that_ends_with_a_backlog_fills_the_free_slots(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "1")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    client.enqueue_many("slots", [{"handler": "held-for-a-while", "payload": 0.2} for _ in range(30)])
    # A fanned-out worker does not fan out as it starts; with 6 s (2 s of 0.2 s tasks that fit) it
    # ends with a backlog.
    summary = worker.lambda_handler(fanned_out_event("slots"), lambda_context(FLEET, 6))
    assert summary["claimed"] >= 1 and client.stats("slots").pending > 3
    assert summary["fanned_out"] == 3 and len(recorder.invocations) == 3, "its own slot is free again: 3 of 3"


def test_an_idle_worker_leaves_without_fanning_out(client, lambda_context, monkeypatch):
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context(FLEET, 30))
    assert summary["claimed"] == 0 and summary["fanned_out"] == 0 and recorder.invocations == []


def test_api_wake_ups_count_against_the_cap(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "1")
    monkeypatch.setenv("RDQ_WAKE_DEBOUNCE_SECONDS", "0")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    slot = client.storage.take_worker_slot(FLEET, 1, 60)
    assert slot is not None
    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert recorder.invocations == [], "every slot is held: a woken worker would find none"
    assert client.storage.free_worker_slot(slot)
    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert len(recorder.invocations) == 1


def test_a_postgres_invocation_uses_one_connection_and_leaves_none_open(lambda_context, monkeypatch, no_rdq_settings):
    from rdq_testing.servers import SHARED_PG_URL, pg_scratch_database

    with pg_scratch_database(SHARED_PG_URL, prefix="rdq_slotconn_") as url:
        monkeypatch.setenv("RDQ_STORAGE_URL", url)
        monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
        monkeypatch.setenv("RDQ_HANDLERS", "tests.serverless.slot_handlers")
        monkeypatch.setenv("RDQ_PG_MAX_CONNECTIONS", "1")  # as template.yaml sets it for the worker
        monkeypatch.setenv("RDQ_BATCH_SIZE", "3")
        try:
            storage = connection.shared_storage()
            Client(storage).enqueue_many("pg", [{"handler": "held-for-a-while", "payload": 0.02} for _ in range(30)])
            pool = storage._pool  # type: ignore[attr-defined]
            pool.peak_open = pool.open_count
            summary = worker.lambda_handler(fanned_out_event("pg"), lambda_context(FLEET, 20))
            assert summary["outcomes"] == {"SUCCESS": 30}
            assert pool.peak_open == 1, "settles behind the claims share the one connection"
            assert pool.open_count == 0, "a frozen environment would keep an idle connection open"
        finally:
            connection.close_shared_storage()


def test_fan_out_reserves_a_slot_for_each_worker_it_starts_and_each_takes_its_own(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    client.enqueue_many("slots", [{"handler": "quick", "payload": n} for n in range(40)])
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context(FLEET, 30))
    assert summary["fanned_out"] == 2
    starts = [WorkerStart.from_event(i["Payload"]["detail"]["start"]) for i in recorder.invocations]
    assert all(starts) and {s.number for s in starts if s} | {summary["slot"]} == {0, 1, 2}
    # Until the invoked workers run, their slots are pending: no other invocation gets one.
    assert client.storage.worker_slots_held(FLEET) == 2 and client.storage.worker_starts_pending(FLEET) == 2
    late = worker.lambda_handler(load_event("worker-scheduled"), lambda_context(FLEET, 30))
    assert late["slot"] == summary["slot"], "the one free slot; the other two wait for their workers"
    taken = []
    real_take = type(client.storage).take_reserved_worker_slot

    def recording(self: Any, start: WorkerStart, lease_seconds: float) -> Any:
        slot = real_take(self, start, lease_seconds)
        taken.append((start.number, slot))
        return slot

    monkeypatch.setattr(type(client.storage), "take_reserved_worker_slot", recording)
    first = worker.lambda_handler(recorder.invocations[0]["Payload"], lambda_context(FLEET, 30))
    assert taken and taken[0][1] is not None and first["slot"] == taken[0][0] == starts[0].number  # type: ignore[union-attr]
    assert client.storage.worker_starts_pending(FLEET) == 1


def test_a_start_whose_invoke_fails_is_given_back(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "4")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "1")

    class Refusing:
        def invoke(self, **kwargs: Any) -> Any:
            raise RuntimeError("no route to Lambda")

    monkeypatch.setattr(invoker, "_client", Refusing())
    client.enqueue_many("slots", [{"handler": "quick", "payload": n} for n in range(20)])
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context(FLEET, 30))
    assert summary["fanned_out"] == 0 and summary["claimed"] == 20
    assert client.storage.worker_slots_held(FLEET) == 0, "no reservation outlives a refused invoke"


def test_a_wake_up_within_the_debounce_still_wakes_a_fleet_gone_idle(client, lambda_context, monkeypatch):
    """The worker woken a moment ago may have finished already: an enqueue then must not wait for
    the schedule's next tick. Within the debounce, only an idle fleet (no slot held or pending)
    gets a worker."""
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "2")
    monkeypatch.setenv("RDQ_WAKE_DEBOUNCE_SECONDS", "3600")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert len(recorder.invocations) == 1, "the first worker is on its way: it claims both"
    done = worker.lambda_handler(recorder.invocations[0]["Payload"], lambda_context(FLEET, 20))
    assert done["claimed"] == 2 and client.storage.worker_slots_held(FLEET) == 0

    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert len(recorder.invocations) == 2, "the fleet went idle: the debounce must not strand the task"
    start = WorkerStart.from_event(recorder.invocations[1]["Payload"]["detail"]["start"])
    assert start is not None and client.storage.worker_starts_pending(FLEET) == 1
    worker.lambda_handler(recorder.invocations[1]["Payload"], lambda_context(FLEET, 20))

    slot = client.storage.take_worker_slot(FLEET, 2, 60)  # a worker running: it claims what comes
    assert slot is not None
    call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert len(recorder.invocations) == 2, "within the debounce, a running worker is enough"
    assert client.storage.free_worker_slot(slot)


def test_an_api_wake_up_reserves_the_slot_its_worker_takes(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "2")
    monkeypatch.setenv("RDQ_WAKE_DEBOUNCE_SECONDS", "0")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    for _ in range(3):
        call(request("POST", "/v1/queues/slots/tasks", {"handler": "quick"}), lambda_context)
    assert len(recorder.invocations) == 2, "two slots: two wake-ups, the third finds both pending"
    assert client.storage.worker_starts_pending(FLEET) == 2
    summary = worker.lambda_handler(recorder.invocations[1]["Payload"], lambda_context(FLEET, 20))
    start = WorkerStart.from_event(recorder.invocations[1]["Payload"]["detail"]["start"])
    assert start is not None and summary["slot"] == start.number and summary["claimed"] == 3
    assert client.storage.worker_starts_pending(FLEET) == 1 and client.storage.worker_slots_held(FLEET) == 1
