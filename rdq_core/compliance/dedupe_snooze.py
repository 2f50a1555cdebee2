"""Enqueue-time dedupe, snooze and per-queue retry_on / dead_on on this backend.

* an enqueue whose ``dedupe_key`` matches a task of the same queue (status in ``dedupe_states``,
  default PENDING and IN_FLIGHT, or created within ``dedupe_for_seconds``) inserts nothing and
  returns that task with ``deduplicated``; ``replace`` and ``debounce`` change a PENDING match;
  enqueues racing on one key from many connections create exactly one task;

* a SNOOZED settlement is fenced like any other, puts the task back to PENDING at the store's
  now + delay, records one SNOOZED attempt numbered from history and leaves ``attempt_count``
  (the retry budget) as it was;
* end to end: a handler that raises or returns ``Snooze`` runs again without spending its
  budget (a task with ``max_attempts=1`` snoozes twice and still succeeds), and a queue's
  ``dead_on`` / ``retry_on`` decide which raised exceptions dead-letter at once.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable

import pytest

from ..errors import InvalidInput, StaleClaim
from ..engine.handlers import HandlerRegistry, Snooze, TaskContext
from ..model import NewTask
from ..ids import new_task_id
from ..model import DedupeMode, EnqueueResult, Outcome, Settlement, TaskStatus
from ..engine.retry import policy_book_from_config
from ..engine.runner import BatchRunner
from ..storage import open_storage
from ..storage.spi import Storage
from .support import (
    FAST_BACKOFF, NEVER_ISSUED, OpenStore, due_at, must_get, new_task, present, race_processes, retry, state, success,
    wait_until,
)


def snooze(claimed_task_id: str, token: str, seconds: float) -> Settlement:
    return Settlement(claimed_task_id, token, Outcome.SNOOZED, TaskStatus.PENDING, retry_delay_seconds=seconds)


def keyed(queue: str, key: str, payload: object = None, **fields: object) -> NewTask:
    return replace(new_task(queue, payload=payload), dedupe_key=key, **fields)  # type: ignore[arg-type]


def enqueue_at_barrier(storage_url: str, barrier: Any, queue: str, key: str, answers: Any) -> None:
    """In a process of its own: open the store, wait for the others, enqueue one keyed task and
    put ``(created, deduplicated, task id)`` (or the error's text) on ``answers``."""
    try:
        store = open_storage(storage_url)
        try:
            request = keyed(queue, key)
            barrier.wait(30)
            result = store.enqueue([request])[0]
            answers.put((result.created, result.deduplicated, result.task.id))
        finally:
            store.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        answers.put(f"{type(exc).__name__}: {exc}")


def race_enqueues(stores: list[Storage], request: NewTask) -> list[EnqueueResult]:
    """Each store enqueues ``request`` under a fresh id, all released at once by a barrier."""
    barrier = threading.Barrier(len(stores))
    results: list[EnqueueResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def enqueue(store: Storage) -> None:
        try:
            barrier.wait(10)
            result = store.enqueue([replace(request, id=new_task_id())])[0]
            with lock:
                results.append(result)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=enqueue, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


class DedupeSnoozeCompliance:
    # -- dedupe ---------------------------------------------------------------------------
    def test_an_enqueue_matching_an_active_task_by_dedupe_key_returns_it_and_inserts_nothing(
            self, storage: Storage) -> None:
        first = storage.enqueue([keyed("dd", "order-1", {"v": 1})])[0]
        assert first.created and not first.deduplicated and first.task.dedupe_key == "order-1"
        again = storage.enqueue([keyed("dd", "order-1", {"v": 2})])[0]
        assert (again.created, again.deduplicated, again.conflict) == (False, True, False)
        assert again.task.id == first.task.id and again.task.payload == {"v": 1}, "skip: nothing changes"
        other_key, other_queue = storage.enqueue([keyed("dd", "order-2"), keyed("dd-other", "order-1")])
        assert other_key.created and other_queue.created, "a key is per queue"
        assert storage.stats("dd").pending == 2
        # An idempotent repeat of an id is that, not a dedupe.
        repeat = storage.enqueue([replace(keyed("dd", "order-1"), id=first.task.id)])[0]
        assert (repeat.created, repeat.deduplicated) == (False, False)
        # In flight still matches by default; once finished, it no longer does.
        claimed = storage.claim("dd", 10, 30)
        assert storage.enqueue([keyed("dd", "order-1")])[0].deduplicated
        storage.settle([success(c) for c in claimed])
        fresh = storage.enqueue([keyed("dd", "order-1")])[0]
        assert fresh.created and fresh.task.id != first.task.id

    def test_dedupe_states_and_window_choose_what_matches(self, storage: Storage) -> None:
        done = storage.enqueue([keyed("dd-states", "k")])[0].task
        storage.settle([success(c) for c in storage.claim("dd-states", 1, 30)])
        recent = storage.enqueue([keyed("dd-states", "k", dedupe_for_seconds=3600.0)])[0]
        assert recent.deduplicated and recent.task.id == done.id and recent.task.status is TaskStatus.SUCCEEDED
        by_state = storage.enqueue([keyed("dd-states", "k", dedupe_states=(TaskStatus.SUCCEEDED,))])[0]
        assert by_state.deduplicated and by_state.task.id == done.id
        outside = storage.enqueue([keyed("dd-states", "k", dedupe_for_seconds=0.0)])[0]
        assert outside.created, "a finished task created before the window does not match"
        # Now one PENDING (outside) and one SUCCEEDED (done): the newest matching one is returned.
        only_done = storage.enqueue([keyed("dd-states", "k", dedupe_states=(TaskStatus.SUCCEEDED, TaskStatus.DEAD))])
        assert only_done[0].deduplicated and only_done[0].task.id == done.id
        newest = storage.enqueue([keyed("dd-states", "k", dedupe_for_seconds=3600.0)])[0]
        assert newest.deduplicated and newest.task.id == outside.task.id

    def test_replace_stores_the_new_payload_and_headers_on_a_pending_match_only(self, storage: Storage) -> None:
        first = storage.enqueue([keyed("dd-replace", "k", {"v": 1}, headers={"old": "1"})])[0].task
        replaced = storage.enqueue([keyed("dd-replace", "k", {"v": 2}, headers={"new": "2"},
                                          dedupe_mode=DedupeMode.REPLACE)])[0]
        assert replaced.deduplicated and replaced.task.id == first.id and replaced.task.payload == {"v": 2}
        stored = must_get(storage, first.id)
        assert (stored.payload, dict(stored.headers)) == ({"v": 2}, {"new": "2"}), "a payload-store reference is a header"
        storage.claim("dd-replace", 1, 30)
        held = storage.enqueue([keyed("dd-replace", "k", {"v": 3}, dedupe_mode=DedupeMode.REPLACE)])[0]
        assert held.deduplicated and must_get(storage, first.id).payload == {"v": 2}, "in flight: not replaced"

    def test_debounce_pushes_the_run_time_but_never_past_the_max_wait(self, storage: Storage) -> None:
        start = storage.now()
        first = storage.enqueue([keyed("dd-debounce", "k", delay_seconds=10.0)])[0].task
        pushed = storage.enqueue([keyed("dd-debounce", "k", delay_seconds=60.0, dedupe_mode=DedupeMode.DEBOUNCE)])[0]
        assert pushed.deduplicated and pushed.task.id == first.id
        assert start + timedelta(seconds=59) <= due_at(storage, first.id) <= storage.now() + timedelta(seconds=61)
        capped = storage.enqueue([keyed("dd-debounce", "k", delay_seconds=3600.0, dedupe_mode=DedupeMode.DEBOUNCE,
                                        dedupe_max_wait_seconds=120.0)])[0]
        assert capped.deduplicated
        created = must_get(storage, first.id).created_at
        assert created is not None and due_at(storage, first.id) == created + timedelta(seconds=120)
        assert storage.stats("dd-debounce").pending == 1

    def test_a_window_match_ends_when_the_window_does_by_the_store_clock(self, storage: Storage) -> None:
        done = storage.enqueue([keyed("dd-window", "k")])[0].task
        storage.settle([success(c) for c in storage.claim("dd-window", 1, 30)])
        window = 0.5
        inside = storage.enqueue([keyed("dd-window", "k", dedupe_for_seconds=window)])[0]
        assert inside.deduplicated and inside.task.id == done.id
        created = present(must_get(storage, done.id).created_at, "created_at")
        wait_until(lambda: storage.now() > created + timedelta(seconds=window + 0.01), timeout=5,
                   what="the dedupe window to pass on the store clock")
        after = storage.enqueue([keyed("dd-window", "k", dedupe_for_seconds=window)])[0]
        assert after.created and after.task.id != done.id

    def test_concurrent_enqueues_from_processes_create_exactly_one_task(self, storage: Storage, storage_url: str) -> None:
        workers = 3  # spawned interpreters import the whole engine: few, so the test stays short
        outcomes = race_processes(enqueue_at_barrier, workers, timeout=60, args=lambda barrier, answers: (
            storage_url, barrier, "dd-procs", "one", answers))
        assert all(isinstance(o, tuple) for o in outcomes), outcomes
        created = [task_id for was_created, _, task_id in outcomes if was_created]
        assert len(created) == 1, outcomes
        assert all(deduplicated and task_id == created[0] for was_created, deduplicated, task_id in outcomes
                   if not was_created), outcomes
        assert storage.stats("dd-procs").pending == 1

    def test_concurrent_enqueues_of_one_key_create_exactly_one_task(self, storage: Storage, open_another: OpenStore) -> None:
        stores = [open_another() for _ in range(8)]
        for round_no in range(4):
            results = race_enqueues(stores, keyed("dd-race", f"race-{round_no}"))
            created = [r for r in results if r.created]
            assert len(results) == len(stores) and len(created) == 1, results
            assert all(r.deduplicated and r.task.id == created[0].task.id for r in results if not r.created), results
        assert storage.stats("dd-race").pending == 4

    # -- snooze: the store ------------------------------------------------------------------
    def test_a_snooze_returns_the_task_to_pending_without_spending_its_budget(self, storage: Storage) -> None:
        storage.enqueue([new_task("snooze", id="snooze-1", max_attempts=2)])
        first = storage.claim("snooze", 1, 30)[0]
        storage.settle([snooze(first.task.id, first.claim_token, 0.0)])
        task = must_get(storage, "snooze-1")
        assert (task.status, task.attempt_count, task.last_error) == (TaskStatus.PENDING, 0, None)
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.SNOOZED)]
        assert task.attempts[0].started_at == first.claimed_at and task.attempts[0].error is None
        # Numbering continues from history: the next attempt is 2, and it spends budget 1 of 2.
        second = storage.claim("snooze", 1, 30)[0]
        storage.settle([retry(second)])
        third = wait_until(lambda: storage.claim("snooze", 1, 30), what="the retried task to be due")[0]
        storage.settle([snooze(third.task.id, third.claim_token, 0.0)])
        fourth = storage.claim("snooze", 1, 30)[0]
        assert fourth.task.attempt_count == 1, "two snoozes and one failure spent one attempt"
        storage.settle([success(fourth)])
        task = must_get(storage, "snooze-1")
        assert task.status is TaskStatus.SUCCEEDED and task.attempt_count == 2
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.SNOOZED), (2, Outcome.RETRYABLE_FAILURE), (3, Outcome.SNOOZED), (4, Outcome.SUCCESS)]

    def test_a_snoozed_task_is_due_only_after_its_delay_by_the_store_clock(self, storage: Storage) -> None:
        storage.enqueue([new_task("snooze-later", id="later-1")])
        claimed = storage.claim("snooze-later", 1, 30)[0]
        before = storage.now()
        storage.settle([snooze(claimed.task.id, claimed.claim_token, 3600.0)])
        after = storage.now()
        due = due_at(storage, "later-1")
        assert before + timedelta(seconds=3599) <= due <= after + timedelta(seconds=3601)
        assert storage.claim("snooze-later", 1, 30) == [], "snoozed for an hour: not due"
        assert storage.stats("snooze-later").pending == 1

    def test_a_snooze_is_fenced_like_any_settlement(self, storage: Storage) -> None:
        storage.enqueue([new_task("snooze-fence", id="fence-1")])
        claimed = storage.claim("snooze-fence", 1, 30)[0]
        before = state(must_get(storage, "fence-1"))
        with pytest.raises(StaleClaim):
            storage.settle([snooze("fence-1", NEVER_ISSUED, 0.0)])
        assert state(must_get(storage, "fence-1")) == before
        storage.settle([snooze("fence-1", claimed.claim_token, 0.0)])
        with pytest.raises(StaleClaim):  # the claim ended with the first snooze
            storage.settle([snooze("fence-1", claimed.claim_token, 0.0)])
        assert len(must_get(storage, "fence-1").attempts) == 1

    def test_a_snooze_to_anything_but_pending_is_refused_and_changes_nothing(self, storage: Storage) -> None:
        storage.enqueue([new_task("snooze-bad", id="bad-1")])
        claimed = storage.claim("snooze-bad", 1, 30)[0]
        before = state(must_get(storage, "bad-1"))
        for status in (TaskStatus.DEAD, TaskStatus.SUCCEEDED):
            with pytest.raises(InvalidInput):
                storage.settle([Settlement("bad-1", claimed.claim_token, Outcome.SNOOZED, status)])
        assert state(must_get(storage, "bad-1")) == before

    # -- snooze, retry_on, dead_on: the engine ------------------------------------------------
    def test_handlers_snooze_by_raising_or_returning_without_spending_retries(self, storage: Storage) -> None:
        runs: dict[str, int] = {}

        def snoozing(payload: object, ctx: TaskContext) -> object:
            runs[ctx.task_id] = runs.get(ctx.task_id, 0) + 1
            if runs[ctx.task_id] == 1:
                raise Snooze(0)
            if runs[ctx.task_id] == 2:
                return Snooze(0.0)
            return {"runs": runs[ctx.task_id], "attempt": ctx.attempt}

        registry = HandlerRegistry()
        registry.register("snoozing", snoozing)
        storage.enqueue([new_task("snooze-engine", "snoozing", id="engine-1", max_attempts=1)])
        runner = BatchRunner(storage, policy_book_from_config(None), registry)
        for _ in range(3):
            runner.run(wait_until(lambda: storage.claim("snooze-engine", 1, 30), what="the snoozed task"))
        task = must_get(storage, "engine-1")
        assert task.status is TaskStatus.SUCCEEDED, task.last_error
        assert task.result == {"runs": 3, "attempt": 1}, "a snooze does not advance the budgeted attempt"
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
            (1, Outcome.SNOOZED), (2, Outcome.SNOOZED), (3, Outcome.SUCCESS)]
        assert task.attempt_count == 1

    def test_an_invalid_snooze_is_an_ordinary_failed_attempt(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("bad-snooze", lambda payload, ctx: (_ for _ in ()).throw(Snooze(-1)))
        storage.enqueue([new_task("snooze-invalid", "bad-snooze", id="invalid-1", max_attempts=3)])
        BatchRunner(storage, policy_book_from_config(None), registry).run(storage.claim("snooze-invalid", 1, 30))
        task = must_get(storage, "invalid-1")
        assert (task.status, task.attempt_count) == (TaskStatus.PENDING, 1)
        error = task.attempts[0].error
        assert task.attempts[0].outcome is Outcome.RETRYABLE_FAILURE and error is not None
        assert error.type == "ValueError" and "Snooze seconds" in error.message

    def test_a_queue_policy_dead_letters_what_dead_on_names_and_what_retry_on_does_not(self, storage: Storage) -> None:
        class Throttled(Exception):
            pass

        class BadRecord(LookupError):
            pass

        raised: dict[str, type[Exception]] = {
            "throttled": Throttled, "bad-record": BadRecord, "timeout": TimeoutError, "zero": ZeroDivisionError}

        def raising(kind: type[Exception]) -> Callable[[object, TaskContext], object]:
            def handle(payload: object, ctx: TaskContext) -> object:
                raise kind("failed")
            return handle

        registry = HandlerRegistry()
        for name, kind in raised.items():
            registry.register(name, raising(kind))
        policies = policy_book_from_config({
            # dead_on by a base type's bare name; retry_on by bare and module-qualified names.
            "strict": {"max_attempts": 5, "dead_on": ["LookupError"],
                       "retry_on": ["TimeoutError", f"{Throttled.__module__}.{Throttled.__qualname__}", "BadRecord"]},
            "lenient": {"max_attempts": 5, "dead_on": ["ZeroDivisionError"]},
        })
        tasks = [new_task(queue, name, id=f"{queue}-{name}", backoff=FAST_BACKOFF)
                 for queue in ("strict", "lenient") for name in raised]
        storage.enqueue(tasks)
        runner = BatchRunner(storage, policies, registry)
        for queue in ("strict", "lenient"):
            runner.run(storage.claim(queue, 10, 30))
        outcome = {t.id: (must_get(storage, t.id).status, must_get(storage, t.id).attempts[0].outcome) for t in tasks}
        retried = (TaskStatus.PENDING, Outcome.RETRYABLE_FAILURE)
        dead = (TaskStatus.DEAD, Outcome.PERMANENT_FAILURE)
        assert outcome == {
            "strict-throttled": retried,      # named in retry_on
            "strict-bad-record": dead,        # in retry_on too, but dead_on names its base: dead_on wins
            "strict-timeout": retried,
            "strict-zero": dead,              # retry_on is given and does not name it
            "lenient-throttled": retried,
            "lenient-bad-record": retried,
            "lenient-timeout": retried,
            "lenient-zero": dead,
        }
