"""The worker and reaper functions, invoked with the shipped scheduled events and a real deadline."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

import pytest

from rdq_core import Client
from rdq_core.hosts.aws_lambda import connection, reaper, worker
from rdq_core.hosts.aws_lambda.invoker import invoker, workers_for_backlog

from .conftest import load_event


class RecordingLambdaClient:
    def __init__(self) -> None:
        self.invocations: list[dict[str, Any]] = []

    def invoke(self, **kwargs: Any) -> dict[str, Any]:
        self.invocations.append({**kwargs, "Payload": json.loads(kwargs["Payload"])})
        return {"StatusCode": 202}


@pytest.fixture
def client(store_url) -> Client:
    return Client(connection.shared_storage())


def test_scheduled_worker_runs_what_fits_and_releases_what_does_not_fit_the_time_left(
        client, lambda_context, monkeypatch, capsys):
    monkeypatch.setenv("RDQ_WORKER_TIMEOUT_SECONDS", "30")  # a 30 s function, 10 s of it left
    for n in range(3):
        client.enqueue("emails", "quick", {"n": n}, id=f"quick-{n}")
    client.enqueue("emails", "needs-twenty-seconds", id="long-1")

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 10))

    assert summary["outcomes"] == {"SUCCESS": 3}
    assert summary["released"] >= 1
    for n in range(3):
        task = client.get(f"quick-{n}")
        assert task.status.value == "SUCCEEDED" and task.result == {"echo": {"n": n}, "attempt": 1}
    long_task = client.get("long-1")
    assert long_task.status.value == "PENDING", "released, not failed: a fresh invocation has time for it"
    assert long_task.attempt_count == 0 and long_task.attempts == (), "a release spends no attempt"
    emf = capsys.readouterr().out
    assert '"Claimed"' in emf and '"Succeeded"' in emf and '"Released"' in emf


def test_a_task_that_can_never_fit_the_function_is_dead_lettered_and_the_rest_runs(client, lambda_context, caplog):
    # A batch's worth of tasks that need 20 s, at the head of the queue, in a 10 s function.
    for n in range(12):
        client.enqueue("emails", "needs-twenty-seconds", id=f"long-{n}")
    for n in range(3):
        client.enqueue("emails", "quick", {"n": n}, id=f"quick-{n}")

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 10))

    assert summary["too_long"] == 12 and summary["outcomes"] == {"SUCCESS": 3}, summary
    for n in range(3):
        assert client.get(f"quick-{n}").status.value == "SUCCEEDED"
    dead = client.get("long-0")
    assert dead.status.value == "DEAD"
    (attempt,) = dead.attempts
    assert attempt.error.type == "rdq.TimeoutExceedsWorker"
    assert "timeout_seconds=20" in attempt.error.message and "10s timeout" in attempt.error.message
    assert any(r.levelname == "WARNING" and "long-0" in r.getMessage() for r in caplog.records)


def test_a_handler_overrunning_the_invocation_costs_only_its_own_task(client, lambda_context):
    from rdq_core.compliance.runner_paths import enqueue_in_order
    from rdq_core.compliance.support import wait_until

    from . import sample_handlers

    sample_handlers.OVERRUN_RELEASE.clear()
    done, stuck, *behind = enqueue_in_order(client.storage, "emails", ["quick", "overruns-the-invocation"] + ["quick"] * 3)
    invocation = threading.Thread(
        target=worker.lambda_handler, args=(load_event("worker-scheduled"), lambda_context("rdq-worker", 7)), daemon=True)
    invocation.start()
    try:
        # The deadline (7 s minus the 2 s settle reserve) passes while the handler still runs:
        # the success before it is in the store and the tasks behind it are released, so a
        # Lambda timeout now would cost only the overrunning task.
        wait_until(lambda: client.get(done).status.value == "SUCCEEDED"
                   and all(client.get(t).status.value == "PENDING" for t in behind),
                   timeout=10, what="the deadline to settle and release around the overrunning handler")
        assert invocation.is_alive() and client.get(stuck).status.value == "IN_FLIGHT"
    finally:
        sample_handlers.OVERRUN_RELEASE.set()
        invocation.join(30)


def test_lease_is_the_invocations_remaining_time_plus_grace(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_LEASE_GRACE_SECONDS", "30")
    client.enqueue("emails", "report-lease", id="lease-1")
    before = client.storage.now()
    worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 12))
    result = client.get("lease-1").result
    lease_expires_at = datetime.fromisoformat(result["lease_expires_at"])
    held_for = (lease_expires_at - before).total_seconds()
    assert 12 + 30 - 2 <= held_for <= 12 + 30 + 1, held_for
    # The handler's own time budget never reaches past the invocation's end.
    assert result["remaining_seconds"] <= 12


def test_a_running_task_names_the_invocation_that_holds_it(client, lambda_context):
    context = lambda_context("rdq-prod-Worker-7QX2", 30)
    context.aws_request_id = "8f5e2c1a-0b7d-4d6e-9a3f-1c2b3d4e5f60"
    context.log_stream_name = "2026/12/05/[$LATEST]0123456789abcdef0123456789abcdef"
    client.enqueue("emails", "report-claimer", id="claimer-1")
    worker.lambda_handler(load_event("worker-scheduled"), context)
    task = client.get("claimer-1")
    # What an operator needs to find the invocation's logs: the function, its request id and
    # its log stream, as the store held them while the handler ran.
    assert task.result == {"claimed_by": "rdq-prod-Worker-7QX2 request 8f5e2c1a-0b7d-4d6e-9a3f-1c2b3d4e5f60 "
                                         "log stream 2026/12/05/[$LATEST]0123456789abcdef0123456789abcdef"}
    assert task.status.value == "SUCCEEDED" and task.claimed_by is None, "shown only while in flight"


def test_the_invocation_name_keeps_its_request_id_when_cut_to_length():
    class LongNamedContext:
        function_name = "f" * 64
        aws_request_id = "8f5e2c1a-0b7d-4d6e-9a3f-1c2b3d4e5f60"
        log_stream_name = "s" * 300

    name = worker.invocation_name(LongNamedContext())
    assert len(name) == 200 and name.startswith("f" * 64 + " request 8f5e2c1a-0b7d-4d6e-9a3f-1c2b3d4e5f60 log stream ")
    assert worker.invocation_name(object()) == "", "a context without the attributes names nobody"


def test_worker_keeps_claiming_while_time_remains(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    client.enqueue_many("emails", [{"handler": "quick", "payload": n} for n in range(7)])
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    assert summary["claimed"] == 7 and summary["outcomes"] == {"SUCCESS": 7}
    assert client.stats("emails").succeeded == 7


def test_worker_stops_at_once_when_too_little_time_is_left(client, lambda_context):
    client.enqueue("emails", "quick", id="q-1")
    began = time.monotonic()
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 1.5))
    assert time.monotonic() - began < 1.5
    assert summary["started"] == 0
    assert client.get("q-1").status.value == "PENDING"


def test_scheduled_worker_fans_out_bounded_by_max_concurrency(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    monkeypatch.setenv("RDQ_MAX_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    client.enqueue_many("emails", [{"handler": "quick", "payload": n} for n in range(40)])

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))

    assert summary["fanned_out"] == 2, "the scheduled worker is one of the 3"
    assert len(recorder.invocations) == 2
    for invocation in recorder.invocations:
        assert invocation["FunctionName"] == "rdq-worker" and invocation["InvocationType"] == "Event"
        assert invocation["Payload"]["detail"]["queues"] == ["emails"]

    # An invoked worker works but never fans out again: no chain reaction.
    client.enqueue_many("emails", [{"handler": "quick", "payload": n} for n in range(40)])
    fanned = worker.lambda_handler(recorder.invocations[0]["Payload"], lambda_context("rdq-worker", 30))
    assert fanned["fanned_out"] == 0 and fanned["claimed"] == 40
    assert len(recorder.invocations) == 2


@pytest.mark.parametrize(
    "backlog, batch, cap, expected",
    [(0, 10, 4, 0), (10, 10, 4, 1), (11, 10, 4, 2), (35, 10, 4, 4), (10_000, 10, 4, 4), (10_000, 10, 1, 1)],
)
def test_fleet_size_for_a_backlog(backlog, batch, cap, expected):
    assert workers_for_backlog(backlog, batch, cap) == expected


def test_delayed_tasks_are_not_a_backlog(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    recorder = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", recorder)
    client.enqueue_many("emails", [{"handler": "quick", "delay_seconds": 3600} for _ in range(20)])
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    assert summary["fanned_out"] == 0 and recorder.invocations == []


def _wait_until(condition, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(interval)


def test_reaper_reaps_expired_leases_and_publishes_queue_gauges(client, lambda_context, capsys):
    client.enqueue("emails", "always-permanent", id="dead-1")
    worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))  # dead-1 -> DEAD
    client.enqueue("emails", "quick", id="crashed-1")
    client.enqueue("emails", "quick", id="crashed-2")
    # A worker that claimed and then died (timeout/OOM): its lease runs out, nobody settles.
    claimed = client.storage.claim("emails", 10, 0.05)
    assert {c.task.id for c in claimed} == {"crashed-1", "crashed-2"}
    storage = client.storage
    _wait_until(lambda: len(storage.find_expired_leases(10)) == 2)
    capsys.readouterr()

    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))

    assert summary["expired"] == 2 and summary["rescheduled"] == 2 and summary["dead"] == 1
    for task_id in ("crashed-1", "crashed-2"):
        task = client.get(task_id)
        assert task.status.value == "PENDING"
        assert [a.outcome.value for a in task.attempts] == ["LEASE_EXPIRED"]
    emf = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    names = {m["Name"] for blob in emf for d in blob["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]}
    assert {"LeaseExpired", "QueueDepth", "DeadTasks", "OldestPendingAge"} <= names
    per_queue = [blob for blob in emf if blob.get("queue") == "emails"]
    assert per_queue, "gauges are also published per queue"
    totals = [blob for blob in emf if "DeadTasks" in blob and "queue" not in blob]
    assert totals and totals[0]["DeadTasks"] in (1, 1.0, [1.0]), totals


def test_reaper_stops_at_its_deadline(client, lambda_context):
    began = time.monotonic()
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 1))
    assert time.monotonic() - began < 1.0 and summary["expired"] == 0
