"""Lease expiry and the reaper: an expired lease becomes exactly one LEASE_EXPIRED attempt, then
backoff or the DLQ; the expired-lease scan is bounded and read-only."""

from __future__ import annotations

import threading

from ..model import Backoff, Outcome, TaskStatus
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..storage.spi import Storage
from .support import OpenStore, enqueue_n, error_of, must_get, present, wait_until


class LeaseCompliance:
    short_lease: float

    def test_lease_expiry_becomes_one_attempt_then_backoff_then_dead(self, storage: Storage) -> None:
        policies = PolicyBook(RetryPolicy(max_attempts=2, backoff=Backoff(0.4, 2.0, 5.0, 0.0)))
        (task_id,) = enqueue_n(storage, "reap", 1)
        storage.claim("reap", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="reap"), what="the lease to expire")
        report = reap_expired_leases(storage, policies, queue="reap")
        assert (report.expired, report.rescheduled, report.dead_lettered) == (1, 1, 0)
        assert reap_expired_leases(storage, policies, queue="reap").expired == 0
        task = must_get(storage, task_id)
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED)]
        assert error_of(task.attempts[0]).type == "rdq.LeaseExpired"
        due, finished = present(task.next_attempt_at, "next_attempt_at"), present(task.attempts[0].finished_at, "finished_at")
        assert (due - finished).total_seconds() >= 0.35  # backoff, not a hand-off
        assert storage.claim("reap", 1, self.short_lease) == []
        wait_until(lambda: storage.claim("reap", 1, self.short_lease), what="the backoff to pass")
        wait_until(lambda: storage.find_expired_leases(10, queue="reap"), what="the second lease to expire")
        assert reap_expired_leases(storage, policies, queue="reap").dead_lettered == 1
        task = must_get(storage, task_id)
        assert task.status is TaskStatus.DEAD and task.attempt_count == 2
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED), (2, Outcome.LEASE_EXPIRED)]

    def test_racing_reapers_record_exactly_one_lease_expired_attempt(self, storage: Storage, open_another: OpenStore) -> None:
        ids = enqueue_n(storage, "reapers", 30)
        storage.claim("reapers", 30, self.short_lease)
        wait_until(lambda: len(storage.find_expired_leases(100, queue="reapers")) == 30, what="all leases to expire")
        stores = [open_another() for _ in range(4)]
        policies = PolicyBook(RetryPolicy(5, Backoff(60, 2, 600, 0)))
        barrier = threading.Barrier(4)
        reports = []

        def reap(store: Storage) -> None:
            barrier.wait()
            reports.append(reap_expired_leases(store, policies, batch_size=7, queue="reapers"))

        threads = [threading.Thread(target=reap, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sum(r.expired for r in reports) == 30
        for task_id in ids:
            task = must_get(storage, task_id)
            assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED)]

    def test_find_expired_leases_is_bounded_and_read_only(self, storage: Storage) -> None:
        enqueue_n(storage, "bounded", 12)
        storage.claim("bounded", 12, self.short_lease)
        wait_until(lambda: len(storage.find_expired_leases(100, queue="bounded")) == 12, what="leases to expire")
        assert len(storage.find_expired_leases(5, queue="bounded")) == 5
        assert storage.stats("bounded").in_flight == 12
        expired = storage.find_expired_leases(5)
        assert all(e.task.status is TaskStatus.IN_FLIGHT and e.claim_token and e.task.attempts == () for e in expired)

    def test_find_expired_leases_of_no_tasks_returns_nothing(self, storage: Storage) -> None:
        """``limit <= 0`` asks for nothing: an empty list, not an error and not "no limit"."""
        enqueue_n(storage, "none-expired", 2)
        storage.claim("none-expired", 2, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="none-expired"), what="the leases to expire")
        for limit in (0, -1):
            assert storage.find_expired_leases(limit, queue="none-expired") == []
            assert storage.find_expired_leases(limit) == []
        assert storage.stats("none-expired").in_flight == 2
