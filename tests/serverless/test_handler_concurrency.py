"""HandlerConcurrency: one worker invocation runs several handlers at once, through the claim
loops of ``rdq worker --concurrency`` (``claiming.run_concurrently``), each under its own
timeout; and every claim is sized to the time the invocation has left (``claiming.ClaimPace``)."""

from __future__ import annotations

import threading

import pytest

from rdq_core import Client
from rdq_core.compliance.runner_paths import enqueue_in_order
from rdq_core.compliance.support import wait_until
from rdq_core.hosts.aws_lambda import connection, worker

from . import concurrency_handlers, sample_handlers
from .conftest import load_event

HANDLERS = "tests.serverless.sample_handlers,tests.serverless.concurrency_handlers"


@pytest.fixture
def client(store_url, monkeypatch) -> Client:
    monkeypatch.setenv("RDQ_HANDLERS", HANDLERS)
    concurrency_handlers.RUNS.clear()
    return Client(connection.shared_storage())


def _runs(task_ids) -> list[tuple[str, str, float, float]]:
    runs = [run for run in concurrency_handlers.RUNS if run[0] in set(task_ids)]
    assert len(runs) == len(task_ids), runs
    return runs


@pytest.mark.parametrize("handler", ["naps", "naps-async"])
def test_four_handlers_run_at_once_in_one_invocation(client, lambda_context, monkeypatch, handler):
    monkeypatch.setenv("RDQ_HANDLER_CONCURRENCY", "4")
    ids = [client.enqueue("emails", handler, {"n": n}).id for n in range(4)]

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))

    assert summary["outcomes"] == {"SUCCESS": 4} and summary["released"] == 0, summary
    runs = _runs(ids)
    # All four were running at one instant: the last to start began before the first to end ended.
    assert max(start for _, _, start, _ in runs) < min(end for _, _, _, end in runs), runs
    assert len({thread for _, thread, _, _ in runs}) == 4
    assert all(client.get(task_id).status.value == "SUCCEEDED" for task_id in ids)


def test_one_handler_at_a_time_without_handler_concurrency(client, lambda_context):
    ids = [client.enqueue("emails", "naps", {"n": n}).id for n in range(3)]
    worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    runs = sorted(_runs(ids), key=lambda run: run[2])
    assert all(earlier[3] <= later[2] for earlier, later in zip(runs, runs[1:], strict=False)), runs


def test_an_overrunning_handler_costs_only_its_own_task_and_its_batch_is_released_at_the_deadline(
        client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_HANDLER_CONCURRENCY", "2")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "8")  # 4 per loop
    sample_handlers.OVERRUN_RELEASE.clear()
    # Each loop's first claim is one task (quick); a later claim of up to four has the overrunning
    # handler first and tasks waiting behind it in that loop's batch.
    first, second, stuck, *behind = enqueue_in_order(
        client.storage, "emails", ["quick", "quick", "overruns-the-invocation"] + ["quick"] * 7)
    invocation = threading.Thread(
        target=worker.lambda_handler, args=(load_event("worker-scheduled"), lambda_context("rdq-worker", 7)),
        daemon=True)
    invocation.start()
    try:
        # At the deadline (7 s - 2 s settle reserve) the overrunning handler still runs: every other
        # task is settled, or back in the queue unstarted with no attempt spent.
        def only_the_stuck_task_is_held() -> bool:
            stats = client.stats("emails")
            return client.get(stuck).status.value == "IN_FLIGHT" and stats.in_flight == 1 \
                and stats.succeeded + stats.pending == 9

        wait_until(only_the_stuck_task_is_held, timeout=10, what="the deadline to release around the stuck handler")
        assert invocation.is_alive()
        released = [t for t in map(client.get, behind) if t.status.value == "PENDING"]
        assert released and all(t.attempt_count == 0 and not t.attempts for t in released)
        assert client.get(first).status.value == client.get(second).status.value == "SUCCEEDED"
    finally:
        sample_handlers.OVERRUN_RELEASE.set()
        invocation.join(30)


def test_a_short_invocation_claims_only_what_it_can_start_and_holds_nothing_after(client, lambda_context, monkeypatch):
    # Two loops, each handler 0.3 s of a 2 s timeout, a 6 s function: starts are possible only
    # while 3 s (2 s + the 1 s settle margin) remain before the deadline (6 - 2 = 4 s away), so
    # about 1 s. Claiming BatchSize at once, this invocation took 40 and released most of them
    # unstarted; sized to the time left, each loop claims one task to measure, then what fits.
    monkeypatch.setenv("RDQ_HANDLER_CONCURRENCY", "2")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "40")
    client.enqueue_many("emails", [{"handler": "naps", "payload": n} for n in range(40)])

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 6))

    assert summary["started"] >= 4, summary
    assert summary["released"] <= 2 * 2, summary  # one or two per loop, as its window closes
    assert summary["claimed"] == summary["started"] + summary["released"]
    stats = client.stats("emails")
    assert stats.in_flight == 0, "nothing stays held once the invocation is over"
    assert stats.succeeded == summary["started"] and stats.pending == 40 - summary["started"]


def test_an_async_handler_is_cancelled_at_its_timeout_and_retried(client, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_HANDLER_CONCURRENCY", "2")
    task_id = client.enqueue("emails", "async-past-its-timeout").id

    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))

    assert summary["outcomes"] == {"RETRYABLE_FAILURE": 1}, summary
    task = client.get(task_id)
    (attempt,) = task.attempts
    assert attempt.error.type.endswith("TimeoutError") and "cancelled at its deadline" in attempt.error.message
    assert task.status.value == "PENDING" and task.attempt_count == 1
