"""The reaper's per-queue gauges and the worker's fan-out read each queue's live work through
``Storage.live_stats`` (index-served, finished tasks never read), never the full ``stats``."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from rdq_core import Client
from rdq_core.hosts.aws_lambda import connection, reaper, worker
from rdq_core.storage.spi import Storage

from .conftest import load_event
from .test_worker_and_reaper import RecordingLambdaClient


@pytest.fixture
def reads(store_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Which modules asked ``stats`` and ``live_stats`` for which queue, on the shared store."""
    storage = connection.shared_storage()
    calls: dict[str, list[str]] = {"stats": [], "live_stats": []}
    cls = type(storage)
    real_stats, real_live = cls.stats, cls.live_stats

    def stats(self: Storage, queue: str) -> Any:
        calls["stats"].append(f"{sys._getframe(1).f_globals['__name__']}:{queue}")
        return real_stats(self, queue)

    def live_stats(self: Storage, queue: str) -> Any:
        calls["live_stats"].append(f"{sys._getframe(1).f_globals['__name__']}:{queue}")
        return real_live(self, queue)

    monkeypatch.setattr(cls, "stats", stats)
    monkeypatch.setattr(cls, "live_stats", live_stats)
    return calls


def test_the_reapers_gauges_read_live_stats_only(reads, lambda_context, monkeypatch):
    published: list[tuple[str, str, float]] = []
    monkeypatch.setattr(reaper, "publish_queue_gauge", lambda queue, name, value, *unit: published.append((queue, name, value)))
    monkeypatch.setattr(reaper, "_live_queues", set())
    client = Client(connection.shared_storage(), payload_store=None)
    client.enqueue_many("gauged", [{"handler": "quick", "payload": n} for n in range(5)])
    claimed = client.storage.claim("gauged", 2, 60)
    assert len(claimed) == 2
    client.enqueue("finished-only", "quick", id="done")
    client.cancel("done")
    reads["stats"].clear()
    reads["live_stats"].clear()

    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))

    assert summary["failed_steps"] == []
    gauges_read = sorted(r for r in reads["live_stats"] if r.startswith("rdq_core.hosts.aws_lambda.reaper:"))
    assert gauges_read == ["rdq_core.hosts.aws_lambda.reaper:finished-only", "rdq_core.hosts.aws_lambda.reaper:gauged"]
    assert not [r for r in reads["stats"] if r.startswith("rdq_core.hosts.aws_lambda.")], \
        "no gauge counts a queue's every task"
    gauges = {(queue, name): value for queue, name, value in published}
    assert gauges == {("gauged", "QueueDepth"): 3, ("gauged", "DeadTasks"): 0,
                      ("gauged", "OldestPendingAge"): gauges[("gauged", "OldestPendingAge")]}
    assert summary["pending"] == 3 and summary["queues_with_gauges"] == 1


def test_the_worker_reads_its_backlog_from_live_stats(reads, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    monkeypatch.setattr(worker.invoker, "_client", RecordingLambdaClient())
    Client(connection.shared_storage()).enqueue_many("backlog", [{"handler": "quick", "payload": n} for n in range(12)])
    reads["stats"].clear()
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    assert summary["claimed"] == 12 and summary["fanned_out"] >= 1
    assert "rdq_core.hosts.aws_lambda.worker:backlog" in reads["live_stats"] and reads["stats"] == []
