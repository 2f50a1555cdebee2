"""The compliance suite. Each test names one promise of the storage SPI (see ``spi.py``)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Iterator

import pytest

from ..errors import InvalidCursor, SchemaMissing, StaleClaim, TaskConflict, TaskNotFound
from ..handlers import HandlerRegistry
from ..model import (
    Backoff,
    ClaimRef,
    DeadFilter,
    ErrorInfo,
    NewTask,
    Outcome,
    Settlement,
    TaskStatus,
)
from ..reaper import reap_expired_leases
from ..retry import PolicyBook, RetryPolicy
from ..runner import UNKNOWN_HANDLER, BatchRunner
from ..storage import open_storage
from ..storage.spi import Storage
from .runner_paths import RunnerPathsCompliance
from .stateful import StatefulCompliance
from .support import FAST_BACKOFF, dead_letter, enqueue_n, new_task, wait_until

NEVER_ISSUED = "never-issued-token"


def _success(claimed, result=None) -> Settlement:
    return Settlement(claimed.task.id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)


def _retry(claimed, delay: float = 0.0) -> Settlement:
    return Settlement(
        claimed.task.id, claimed.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
        retry_delay_seconds=delay, error=ErrorInfo("test.Retry", "try again"),
    )


def _state(task):
    """The parts of a task a refused write must not change."""
    return (task.status, task.attempt_count, task.lease_expires_at, task.next_attempt_at, len(task.attempts), task.result)


class StorageCompliance(StatefulCompliance, RunnerPathsCompliance):
    """Subclass this and provide a ``storage_url`` fixture (fresh, isolated, empty store)."""

    #: Modules the chaos workers import before ``open_storage`` (third-party backends register here).
    plugin_modules: tuple[str, ...] = ()
    #: Short leases used by expiry tests; raise for slow stores.
    short_lease = 0.3
    #: Chaos test size (the product promise: >= 4 workers, >= 300 tasks, >= 10 kills).
    chaos_workers = 4
    chaos_tasks = 300
    chaos_kills = 10

    @pytest.fixture
    def storage_url(self) -> Iterator[str]:  # pragma: no cover - the backend's test provides it
        raise NotImplementedError("a backend's compliance test class must define a storage_url fixture")

    @pytest.fixture
    def storage(self, storage_url: str) -> Iterator[Storage]:
        store = open_storage(storage_url)
        store.migrate()
        yield store
        store.close()

    @pytest.fixture
    def open_another(self, storage_url: str, storage: Storage):
        """Opens further, independent connections to the same store (closed at teardown)."""
        opened: list[Storage] = []

        def factory() -> Storage:
            store = open_storage(storage_url)
            opened.append(store)
            return store

        yield factory
        for store in opened:
            store.close()

    # -- lifecycle ---------------------------------------------------------------------------
    def test_migrate_is_idempotent(self, storage: Storage) -> None:
        storage.enqueue([new_task("mig")])
        storage.migrate()
        storage.migrate()
        assert storage.stats("mig").pending == 1

    def test_a_store_never_migrated_says_to_run_migrate(self, storage_url: str) -> None:
        """Before ``migrate``, every call either works (a backend that sets itself up) or raises
        ``SchemaMissing`` naming ``rdq migrate`` -- never a driver's own error."""
        store = open_storage(storage_url)
        try:
            for call in (lambda: store.enqueue([new_task("unmigrated")]), lambda: store.stats("unmigrated"),
                         lambda: store.claim("unmigrated", 1, 30), lambda: store.get("nope")):
                try:
                    call()
                except SchemaMissing as exc:
                    assert "rdq migrate" in str(exc)
        finally:
            store.close()

    def test_clock_is_timezone_aware_utc(self, storage: Storage) -> None:
        now = storage.now()
        assert now.tzinfo is not None
        assert abs((now - datetime.now(timezone.utc)).total_seconds()) < 300

    # -- enqueue -----------------------------------------------------------------------------
    def test_enqueue_round_trips_every_field(self, storage: Storage) -> None:
        payload = {"to": "a@b.c", "n": [1, 2.5, None, True], "nested": {"$gt": "", "a.b": "ünïcødé ✓"}}
        item = new_task(
            "fields", "send_email", payload, headers={"trace": "abc"}, max_attempts=7,
            backoff=Backoff(initial_seconds=2, factor=3, max_seconds=60, jitter=0.1),
        )
        (result,) = storage.enqueue([item])
        assert result.created and not result.conflict
        task = storage.get(item.id)
        assert task is not None
        assert (task.queue, task.handler, task.payload, dict(task.headers)) == ("fields", "send_email", payload, {"trace": "abc"})
        assert (task.status, task.attempt_count, task.redrive_count, task.max_attempts) == (TaskStatus.PENDING, 0, 0, 7)
        assert task.backoff == Backoff(2, 3, 60, 0.1)
        assert task.attempts == () and task.created_at is not None and task.next_attempt_at is not None

    def test_enqueue_batch_returns_results_in_input_order(self, storage: Storage) -> None:
        items = [new_task("batch", payload=i) for i in range(50)]
        results = storage.enqueue(items)
        assert [r.task.id for r in results] == [i.id for i in items]
        assert all(r.created for r in results)
        assert storage.stats("batch").pending == 50

    def test_enqueue_same_id_same_queue_is_a_noop_that_keeps_state(self, storage: Storage) -> None:
        item = new_task("idem", payload={"v": 1}, max_attempts=5)
        storage.enqueue([item])
        (claimed,) = storage.claim("idem", 1, 30)
        storage.settle([_retry(claimed, delay=3600)])
        before = storage.get(item.id)
        (again,) = storage.enqueue([NewTask(id=item.id, queue="idem", handler="other", payload={"v": 2})])
        assert not again.created and not again.conflict
        assert again.task.payload == {"v": 1} and again.task.handler == "noop"
        after = storage.get(item.id)
        assert _state(after) == _state(before) and after.payload == {"v": 1}

    def test_enqueue_same_id_other_queue_is_a_conflict_and_writes_nothing(self, storage: Storage) -> None:
        item = new_task("home")
        storage.enqueue([item])
        fresh = new_task("elsewhere")
        results = storage.enqueue([NewTask(id=item.id, queue="elsewhere", handler="noop"), fresh])
        assert results[0].conflict and not results[0].created and results[0].task.queue == "home"
        assert results[1].created
        assert storage.stats("elsewhere").pending == 1
        assert storage.get(item.id).queue == "home"

    def test_delayed_task_is_not_claimed_before_it_is_due(self, storage: Storage) -> None:
        storage.enqueue([new_task("delay", delay_seconds=0.6)])
        storage.enqueue([new_task("delay", run_at=datetime.now(timezone.utc) + timedelta(hours=1))])
        assert storage.claim("delay", 10, 30) == []
        claimed = wait_until(lambda: storage.claim("delay", 10, 30), timeout=10, what="the delayed task to come due")
        assert len(claimed) == 1

    # -- claim -------------------------------------------------------------------------------
    def test_claim_takes_oldest_due_first_up_to_the_limit(self, storage: Storage) -> None:
        ids = []
        for i in range(5):
            ids += enqueue_n(storage, "order", 1)
            time.sleep(0.002)
        first = storage.claim("order", 3, 30)
        assert [c.task.id for c in first] == ids[:3]
        second = storage.claim("order", 10, 30)
        assert [c.task.id for c in second] == ids[3:]
        assert storage.claim("order", 10, 30) == []

    def test_claim_stamps_lease_and_fresh_tokens(self, storage: Storage) -> None:
        enqueue_n(storage, "lease", 3)
        before = storage.now()
        claimed = storage.claim("lease", 3, 45)
        tokens = {c.claim_token for c in claimed}
        assert len(tokens) == 3 and all(tokens)
        for c in claimed:
            assert c.task.status is TaskStatus.IN_FLIGHT
            held = (c.lease_expires_at - c.claimed_at).total_seconds()
            assert 44 <= held <= 46
            assert c.claimed_at >= before - timedelta(seconds=1)
            assert storage.get(c.task.id).status is TaskStatus.IN_FLIGHT
        storage.release([claimed[0].ref])
        (again,) = storage.claim("lease", 1, 45)
        assert again.task.id == claimed[0].task.id and again.claim_token not in tokens

    def test_claim_only_touches_its_queue(self, storage: Storage) -> None:
        enqueue_n(storage, "qa", 2)
        enqueue_n(storage, "qb", 2)
        assert {c.task.queue for c in storage.claim("qa", 10, 30)} == {"qa"}
        assert storage.stats("qb").pending == 2

    def test_concurrent_claimers_never_share_a_task(self, storage: Storage, open_another) -> None:
        total, threads = 240, 8
        enqueue_n(storage, "race", total)
        stores = [open_another() for _ in range(threads)]
        seen: list[list[str]] = [[] for _ in range(threads)]
        errors: list[BaseException] = []
        start = threading.Barrier(threads)

        def claimer(index: int) -> None:
            store, rng = stores[index], random.Random(index)
            try:
                start.wait()
                idle = 0
                while idle < 3:
                    claimed = store.claim("race", rng.randint(1, 10), 30)
                    if not claimed:
                        idle += 1
                        continue
                    idle = 0
                    seen[index] += [c.task.id for c in claimed]
                    store.settle([_success(c) for c in claimed])
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        workers = [threading.Thread(target=claimer, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not errors, errors
        everything = [task_id for ids in seen for task_id in ids]
        duplicates = [task_id for task_id, n in Counter(everything).items() if n > 1]
        assert duplicates == [], f"{len(duplicates)} task(s) claimed twice"
        assert len(everything) == total
        assert storage.stats("race").succeeded == total

    # -- fencing -----------------------------------------------------------------------------
    def test_fencing_rejects_never_issued_and_stale_tokens_on_every_write(self, storage: Storage) -> None:
        enqueue_n(storage, "fence", 1)
        (first,) = storage.claim("fence", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="fence"), what="the lease to expire")
        reap_expired_leases(storage, PolicyBook(RetryPolicy(5, FAST_BACKOFF)), queue="fence")
        (second,) = wait_until(lambda: storage.claim("fence", 1, 30), what="the reaped task to come due")
        assert second.task.id == first.task.id and second.claim_token != first.claim_token
        task_id = first.task.id
        for token in (NEVER_ISSUED, first.claim_token):
            before = storage.get(task_id)
            writes = {
                "settle": lambda: storage.settle([Settlement(task_id, token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
                "retry": lambda: storage.settle([Settlement(task_id, token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=ErrorInfo("x"))]),
                "dead": lambda: storage.settle([Settlement(task_id, token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo("x"))]),
                "extend": lambda: storage.extend_leases([ClaimRef(task_id, token)], 600),
                "release": lambda: storage.release([ClaimRef(task_id, token)]),
            }
            for name, write in writes.items():
                with pytest.raises(StaleClaim) as refused:
                    write()
                assert refused.value.task_ids == (task_id,), name
                assert _state(storage.get(task_id)) == _state(before), f"{name} with a bad token changed the task"
        storage.settle([_success(second)])
        assert storage.get(task_id).status is TaskStatus.SUCCEEDED

    def test_settle_of_an_unknown_task_is_stale(self, storage: Storage) -> None:
        with pytest.raises(StaleClaim):
            storage.settle([Settlement("no-such-task", NEVER_ISSUED, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])

    def test_batch_settle_applies_valid_items_and_names_refused_ones(self, storage: Storage) -> None:
        enqueue_n(storage, "mixed", 3)
        a, b, c = storage.claim("mixed", 3, 30)
        with pytest.raises(StaleClaim) as refused:
            storage.settle([_success(a), Settlement(b.task.id, NEVER_ISSUED, Outcome.SUCCESS, TaskStatus.SUCCEEDED), _success(c)])
        assert refused.value.task_ids == (b.task.id,)
        assert storage.get(a.task.id).status is TaskStatus.SUCCEEDED
        assert storage.get(b.task.id).status is TaskStatus.IN_FLIGHT
        assert storage.get(c.task.id).status is TaskStatus.SUCCEEDED

    def test_a_settled_claim_cannot_be_settled_again(self, storage: Storage) -> None:
        enqueue_n(storage, "twice", 1)
        (claimed,) = storage.claim("twice", 1, 30)
        storage.settle([_success(claimed, {"n": 1})])
        with pytest.raises(StaleClaim):
            storage.settle([_success(claimed, {"n": 2})])
        task = storage.get(claimed.task.id)
        assert task.result == {"n": 1} and [a.attempt_no for a in task.attempts] == [1]

    # -- settlement --------------------------------------------------------------------------
    def test_success_records_one_attempt_and_the_result(self, storage: Storage) -> None:
        enqueue_n(storage, "ok", 1)
        (claimed,) = storage.claim("ok", 1, 30)
        storage.settle([_success(claimed, {"sent": True, "id": [1, 2]})])
        task = storage.get(claimed.task.id)
        assert task.status is TaskStatus.SUCCEEDED and task.result == {"sent": True, "id": [1, 2]}
        assert task.attempt_count == 1 and task.lease_expires_at is None
        (attempt,) = task.attempts
        assert (attempt.attempt_no, attempt.outcome, attempt.error) == (1, Outcome.SUCCESS, None)
        assert attempt.started_at is not None and attempt.finished_at >= attempt.started_at

    def test_retry_reschedules_after_the_delay_and_keeps_the_error(self, storage: Storage) -> None:
        enqueue_n(storage, "retry", 1)
        (claimed,) = storage.claim("retry", 1, 30)
        storage.settle([_retry(claimed, delay=0.5)])
        task = storage.get(claimed.task.id)
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1
        assert task.last_error == ErrorInfo("test.Retry", "try again")
        assert task.attempts[0].outcome is Outcome.RETRYABLE_FAILURE and task.attempts[0].error.type == "test.Retry"
        assert storage.claim("retry", 1, 30) == []
        (again,) = wait_until(lambda: storage.claim("retry", 1, 30), what="the retry to come due")
        storage.settle([Settlement(again.task.id, again.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("test.Fatal", "no"))])
        task = storage.get(claimed.task.id)
        assert task.status is TaskStatus.DEAD and task.dead_at is not None and task.attempt_count == 2
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.PERMANENT_FAILURE)]

    def test_release_returns_to_pending_without_spending_an_attempt(self, storage: Storage) -> None:
        enqueue_n(storage, "release", 2)
        claimed = storage.claim("release", 2, 30)
        storage.release([c.ref for c in claimed])
        for c in claimed:
            task = storage.get(c.task.id)
            assert (task.status, task.attempt_count, task.attempts, task.lease_expires_at) == (TaskStatus.PENDING, 0, (), None)
        assert {c.task.id for c in storage.claim("release", 5, 30)} == {c.task.id for c in claimed}

    def test_extend_lease_keeps_the_task_from_the_reaper(self, storage: Storage) -> None:
        enqueue_n(storage, "extend", 1)
        (claimed,) = storage.claim("extend", 1, self.short_lease)
        new_expiry = storage.extend_leases([claimed.ref], 30)[claimed.task.id]
        assert (new_expiry - storage.now()).total_seconds() > 25
        time.sleep(self.short_lease + 0.2)  # the original lease would be over by now
        assert storage.find_expired_leases(10, queue="extend") == []
        assert reap_expired_leases(storage, queue="extend").expired == 0
        storage.settle([_success(claimed)])

    def test_lease_expired_settle_is_refused_while_the_lease_is_live(self, storage: Storage) -> None:
        enqueue_n(storage, "live", 1)
        (claimed,) = storage.claim("live", 1, 30)
        with pytest.raises(StaleClaim):
            storage.settle([Settlement(claimed.task.id, claimed.claim_token, Outcome.LEASE_EXPIRED, TaskStatus.PENDING,
                                       error=ErrorInfo("rdq.LeaseExpired"))])
        task = storage.get(claimed.task.id)
        assert task.status is TaskStatus.IN_FLIGHT and task.attempts == ()

    # -- lease expiry and the reaper ---------------------------------------------------------
    def test_lease_expiry_becomes_one_attempt_then_backoff_then_dead(self, storage: Storage) -> None:
        policies = PolicyBook(RetryPolicy(max_attempts=2, backoff=Backoff(0.4, 2.0, 5.0, 0.0)))
        (task_id,) = enqueue_n(storage, "reap", 1)
        storage.claim("reap", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="reap"), what="the lease to expire")
        report = reap_expired_leases(storage, policies, queue="reap")
        assert (report.expired, report.rescheduled, report.dead_lettered) == (1, 1, 0)
        assert reap_expired_leases(storage, policies, queue="reap").expired == 0
        task = storage.get(task_id)
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED)]
        assert task.attempts[0].error.type == "rdq.LeaseExpired"
        assert (task.next_attempt_at - task.attempts[0].finished_at).total_seconds() >= 0.35  # backoff, not a hand-off
        assert storage.claim("reap", 1, self.short_lease) == []
        wait_until(lambda: storage.claim("reap", 1, self.short_lease), what="the backoff to pass")
        wait_until(lambda: storage.find_expired_leases(10, queue="reap"), what="the second lease to expire")
        assert reap_expired_leases(storage, policies, queue="reap").dead_lettered == 1
        task = storage.get(task_id)
        assert task.status is TaskStatus.DEAD and task.attempt_count == 2
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED), (2, Outcome.LEASE_EXPIRED)]

    def test_racing_reapers_record_exactly_one_lease_expired_attempt(self, storage: Storage, open_another) -> None:
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
            task = storage.get(task_id)
            assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED)]

    def test_find_expired_leases_is_bounded_and_read_only(self, storage: Storage) -> None:
        enqueue_n(storage, "bounded", 12)
        storage.claim("bounded", 12, self.short_lease)
        wait_until(lambda: len(storage.find_expired_leases(100, queue="bounded")) == 12, what="leases to expire")
        assert len(storage.find_expired_leases(5, queue="bounded")) == 5
        assert storage.stats("bounded").in_flight == 12
        expired = storage.find_expired_leases(5)
        assert all(e.task.status is TaskStatus.IN_FLIGHT and e.claim_token for e in expired)

    def test_redrive_then_lease_expiry_numbers_the_attempt_after_all_history(self, storage: Storage) -> None:
        """The seed bug: a LEASE_EXPIRED number derived from the reset budget collided with history."""
        policies = PolicyBook(RetryPolicy(max_attempts=2, backoff=Backoff(0.01, 1, 0.01, 0)))
        (task_id,) = enqueue_n(storage, "seed", 1)
        for _ in range(2):
            (claimed,) = wait_until(lambda: storage.claim("seed", 1, 30), what="the task to come due")
            storage.settle([policies.settle_failure(claimed.task, claimed.claim_token, Outcome.RETRYABLE_FAILURE,
                                                    ErrorInfo("test.Flaky", "flaky"))])
        assert storage.get(task_id).status is TaskStatus.DEAD
        assert storage.redrive("seed", DeadFilter(ids=(task_id,))) == 1
        task = storage.get(task_id)
        assert (task.status, task.attempt_count, task.redrive_count, len(task.attempts)) == (TaskStatus.PENDING, 0, 1, 2)
        storage.claim("seed", 1, self.short_lease)
        wait_until(lambda: storage.find_expired_leases(10, queue="seed"), what="the redriven task's lease to expire")
        assert reap_expired_leases(storage, policies, queue="seed").expired == 1
        task = storage.get(task_id)
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.RETRYABLE_FAILURE), (3, Outcome.LEASE_EXPIRED)]
        assert task.status is TaskStatus.PENDING and task.attempt_count == 1
        (claimed,) = wait_until(lambda: storage.claim("seed", 1, 30), what="the retry to come due")
        storage.settle([_success(claimed)])
        assert [a.attempt_no for a in storage.get(task_id).attempts] == [1, 2, 3, 4]

    # -- DLQ ---------------------------------------------------------------------------------
    def test_dlq_paging_is_stable_while_tasks_die_concurrently(self, storage: Storage, open_another) -> None:
        initial = dead_letter(storage, "dlq", 60)
        other = open_another()
        stop = threading.Event()

        def keep_dead_lettering() -> None:
            for _ in range(20):  # bounded, so the pager can catch up and finish
                if stop.is_set():
                    return
                dead_letter(other, "dlq", 3)

        producer = threading.Thread(target=keep_dead_lettering)
        producer.start()
        try:
            seen: list[str] = []
            cursor = None
            while True:
                page = storage.list_dead("dlq", limit=7, cursor=cursor)
                assert len(page.tasks) <= 7
                seen += [t.id for t in page.tasks]
                assert all(t.status is TaskStatus.DEAD and t.attempts for t in page.tasks)
                cursor = page.next_cursor
                if cursor is None:
                    break
                time.sleep(0.005)
        finally:
            stop.set()
            producer.join(60)
        duplicates = [i for i, n in Counter(seen).items() if n > 1]
        assert duplicates == []
        assert set(initial) <= set(seen), f"{len(set(initial) - set(seen))} dead task(s) skipped"

    def test_dlq_filters_and_rejects_foreign_or_forged_cursors(self, storage: Storage) -> None:
        a = dead_letter(storage, "filters", 3, handler="resize", error_type="img.Corrupt")
        b = dead_letter(storage, "filters", 2, handler="email", error_type="smtp.Refused")
        page = storage.list_dead("filters", limit=50, filter=DeadFilter(error_type="img.Corrupt"))
        assert {t.id for t in page.tasks} == set(a) and page.next_cursor is None
        page = storage.list_dead("filters", limit=50, filter=DeadFilter(handler="email"))
        assert {t.id for t in page.tasks} == set(b)
        page = storage.list_dead("filters", limit=1)
        assert page.next_cursor
        assert storage.list_dead("other", limit=10).tasks == ()
        for bad in (page.next_cursor + "x", "not-a-cursor", "eyJxIjoiZmlsdGVycyJ9"):
            with pytest.raises(InvalidCursor):
                storage.list_dead("filters", limit=5, cursor=bad)
        with pytest.raises(InvalidCursor):
            storage.list_dead("other", limit=5, cursor=page.next_cursor)

    def test_redrive_by_ids_and_by_filter_keeps_history(self, storage: Storage) -> None:
        a = dead_letter(storage, "redrive", 2, error_type="e.A")
        b = dead_letter(storage, "redrive", 3, error_type="e.B")
        assert storage.redrive("redrive", DeadFilter(ids=(a[0],))) == 1
        assert storage.redrive("redrive", DeadFilter(ids=(a[0],))) == 0  # no longer dead
        assert storage.redrive("redrive", DeadFilter(error_type="e.B")) == 3
        for task_id in [a[0], *b]:
            task = storage.get(task_id)
            assert (task.status, task.attempt_count, task.redrive_count) == (TaskStatus.PENDING, 0, 1)
            assert task.dead_at is None and len(task.attempts) == 1
        assert storage.stats("redrive").dead == 1
        assert storage.redrive("redrive", DeadFilter()) == 1
        assert len(storage.claim("redrive", 10, 30)) == 5

    def test_purge_dead_by_ids_and_by_filter_deletes_history(self, storage: Storage) -> None:
        a = dead_letter(storage, "purge", 2, handler="h1")
        b = dead_letter(storage, "purge", 2, handler="h2")
        keep = enqueue_n(storage, "purge", 1)
        assert storage.purge_dead("purge", DeadFilter(ids=(a[0], keep[0]))) == 1
        assert storage.get(a[0]) is None
        assert storage.purge_dead("purge", DeadFilter(handler="h2")) == 2
        assert all(storage.get(i) is None for i in b)
        assert storage.purge_dead("purge", DeadFilter()) == 1
        assert storage.get(keep[0]).status is TaskStatus.PENDING
        assert storage.stats("purge").dead == 0

    # -- stats, retention, cancel ------------------------------------------------------------
    def test_stats_count_each_status_and_the_oldest_due_age(self, storage: Storage) -> None:
        assert storage.stats("stats").pending == 0 and storage.stats("stats").oldest_pending_age_seconds == 0
        enqueue_n(storage, "stats", 6)
        enqueue_n(storage, "stats", 1, delay_seconds=3600)
        claimed = storage.claim("stats", 3, 30)
        storage.settle([_success(claimed[0])])
        dead_letter(storage, "stats-dead", 1)
        time.sleep(0.3)
        stats = storage.stats("stats")
        assert (stats.pending, stats.in_flight, stats.succeeded, stats.dead) == (4, 2, 1, 0)
        assert 0.25 <= stats.oldest_pending_age_seconds < 60
        assert storage.stats("stats-dead").dead == 1
        assert {"stats", "stats-dead"} <= set(storage.list_queues())

    def test_retention_purges_only_finished_tasks_older_than_the_cutoff(self, storage: Storage) -> None:
        enqueue_n(storage, "retention", 4)
        done = storage.claim("retention", 2, 30)
        storage.settle([_success(c) for c in done])
        time.sleep(0.5)
        fresh = storage.claim("retention", 1, 30)
        storage.settle([_success(c) for c in fresh])
        dead = dead_letter(storage, "retention-dead", 1)
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=1) == 1
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=100) == 1
        assert storage.purge_succeeded(older_than_seconds=0.4, limit=100) == 0
        assert all(storage.get(c.task.id) is None for c in done)
        assert storage.get(fresh[0].task.id).status is TaskStatus.SUCCEEDED
        assert storage.get(dead[0]).status is TaskStatus.DEAD
        assert storage.stats("retention").pending == 1

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
        assert storage.get(pending).status is TaskStatus.CANCELLED
        assert storage.get(running).status is TaskStatus.IN_FLIGHT
        assert storage.stats("cancel").cancelled == 1

    # -- the engine on this backend ----------------------------------------------------------
    def test_engine_classifies_outcomes_end_to_end(self, storage: Storage) -> None:
        from ..errors import PermanentError

        registry = HandlerRegistry()
        registry.register("ok", lambda payload, ctx: {"echo": payload, "attempt": ctx.attempt})
        registry.register("flaky", lambda payload, ctx: 1 / 0)
        registry.register("fatal", lambda payload, ctx: (_ for _ in ()).throw(PermanentError("bad input")))
        registry.register("crash", lambda payload, ctx: (_ for _ in ()).throw(SystemExit(3)))
        registry.register("weird", lambda payload, ctx: object())
        names = ["ok", "flaky", "fatal", "crash", "weird", "missing"]
        results = storage.enqueue([new_task("engine", name, {"i": name}, id=f"engine-{name}") for name in names])
        runner = BatchRunner(storage, PolicyBook(RetryPolicy(3, Backoff(60, 2, 600, 0))), registry)
        claimed = storage.claim("engine", 10, 30)
        report = runner.run(claimed)
        assert report.started == 6 and report.stale == 0
        got = {name: storage.get(r.task.id) for name, r in zip(names, results)}
        assert got["ok"].status is TaskStatus.SUCCEEDED and got["ok"].result == {"echo": {"i": "ok"}, "attempt": 1}
        assert got["flaky"].status is TaskStatus.PENDING
        assert got["flaky"].attempts[0].error.type == "ZeroDivisionError" and "1 / 0" in got["flaky"].attempts[0].error.stack
        assert got["fatal"].status is TaskStatus.DEAD and got["fatal"].attempts[0].outcome is Outcome.PERMANENT_FAILURE
        assert got["crash"].status is TaskStatus.PENDING and got["crash"].attempts[0].error.type == "SystemExit"
        assert got["weird"].status is TaskStatus.PENDING and got["weird"].attempts[0].error.type == "rdq.InvalidResult"
        assert got["missing"].status is TaskStatus.DEAD and got["missing"].last_error.type == UNKNOWN_HANDLER

    def test_engine_releases_what_it_cannot_finish_before_the_deadline(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("slow", lambda payload, ctx: time.sleep(0.05), timeout_seconds=1.0)
        enqueue_n(storage, "deadline", 5, handler="slow")
        runner = BatchRunner(storage, registry=registry, settle_margin=0.1)
        claimed = storage.claim("deadline", 5, 30)
        report = runner.run(claimed, deadline=time.monotonic() + 1.15)
        assert (report.started, report.released) == (1, 4)
        stats = storage.stats("deadline")
        assert (stats.succeeded, stats.pending, stats.in_flight) == (1, 4, 0)
        for c in claimed[1:]:
            assert storage.get(c.task.id).attempt_count == 0

    def test_engine_skips_only_the_tasks_that_do_not_fit_the_deadline(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("long", lambda payload, ctx: None, timeout_seconds=60)
        registry.register("quick", lambda payload, ctx: None, timeout_seconds=0.5)
        long_id = enqueue_n(storage, "fit", 1, handler="long")[0]
        time.sleep(0.002)
        quick_ids = enqueue_n(storage, "fit", 3, handler="quick")
        runner = BatchRunner(storage, registry=registry, settle_margin=0.1)
        report = runner.run(storage.claim("fit", 10, 30), deadline=time.monotonic() + 5)
        assert (report.started, report.released) == (3, 1)
        assert storage.get(long_id).status is TaskStatus.PENDING and storage.get(long_id).attempt_count == 0
        assert all(storage.get(i).status is TaskStatus.SUCCEEDED for i in quick_ids)

    # -- storage-level regressions (one rule) ------------------------------------------------
    def test_extend_never_moves_a_lease_earlier(self, storage: Storage) -> None:
        """A heartbeat asking for less than the lease has left must not shorten it (the reaper
        would take a task its worker still holds); the reported expiry is the stored one."""
        enqueue_n(storage, "extend-max", 1)
        (claimed,) = storage.claim("extend-max", 1, 30)
        task_id, original = claimed.task.id, claimed.lease_expires_at
        short = storage.extend_leases([claimed.ref], 1)[task_id]
        assert short >= original
        assert storage.get(task_id).lease_expires_at == short
        time.sleep(0.05)
        longer = storage.extend_leases([claimed.ref], 60)[task_id]
        assert (longer - original).total_seconds() > 25
        assert storage.get(task_id).lease_expires_at == longer
        assert storage.extend_leases([claimed.ref], 1)[task_id] == longer
        storage.settle([_success(claimed)])

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
            _success(first, {"file": name, name: [name]}),
            Settlement(failing.task.id, failing.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                       retry_delay_seconds=60, error=error),
            _success(last, name),
        ])
        assert storage.get(first.task.id).result == {"file": stored, stored: [stored]}
        assert storage.get(last.task.id).result == stored
        failed = storage.get(failing.task.id)
        assert failed.status is TaskStatus.PENDING and failed.attempt_count == 1
        for recorded in (failed.last_error, failed.attempts[0].error):
            assert recorded.type == f"io.{stored}"
            assert recorded.message == f"cannot open {stored}"
            assert recorded.stack == f"Traceback\n  open('{stored}')"

    def test_history_stays_gap_free_through_retry_reap_dead_and_redrive(self, storage: Storage) -> None:
        """Every settle, by a worker or a reaper, before and after a redrive, adds exactly the
        next attempt number: the history reads 1..n whatever path each attempt took."""
        policies = PolicyBook(RetryPolicy(max_attempts=3, backoff=Backoff(0.01, 1, 0.01, 0)))
        (task_id,) = enqueue_n(storage, "history", 1)
        expected: list[Outcome] = []

        def claim(lease: float):
            (claimed,) = wait_until(lambda: storage.claim("history", 1, lease), what="the task to come due")
            return claimed

        def fail(claimed) -> None:
            storage.settle([policies.settle_failure(claimed.task, claimed.claim_token, Outcome.RETRYABLE_FAILURE,
                                                    ErrorInfo("test.Flaky", "flaky"))])
            expected.append(Outcome.RETRYABLE_FAILURE)

        def reap() -> None:
            claim(self.short_lease)
            wait_until(lambda: storage.find_expired_leases(10, queue="history"), what="the lease to expire")
            assert reap_expired_leases(storage, policies, queue="history").expired == 1
            expected.append(Outcome.LEASE_EXPIRED)

        def history() -> list[tuple[int, Outcome]]:
            return [(a.attempt_no, a.outcome) for a in storage.get(task_id).attempts]

        fail(claim(30))
        reap()
        fail(claim(30))  # the third attempt spends the budget
        task = storage.get(task_id)
        assert task.status is TaskStatus.DEAD and task.attempt_count == 3
        assert history() == list(enumerate(expected, start=1))
        (dead,) = storage.list_dead("history", limit=10).tasks
        assert [(a.attempt_no, a.outcome) for a in dead.attempts] == list(enumerate(expected, start=1))
        assert storage.redrive("history", DeadFilter(ids=(task_id,))) == 1
        assert history() == list(enumerate(expected, start=1))
        reap()
        fail(claim(30))
        storage.settle([_success(claim(30))])
        expected.append(Outcome.SUCCESS)
        task = storage.get(task_id)
        assert (task.status, task.attempt_count, task.redrive_count) == (TaskStatus.SUCCEEDED, 3, 1)
        assert history() == list(enumerate(expected, start=1))
        assert [a.attempt_no for a in task.attempts] == list(range(1, 7))

    # -- chaos -------------------------------------------------------------------------------
    @pytest.mark.chaos
    def test_chaos_kill_9_workers_mid_task(self, storage: Storage, storage_url: str, tmp_path) -> None:
        from .chaos import run_chaos

        figures = run_chaos(
            storage, storage_url, tmp_path,
            workers=self.chaos_workers, tasks=self.chaos_tasks, kills=self.chaos_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nchaos: {figures}")

    #: Runner-path chaos size: ``chaos_workers`` long-running workers, killed inside claim and
    #: settle calls, with outcomes in the settle buffer, inside the heartbeat and at random.
    #: The task counts are the first batch; the queue is topped up (to 3x at most) until the
    #: last kill, so it never drains early on a fast store nor runs long on a slow one.
    chaos_runner_tasks = 120
    chaos_runner_kills = 12
    #: Lambda chaos size: warm containers running invocations, killed at markers and deadlines.
    chaos_lambda_containers = 4
    chaos_lambda_tasks = 100
    chaos_lambda_kills = 10

    @pytest.mark.chaos
    def test_chaos_kill_9_workers_on_runner_paths(self, storage: Storage, storage_url: str, tmp_path) -> None:
        """``rdq worker`` processes killed inside claim and settle calls (before and after the
        store committed), with finished outcomes in the settle buffer, inside the heartbeat's
        extend, inside handlers and at random; then every claim, execution and kill is held
        against the store (``chaos_history``)."""
        from .chaos import run_runner_chaos

        figures = run_runner_chaos(
            storage, storage_url, tmp_path,
            workers=self.chaos_workers, tasks=self.chaos_runner_tasks, kills=self.chaos_runner_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nrunner chaos: {figures}")

    @pytest.mark.chaos
    def test_chaos_kill_9_lambda_invocations_at_markers_and_deadlines(
        self, storage: Storage, storage_url: str, tmp_path
    ) -> None:
        """Warm Lambda worker containers running ``run_worker_invocation`` back to back, killed
        at journal markers and exactly at an invocation's deadline (Lambda's timeout, also
        under a handler that overruns it); then the same history audit."""
        from .chaos import run_lambda_chaos

        figures = run_lambda_chaos(
            storage, storage_url, tmp_path,
            containers=self.chaos_lambda_containers, tasks=self.chaos_lambda_tasks, kills=self.chaos_lambda_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nlambda chaos: {figures}")
