"""Attempt history: every settle, by a worker or a reaper, before and after a redrive, adds
exactly the next attempt number (``MAX(attempt_no) + 1``, never derived from the retry budget)."""

from __future__ import annotations

from ..model import Backoff, ClaimedTask, DeadFilter, ErrorInfo, Outcome, TaskStatus
from ..engine.outcomes import failed_attempt
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..storage.spi import Storage
from .support import enqueue_n, must_get, present, success, wait_until


class HistoryCompliance:
    short_lease: float

    def test_redrive_then_lease_expiry_numbers_the_attempt_after_all_history(self, storage: Storage) -> None:
        """The seed bug: a LEASE_EXPIRED number derived from the reset budget collided with history."""
        policies = PolicyBook(RetryPolicy(max_attempts=2, backoff=Backoff(0.01, 1, 0.01, 0)))
        (task_id,) = enqueue_n(storage, "seed", 1)
        for _ in range(2):
            (claimed,) = wait_until(lambda: storage.claim("seed", 1, 30), what="the task to come due")
            storage.settle([failed_attempt(policies, claimed.task, claimed.claim_token, Outcome.RETRYABLE_FAILURE,
                                                    ErrorInfo("test.Flaky", "flaky"))])
        assert must_get(storage, task_id).status is TaskStatus.DEAD
        assert storage.redrive("seed", DeadFilter(ids=(task_id,))) == 1
        task = must_get(storage, task_id)
        assert (task.status, task.attempt_count, task.redrive_count, len(task.attempts)) == (TaskStatus.PENDING, 0, 1, 2)
        assert task.dead_at is None
        (held,) = storage.claim("seed", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="seed"), what="the redriven task's lease to expire")
        assert reap_expired_leases(storage, policies, queue="seed").expired == 1
        task = must_get(storage, task_id)
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.RETRYABLE_FAILURE), (3, Outcome.LEASE_EXPIRED)]
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1
        # The attempt starts when its claim did: how a history audit ties a claim to its attempt.
        assert task.attempts[2].started_at == held.claimed_at <= present(task.attempts[2].finished_at, "the attempt's finish")
        (claimed,) = wait_until(lambda: storage.claim("seed", 1, 30), what="the retry to come due")
        storage.settle([success(claimed)])
        assert [a.attempt_no for a in must_get(storage, task_id).attempts] == [1, 2, 3, 4]

    def test_history_stays_gap_free_through_retry_reap_dead_and_redrive(self, storage: Storage) -> None:
        """Every settle, by a worker or a reaper, before and after a redrive, adds exactly the
        next attempt number: the history reads 1..n whatever path each attempt took."""
        policies = PolicyBook(RetryPolicy(max_attempts=3, backoff=Backoff(0.01, 1, 0.01, 0)))
        (task_id,) = enqueue_n(storage, "history", 1)
        expected: list[Outcome] = []

        def claim(lease: float) -> ClaimedTask:
            (claimed,) = wait_until(lambda: storage.claim("history", 1, lease), what="the task to come due")
            return claimed

        def fail(claimed: ClaimedTask) -> None:
            storage.settle([failed_attempt(policies, claimed.task, claimed.claim_token, Outcome.RETRYABLE_FAILURE,
                                                    ErrorInfo("test.Flaky", "flaky"))])
            expected.append(Outcome.RETRYABLE_FAILURE)

        def reap() -> None:
            claim(self.short_lease)
            wait_until(lambda: storage.find_expired_leases(10, queue="history"), what="the lease to expire")
            assert reap_expired_leases(storage, policies, queue="history").expired == 1
            expected.append(Outcome.LEASE_EXPIRED)

        def history() -> list[tuple[int, Outcome]]:
            return [(a.attempt_no, a.outcome) for a in must_get(storage, task_id).attempts]

        fail(claim(30))
        reap()
        fail(claim(30))  # the third attempt spends the budget
        task = must_get(storage, task_id)
        assert task.status is TaskStatus.DEAD and task.attempt_count == 3
        assert history() == list(enumerate(expected, start=1))
        (dead,) = storage.list_dead("history", limit=10).tasks
        assert [(a.attempt_no, a.outcome) for a in dead.attempts] == list(enumerate(expected, start=1))
        assert storage.redrive("history", DeadFilter(ids=(task_id,))) == 1
        assert history() == list(enumerate(expected, start=1))
        reap()
        fail(claim(30))
        storage.settle([success(claim(30))])
        expected.append(Outcome.SUCCESS)
        task = must_get(storage, task_id)
        assert (task.status, task.attempt_count, task.redrive_count) == (TaskStatus.SUCCEEDED, 3, 1)
        assert history() == list(enumerate(expected, start=1))
        assert [a.attempt_no for a in task.attempts] == list(range(1, 7))
