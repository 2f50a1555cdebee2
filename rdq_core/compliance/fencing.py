"""Settle, extend and release: every post-claim write is fenced by its claim token, applies the
valid items of a batch, names the refused ones, and records exactly what the engine decided."""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Callable

import pytest

from ..errors import InvalidInput, StaleClaim
from ..model import ClaimRef, ClaimedTask, DeadFilter, ErrorInfo, Outcome, Settlement, TaskStatus
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..storage.spi import Storage
from .capabilities import Capabilities
from .support import FAST_BACKOFF, NEVER_ISSUED, due_at, enqueue_n, error_of, must_get, present, retry, state, success, wait_until


class FencingCompliance:
    capabilities: Capabilities  # declared by the suite class this is mixed into
    short_lease: float

    def test_fencing_rejects_never_issued_and_stale_tokens_on_every_write(self, storage: Storage) -> None:
        enqueue_n(storage, "fence", 1)
        (first,) = storage.claim("fence", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="fence"), what="the lease to expire")
        reap_expired_leases(storage, PolicyBook(RetryPolicy(5, FAST_BACKOFF)), queue="fence")
        (second,) = wait_until(lambda: storage.claim("fence", 1, 30), what="the reaped task to come due")
        assert second.task.id == first.task.id and second.claim_token != first.claim_token
        task_id = first.task.id
        for token in (NEVER_ISSUED, first.claim_token):
            before = must_get(storage, task_id)
            writes: dict[str, Callable[[], object]] = {
                "settle": partial(storage.settle, [Settlement(task_id, token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
                "retry": partial(storage.settle, [Settlement(task_id, token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                                                             error=ErrorInfo("x"))]),
                "dead": partial(storage.settle, [Settlement(task_id, token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                                            error=ErrorInfo("x"))]),
                "extend": partial(storage.extend_leases, [ClaimRef(task_id, token)], 600),
                "release": partial(storage.release, [ClaimRef(task_id, token)]),
            }
            for name, write in writes.items():
                with pytest.raises(StaleClaim) as refused:
                    write()
                assert refused.value.task_ids == (task_id,), name
                assert state(must_get(storage, task_id)) == state(before), f"{name} with a bad token changed the task"
        storage.settle([success(second)])
        assert must_get(storage, task_id).status is TaskStatus.SUCCEEDED

    def test_settle_of_an_unknown_task_is_stale(self, storage: Storage) -> None:
        with pytest.raises(StaleClaim):
            storage.settle([Settlement("no-such-task", NEVER_ISSUED, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])

    def test_batch_writes_apply_valid_items_and_name_refused_ones_in_order(self, storage: Storage) -> None:
        enqueue_n(storage, "mixed", 5)
        a, b, c, d, e = storage.claim("mixed", 5, 30)
        with pytest.raises(StaleClaim) as refused:
            storage.settle([success(a), Settlement(b.task.id, NEVER_ISSUED, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                            Settlement("no-such-task", NEVER_ISSUED, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                            success(c)])
        assert refused.value.task_ids == (b.task.id, "no-such-task")
        assert must_get(storage, a.task.id).status is TaskStatus.SUCCEEDED
        assert must_get(storage, b.task.id).status is TaskStatus.IN_FLIGHT
        assert must_get(storage, c.task.id).status is TaskStatus.SUCCEEDED
        with pytest.raises(StaleClaim) as refused:
            storage.extend_leases([d.ref, ClaimRef(e.task.id, NEVER_ISSUED)], 120)
        assert refused.value.task_ids == (e.task.id,)
        assert present(must_get(storage, d.task.id).lease_expires_at, "the extended lease") > d.lease_expires_at
        assert must_get(storage, e.task.id).lease_expires_at == e.lease_expires_at
        with pytest.raises(StaleClaim) as refused:
            storage.release([ClaimRef(d.task.id, NEVER_ISSUED), e.ref])
        assert refused.value.task_ids == (d.task.id,)
        assert must_get(storage, e.task.id).status is TaskStatus.PENDING
        assert must_get(storage, d.task.id).status is TaskStatus.IN_FLIGHT

    def test_a_settled_claim_cannot_be_written_again(self, storage: Storage) -> None:
        enqueue_n(storage, "twice", 1)
        (claimed,) = storage.claim("twice", 1, 30)
        storage.settle([success(claimed, {"n": 1})])
        with pytest.raises(StaleClaim):
            storage.settle([success(claimed, {"n": 2})])
        with pytest.raises(StaleClaim):
            storage.extend_leases([claimed.ref], 30)
        with pytest.raises(StaleClaim):
            storage.release([claimed.ref])
        task = must_get(storage, claimed.task.id)
        assert task.result == {"n": 1} and [a.attempt_no for a in task.attempts] == [1]

    def test_racing_batch_settles_in_opposite_orders_apply_each_item_once(self, storage: Storage) -> None:
        """A late worker and reapers may settle overlapping batches in any order: no deadlock,
        every task settled exactly once, one attempt each."""
        enqueue_n(storage, "racing", 200)
        claimed = storage.claim("racing", 200, 60)
        orders = [claimed, claimed[::-1], claimed[100:] + claimed[:100], claimed[::2] + claimed[1::2]]
        barrier = threading.Barrier(len(orders))
        applied: list[int] = []
        errors: list[BaseException] = []

        def settle_batch(batch: list[ClaimedTask]) -> None:
            barrier.wait()
            try:
                storage.settle([success(c) for c in batch])
                applied.append(len(batch))
            except StaleClaim as stale:
                applied.append(len(batch) - len(stale.task_ids))
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=settle_batch, args=(order,)) for order in orders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == [] and sum(applied) == 200
        for c in claimed:
            assert [a.attempt_no for a in must_get(storage, c.task.id).attempts] == [1]

    # -- what a settle records ---------------------------------------------------------------
    def test_success_records_one_attempt_and_the_result(self, storage: Storage) -> None:
        enqueue_n(storage, "ok", 1)
        (claimed,) = storage.claim("ok", 1, 30)
        storage.settle([success(claimed, {"sent": True, "id": [1, 2], "big": 2**60, "f": 0.1})])
        task = must_get(storage, claimed.task.id)
        assert task.status is TaskStatus.SUCCEEDED and task.result == {"sent": True, "id": [1, 2], "big": 2**60, "f": 0.1}
        assert task.attempt_count == 1 and task.lease_expires_at is None
        (attempt,) = task.attempts
        assert (attempt.attempt_no, attempt.outcome, attempt.error) == (1, Outcome.SUCCESS, None)
        assert attempt.started_at == claimed.claimed_at
        assert present(attempt.finished_at, "finished_at") >= present(attempt.started_at, "started_at")

    def test_retry_reschedules_after_the_delay_and_keeps_the_error(self, storage: Storage) -> None:
        enqueue_n(storage, "retry", 2)
        claimed, later = storage.claim("retry", 2, 30)
        before = storage.now()
        storage.settle([retry(claimed, delay=0.5), retry(later, delay=100)])
        task = must_get(storage, claimed.task.id)
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1 and task.lease_expires_at is None
        assert task.last_error == ErrorInfo("test.Retry", "try again")
        assert task.attempts[0].outcome is Outcome.RETRYABLE_FAILURE and error_of(task.attempts[0]).type == "test.Retry"
        assert 99 <= (due_at(storage, later.task.id) - before).total_seconds() <= 110
        assert storage.claim("retry", 1, 30) == []
        (again,) = wait_until(lambda: storage.claim("retry", 1, 30), what="the retry to come due")
        storage.settle([Settlement(again.task.id, again.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("test.Fatal", "no", "stack"))])
        task = must_get(storage, claimed.task.id)
        assert task.status is TaskStatus.DEAD and present(task.dead_at, "dead_at") >= before and task.attempt_count == 2
        assert task.attempts[1].error == ErrorInfo("test.Fatal", "no", "stack")
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.PERMANENT_FAILURE)]

    def test_settle_takes_outcome_and_status_by_name_and_refuses_unknown_ones(self, storage: Storage) -> None:
        """A caller may name the outcome and status ("SNOOZED", "DEAD"): the checks hold for the
        names as for the members (a snooze goes back to PENDING), and an unknown name is
        InvalidInput that changes nothing -- never a store's error, never a partial batch."""
        enqueue_n(storage, "named", 3)
        a, b, c = storage.claim("named", 3, 30)
        for outcome, status in (("SNOOZED", "DEAD"), ("SUCCESS", "RUNNING"), ("WON", "SUCCEEDED")):
            with pytest.raises(InvalidInput):
                storage.settle([success(a), Settlement(b.task.id, b.claim_token, outcome, status)])  # type: ignore[arg-type]
            assert {must_get(storage, x.task.id).status for x in (a, b)} == {TaskStatus.IN_FLIGHT}
        storage.settle([
            Settlement(a.task.id, a.claim_token, "SUCCESS", "SUCCEEDED"),  # type: ignore[arg-type]
            Settlement(b.task.id, b.claim_token, "SNOOZED", "PENDING", retry_delay_seconds=600),  # type: ignore[arg-type]
            Settlement(c.task.id, c.claim_token, "PERMANENT_FAILURE", "DEAD", error=ErrorInfo("x")),  # type: ignore[arg-type]
        ])
        snoozed = must_get(storage, b.task.id)
        assert must_get(storage, a.task.id).status is TaskStatus.SUCCEEDED
        assert snoozed.status is TaskStatus.PENDING and snoozed.attempt_count == 0
        assert [x.outcome for x in snoozed.attempts] == [Outcome.SNOOZED]
        assert must_get(storage, c.task.id).status is TaskStatus.DEAD

    def test_settle_keeps_error_text_verbatim(self, storage: Storage) -> None:
        enqueue_n(storage, "verbatim", 1)
        (claimed,) = storage.claim("verbatim", 1, 30)
        error = ErrorInfo('Weird"Type', 'quotes " \\ / and ünïcödé ✓', "line1\nline2\ttab")
        storage.settle([Settlement(claimed.task.id, claimed.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD,
                                   error=error)])
        dead = must_get(storage, claimed.task.id)
        assert dead.last_error == error and dead.attempts[0].error == error
        page = storage.list_dead("verbatim", limit=5, filter=DeadFilter(error_type='Weird"Type'))
        assert [t.id for t in page.tasks] == [claimed.task.id]

    def test_nul_in_a_settlement_is_kept_or_handled_as_declared(self, storage: Storage) -> None:
        enqueue_n(storage, "nul-settle", 3)
        ok, odd, failing = storage.claim("nul-settle", 3, 30)
        error = ErrorInfo("Bin\x00", "a\x00b", "s\x00")
        if self.capabilities.holds_nul:
            storage.settle([success(odd, "a\x00b"), Settlement(failing.task.id, failing.claim_token, Outcome.RETRYABLE_FAILURE,
                                                              TaskStatus.PENDING, error=error)])
            assert must_get(storage, odd.task.id).result == "a\x00b"
            assert must_get(storage, failing.task.id).last_error == error
            return
        with pytest.raises(InvalidInput):  # a result it cannot hold: the whole batch is refused
            storage.settle([success(ok, "fine"), success(odd, "a\x00b")])
        assert {must_get(storage, c.task.id).status for c in (ok, odd)} == {TaskStatus.IN_FLIGHT}
        storage.settle([Settlement(failing.task.id, failing.claim_token, Outcome.RETRYABLE_FAILURE,
                                   TaskStatus.PENDING, error=error)])
        assert must_get(storage, failing.task.id).last_error == ErrorInfo("Bin\ufffd", "a\ufffdb", "s\ufffd")

    def test_settle_stores_lone_surrogates_as_replacement_characters(self, storage: Storage) -> None:
        """Text no store can encode (a file name from os.fsdecode) is stored with U+FFFD in
        place of the lone surrogate -- on every backend, never an encoding error."""
        import os

        name = os.fsdecode(b"report-\xff.csv")
        stored = "report-\ufffd.csv"
        enqueue_n(storage, "surrogate", 3)
        first, failing, last = storage.claim("surrogate", 3, 30)
        error = ErrorInfo(f"io.{name}", f"cannot open {name}", f"Traceback\n  open('{name}')")
        storage.settle([
            success(first, {"file": name, name: [name]}),
            Settlement(failing.task.id, failing.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                       retry_delay_seconds=60, error=error),
            success(last, name),
        ])
        assert must_get(storage, first.task.id).result == {"file": stored, stored: [stored]}
        assert must_get(storage, last.task.id).result == stored
        failed = must_get(storage, failing.task.id)
        assert failed.status is TaskStatus.PENDING and failed.attempt_count == 1
        for kept in (failed.last_error, failed.attempts[0].error):
            recorded = present(kept, "the recorded error")
            assert recorded.type == f"io.{stored}"
            assert recorded.message == f"cannot open {stored}"
            assert recorded.stack == f"Traceback\n  open('{stored}')"

    # -- release and extend ------------------------------------------------------------------
    def test_release_returns_to_pending_without_spending_an_attempt(self, storage: Storage) -> None:
        ids = enqueue_n(storage, "release", 2)
        due = {i: must_get(storage, i).next_attempt_at for i in ids}
        claimed = storage.claim("release", 2, 30)
        storage.release([c.ref for c in claimed])
        for c in claimed:
            task = must_get(storage, c.task.id)
            assert (task.status, task.attempt_count, task.attempts, task.lease_expires_at) == (TaskStatus.PENDING, 0, (), None)
            assert task.next_attempt_at == due[c.task.id]
        with pytest.raises(StaleClaim):
            storage.release([claimed[0].ref])
        again = storage.claim("release", 5, 30)
        assert {c.task.id for c in again} == {c.task.id for c in claimed}
        assert not {c.claim_token for c in again} & {c.claim_token for c in claimed}

    def test_extend_lease_keeps_the_task_from_the_reaper(self, storage: Storage) -> None:
        enqueue_n(storage, "extend", 1)
        (claimed,) = storage.claim("extend", 1, self.short_lease)
        new_expiry = storage.extend_leases([claimed.ref], 30)[claimed.task.id]
        assert (new_expiry - storage.now()).total_seconds() > 25
        time.sleep(self.short_lease + 0.2)  # the original lease would be over by now
        assert storage.find_expired_leases(10, queue="extend") == []
        assert reap_expired_leases(storage, queue="extend").expired == 0
        storage.settle([success(claimed)])

    def test_a_reaper_that_saw_the_lease_expire_loses_to_a_worker_that_extended(self, storage: Storage) -> None:
        enqueue_n(storage, "late-reap", 1)
        (held,) = storage.claim("late-reap", 1, self.short_lease)
        (expired,) = wait_until(lambda: storage.find_expired_leases(10, queue="late-reap"), what="the lease to expire")
        assert expired.claim_token == held.claim_token
        storage.extend_leases([held.ref], 60)
        with pytest.raises(StaleClaim):
            storage.settle([Settlement(expired.task.id, expired.claim_token, Outcome.LEASE_EXPIRED, TaskStatus.PENDING,
                                       error=ErrorInfo("rdq.LeaseExpired"))])
        storage.settle([success(held)])
        assert [a.outcome for a in must_get(storage, held.task.id).attempts] == [Outcome.SUCCESS]

    def test_lease_expired_settle_is_refused_while_the_lease_is_live(self, storage: Storage) -> None:
        enqueue_n(storage, "live", 1)
        (claimed,) = storage.claim("live", 1, 30)
        with pytest.raises(StaleClaim):
            storage.settle([Settlement(claimed.task.id, claimed.claim_token, Outcome.LEASE_EXPIRED, TaskStatus.PENDING,
                                       error=ErrorInfo("rdq.LeaseExpired"))])
        task = must_get(storage, claimed.task.id)
        assert task.status is TaskStatus.IN_FLIGHT and task.attempts == ()

    def test_extend_never_moves_a_lease_earlier(self, storage: Storage) -> None:
        """A heartbeat asking for less than the lease has left must not shorten it (the reaper
        would take a task its worker still holds); the reported expiry is the stored one."""
        enqueue_n(storage, "extend-max", 1)
        (claimed,) = storage.claim("extend-max", 1, 30)
        task_id, original = claimed.task.id, claimed.lease_expires_at
        short = storage.extend_leases([claimed.ref], 1)[task_id]
        assert short >= original
        assert must_get(storage, task_id).lease_expires_at == short
        time.sleep(0.05)
        longer = storage.extend_leases([claimed.ref], 60)[task_id]
        assert (longer - original).total_seconds() > 25
        assert must_get(storage, task_id).lease_expires_at == longer
        assert storage.extend_leases([claimed.ref], 1)[task_id] == longer
        storage.settle([success(claimed)])
