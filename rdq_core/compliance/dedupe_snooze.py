"""Snooze and per-queue retry_on / dead_on on this backend.

* a SNOOZED settlement is fenced like any other, puts the task back to PENDING at the store's
  now + delay, records one SNOOZED attempt numbered from history and leaves ``attempt_count``
  (the retry budget) as it was;
* end to end: a handler that raises or returns ``Snooze`` runs again without spending its
  budget (a task with ``max_attempts=1`` snoozes twice and still succeeds), and a queue's
  ``dead_on`` / ``retry_on`` decide which raised exceptions dead-letter at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import pytest

from ..errors import InvalidInput, StaleClaim
from ..handlers import HandlerRegistry, Snooze, TaskContext
from ..model import Outcome, Settlement, TaskStatus
from ..retry import policy_book_from_config
from ..runner import BatchRunner
from ..storage.spi import Storage
from .support import FAST_BACKOFF, NEVER_ISSUED, due_at, must_get, new_task, retry, state, success, wait_until


def snooze(claimed_task_id: str, token: str, seconds: float) -> Settlement:
    return Settlement(claimed_task_id, token, Outcome.SNOOZED, TaskStatus.PENDING, retry_delay_seconds=seconds)


class DedupeSnoozeCompliance:
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
