"""The operator's side: get, cancel, stats, the queue list and retention."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import pytest

from ..errors import InvalidInput, TaskConflict, TaskNotFound
from ..model import ClaimRef, DeadFilter, Outcome, Settlement, TaskStatus
from ..storage.spi import Storage
from .support import dead_letter, enqueue_n, must_get, success


class OperatorCompliance:
    def test_get_of_an_unknown_task_is_none(self, storage: Storage) -> None:
        assert storage.get("no-such-task") is None

    def test_ids_that_are_not_strings_are_invalid_input_and_touch_nothing(self, storage: Storage) -> None:
        """Operator-shaped values (``{"$gt": ""}``) where an id or token belongs never reach a
        query: refused as ``InvalidInput`` before anything is read or written."""
        (task_id,) = enqueue_n(storage, "shaped", 1)
        shaped = {"$ne": None}
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: storage.get(shaped),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
            "cancel": lambda: storage.cancel(
                shaped),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
            "settle": lambda: storage.settle([Settlement(
                shaped, shaped,  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
                Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
            "extend": lambda: storage.extend_leases([ClaimRef(
                task_id, shaped)], 30),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
            "release": lambda: storage.release([ClaimRef(
                shaped, "token")]),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
            "redrive": lambda: storage.redrive("shaped", DeadFilter(
                ids=({"$exists": True},))),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
            "purge_dead": lambda: storage.purge_dead("shaped", DeadFilter(
                ids=(shaped,))),  # type: ignore[arg-type]  # deliberately wrong type: the store must refuse it
        }
        for call in calls.values():
            with pytest.raises(InvalidInput):
                call()
        assert must_get(storage, task_id).status is TaskStatus.PENDING and storage.stats("shaped").pending == 1

    def test_cancel_only_pending_tasks(self, storage: Storage) -> None:
        running, pending = enqueue_n(storage, "cancel", 1) + enqueue_n(storage, "cancel", 1)
        (held,) = storage.claim("cancel", 1, 30)
        assert held.task.id == running
        cancelled = storage.cancel(pending)
        assert cancelled.id == pending and cancelled.status is TaskStatus.CANCELLED
        with pytest.raises(TaskConflict):
            storage.cancel(pending)
        with pytest.raises(TaskConflict):
            storage.cancel(running)
        with pytest.raises(TaskNotFound):
            storage.cancel("no-such-task")
        assert storage.claim("cancel", 10, 30) == []
        assert must_get(storage, pending).status is TaskStatus.CANCELLED
        assert must_get(storage, running).status is TaskStatus.IN_FLIGHT
        assert storage.stats("cancel").cancelled == 1

    def test_stats_count_each_status_and_the_oldest_due_age(self, storage: Storage) -> None:
        assert storage.stats("stats").pending == 0 and storage.stats("stats").oldest_pending_age_seconds == 0
        enqueue_n(storage, "stats", 6)
        enqueue_n(storage, "stats", 1, delay_seconds=3600)
        claimed = storage.claim("stats", 3, 30)
        storage.settle([success(claimed[0])])
        dead_letter(storage, "stats-dead", 1)
        time.sleep(0.3)
        stats = storage.stats("stats")
        assert (stats.pending, stats.in_flight, stats.succeeded, stats.dead) == (4, 2, 1, 0)
        assert 0.25 <= stats.oldest_pending_age_seconds < 60
        assert storage.stats("stats-dead").dead == 1
        assert {"stats", "stats-dead"} <= set(storage.list_queues())

    def test_oldest_due_age_counts_only_due_tasks(self, storage: Storage) -> None:
        enqueue_n(storage, "age", 1, delay_seconds=3600)
        assert storage.stats("age").oldest_pending_age_seconds == 0  # pending, but not due
        enqueue_n(storage, "age", 1, run_at=storage.now() - timedelta(hours=2))
        assert 7000 < storage.stats("age").oldest_pending_age_seconds < 7300

    def test_retention_purges_only_finished_tasks_older_than_the_cutoff(self, storage: Storage) -> None:
        enqueue_n(storage, "retention", 5)
        done = storage.claim("retention", 2, 30)
        storage.settle([success(c) for c in done])
        cancelled = storage.cancel(enqueue_n(storage, "retention-cancel", 1)[0])
        time.sleep(0.5)
        fresh = storage.claim("retention", 1, 30)
        storage.settle([success(c) for c in fresh])
        dead = dead_letter(storage, "retention-dead", 1)
        assert storage.purge_succeeded(older_than_seconds=3600, limit=100) == 0
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=1) == 1
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=100) == 2
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=100) == 0
        assert all(storage.get(c.task.id) is None for c in done) and storage.get(cancelled.id) is None
        assert must_get(storage, fresh[0].task.id).status is TaskStatus.SUCCEEDED
        assert must_get(storage, dead[0]).status is TaskStatus.DEAD
        assert storage.stats("retention").pending == 2
        assert "retention-cancel" not in storage.list_queues()

    def test_retention_of_no_tasks_deletes_nothing(self, storage: Storage) -> None:
        """``limit <= 0`` deletes nothing (0), not everything."""
        enqueue_n(storage, "keep-all", 2)
        done = storage.claim("keep-all", 2, 30)
        storage.settle([success(c) for c in done])
        for limit in (0, -1):
            assert storage.purge_succeeded(older_than_seconds=0, limit=limit) == 0
        assert storage.stats("keep-all").succeeded == 2
