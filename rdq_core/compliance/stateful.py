"""Model-based compliance test: random operation sequences run against the backend and against
a small reference model in plain Python, and compared after every step.

Time is the hard part of modelling a queue, so the test makes it deterministic instead of
guessing at it:

* **Due-ness.** Every delay (enqueue delay, retry delay, backoff) is either 0 or ``FAR`` (an
  hour), so a PENDING task is either claimable now or certainly not during the run.
* **Leases.** A lease is long (``LONG_LEASE``, never lapses during a run) or short
  (``short_lease/2 .. short_lease``). A short lease is *uncertain* until the clock rule has waited
  for the backend's own clock to pass it; the reaper only runs when no lease is uncertain, so
  which tasks it takes is always known.
* **Claim order among ties.** Backends stamp times at their own resolution (MongoDB: ms) and
  order ties as they like, so "oldest first" is checked against the backend's own
  ``next_attempt_at`` values, which in turn must respect the model's order of events.

Each Hypothesis example works on its own pair of fresh queues in the one migrated store and,
when it passes, deletes its tasks through the SPI on the way out (some stores count by scanning,
so leftovers would slow every later example). Hypothesis has no time limit, so the test runs it
in chunks sized from the measured cost per example until ``stateful_examples`` have run or
``stateful_budget_seconds`` is spent. ``ReferenceModel`` is plain Python and is reused by the
cross-backend differential test (``tests/backends/test_differential.py``).
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException, StopTest
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ..errors import StaleClaim, TaskConflict, TaskNotFound
from ..model import (
    Backoff,
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    ErrorInfo,
    NewTask,
    Outcome,
    Settlement,
    Task,
    TaskStatus,
)
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..engine.outcomes import LEASE_EXPIRED, failed_attempt
from ..storage import open_storage
from ..storage.spi import Storage
from .support import present, wait_until

log = logging.getLogger("rdq.compliance")

# Hypothesis leaves this entry point unannotated: a typed name for it spares the module an
# exemption from the strict check of untyped calls.
_run_state_machine: Callable[..., None] = run_state_machine_as_test

FAR = 3600.0
LONG_LEASE = 60.0
ZERO_BACKOFF = Backoff(initial_seconds=0.0, factor=2.0, max_seconds=0.0, jitter=0.0)
FAR_BACKOFF = Backoff(initial_seconds=FAR, factor=1.0, max_seconds=FAR, jitter=0.0)
HANDLERS = ("mail", "resize")
ERROR_TYPES = ("e.A", "e.B")
NEVER_ISSUED = "never-issued-token"
DLQ_PAGE = 2  # small, so paging is exercised with a handful of dead tasks

# How a test settles one held task. "policy-*" go through the engine's PolicyBook.
SETTLE_KINDS = (
    "success", "retry-now", "retry-later", "retry-dead", "permanent", "policy-retryable", "policy-permanent",
)


class Lease(enum.Enum):
    LONG = "long"      # cannot lapse during a run
    SHORT = "short"    # may or may not have lapsed yet
    LAPSED = "lapsed"  # the backend clock is certainly past it: the reaper takes the task


@dataclass
class ModelTask:
    id: str
    queue: str
    handler: str
    payload: Any
    max_attempts: int | None
    backoff: Backoff | None
    status: TaskStatus = TaskStatus.PENDING
    due: bool = True            # PENDING and claimable now
    ready_seq: int = 0          # logical time next_attempt_at was last set (claim order)
    attempt_count: int = 0
    redrive_count: int = 0
    history: list[tuple[Outcome, str | None]] = field(default_factory=list)
    result: Any = None
    last_error_type: str | None = None
    token: str | None = None
    lease: Lease | None = None
    lease_expires_at: datetime | None = None  # as last reported by the backend
    spent_tokens: list[str] = field(default_factory=list)

    def held_token(self) -> str:
        """The token this task is held with; the model sets one on every claim."""
        return present(self.token, f"a claim token on {self.id}")


class ReferenceModel:
    """What the SPI promises, for deterministic inputs (delays 0 or FAR, known lease states).

    Tokens are opaque here: the stateful test stores real ones, the differential test symbolic ones.
    """

    def __init__(self, max_attempts: int = 3, backoff: Backoff = ZERO_BACKOFF) -> None:
        self.policy = RetryPolicy(max_attempts, backoff)
        self.tasks: dict[str, ModelTask] = {}
        self.purged: dict[str, ModelTask] = {}  # kept so their spent tokens can still be probed
        self._clock = 0

    @property
    def policies(self) -> PolicyBook:
        return PolicyBook(self.policy)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- queries ---------------------------------------------------------------------------------
    def in_queue(self, queue: str, status: TaskStatus | None = None) -> list[ModelTask]:
        return [t for t in self.tasks.values() if t.queue == queue and (status is None or t.status is status)]

    def due(self, queue: str) -> list[ModelTask]:
        return [t for t in self.in_queue(queue, TaskStatus.PENDING) if t.due]

    def held(self, lease: Lease | None = None) -> list[ModelTask]:
        return [t for t in self.tasks.values()
                if t.status is TaskStatus.IN_FLIGHT and (lease is None or t.lease is lease)]

    def counts(self, queue: str) -> dict[TaskStatus, int]:
        counts = Counter(t.status for t in self.in_queue(queue))
        return {status: counts.get(status, 0) for status in TaskStatus}

    def dead_matching(self, queue: str, filter: DeadFilter) -> list[ModelTask]:
        return [
            t for t in self.in_queue(queue, TaskStatus.DEAD)
            if (filter.ids is None or t.id in filter.ids)
            and (filter.error_type is None or t.last_error_type == filter.error_type)
            and (filter.handler is None or t.handler == filter.handler)
        ]

    def failure_decision(self, task_id: str, outcome: Outcome) -> tuple[TaskStatus, float]:
        """The engine's policy, computed independently: budget spent or permanent -> DEAD."""
        task = self.tasks[task_id]
        max_attempts = task.max_attempts or self.policy.max_attempts
        backoff = task.backoff or self.policy.backoff
        if outcome is Outcome.PERMANENT_FAILURE or task.attempt_count + 1 >= max_attempts:
            return TaskStatus.DEAD, 0.0
        return TaskStatus.PENDING, backoff.initial_seconds  # ZERO/FAR backoffs: constant delay

    # -- transitions -----------------------------------------------------------------------------
    def enqueue(self, items: Sequence[NewTask]) -> list[tuple[bool, bool]]:
        """Returns the expected ``(created, conflict)`` per item."""
        expected = []
        seq = self._tick()
        for item in items:
            existing = self.tasks.get(item.id)
            if existing is not None:
                expected.append((False, existing.queue != item.queue))
                continue
            old = self.purged.pop(item.id, None)
            self.tasks[item.id] = ModelTask(
                id=item.id, queue=item.queue, handler=item.handler, payload=item.payload,
                max_attempts=item.max_attempts, backoff=item.backoff, due=item.delay_seconds == 0,
                ready_seq=seq, spent_tokens=old.spent_tokens if old else [],
            )
            expected.append((True, False))
        return expected

    def claimed(self, task_id: str, token: str, lease: Lease, expires_at: datetime | None = None) -> None:
        task = self.tasks[task_id]
        task.status, task.token, task.lease, task.lease_expires_at = TaskStatus.IN_FLIGHT, token, lease, expires_at

    def _end_claim(self, task: ModelTask) -> None:
        assert task.token is not None
        task.spent_tokens.append(task.token)
        task.token, task.lease, task.lease_expires_at = None, None, None

    def settled(self, task_id: str, outcome: Outcome, status: TaskStatus, delay: float = 0.0,
                error_type: str | None = None, result: Any = None) -> None:
        task = self.tasks[task_id]
        self._end_claim(task)
        task.history.append((outcome, error_type))
        task.attempt_count += 1
        task.status = status
        if status is TaskStatus.PENDING:
            task.due, task.ready_seq = delay == 0, self._tick()
        if status is TaskStatus.SUCCEEDED:
            task.result = result
        if error_type is not None:
            task.last_error_type = error_type

    def released(self, task_id: str) -> None:
        task = self.tasks[task_id]
        self._end_claim(task)
        task.status = TaskStatus.PENDING  # next_attempt_at unchanged: still due, same place in line

    def extended(self, task_id: str, lease: Lease, expires_at: datetime | None = None) -> None:
        task = self.tasks[task_id]
        # An extension never shortens a lease: expiry = max(current, now + seconds).
        if task.lease is not Lease.LONG:
            task.lease = lease
        task.lease_expires_at = expires_at

    def clock_passed_short_leases(self) -> None:
        for task in self.held(Lease.SHORT):
            task.lease = Lease.LAPSED

    def reap(self, queue: str) -> list[tuple[str, TaskStatus]]:
        """Every lapsed lease of ``queue`` becomes one LEASE_EXPIRED attempt, policy applied."""
        reaped = []
        for task in sorted(self.held(Lease.LAPSED), key=lambda t: t.id):
            if task.queue != queue:
                continue
            status, delay = self.failure_decision(task.id, Outcome.LEASE_EXPIRED)
            self.settled(task.id, Outcome.LEASE_EXPIRED, status, delay, LEASE_EXPIRED)
            reaped.append((task.id, status))
        return reaped

    def redrive(self, queue: str, filter: DeadFilter) -> int:
        matched = self.dead_matching(queue, filter)
        seq = self._tick()
        for task in matched:
            task.status, task.attempt_count, task.due, task.ready_seq = TaskStatus.PENDING, 0, True, seq
            task.redrive_count += 1
        return len(matched)

    def purge(self, queue: str, filter: DeadFilter) -> int:
        matched = self.dead_matching(queue, filter)
        for task in matched:
            self.purged[task.id] = self.tasks.pop(task.id)
        return len(matched)

    def cancel(self, task_id: str) -> str:
        """``cancelled``, ``conflict`` (not PENDING) or ``not-found``; applies the first."""
        task = self.tasks.get(task_id)
        if task is None:
            return "not-found"
        if task.status is not TaskStatus.PENDING:
            return "conflict"
        task.status = TaskStatus.CANCELLED
        return "cancelled"

    def finished(self) -> list[ModelTask]:
        return [t for t in self.tasks.values() if t.status in (TaskStatus.SUCCEEDED, TaskStatus.CANCELLED)]

    def retention(self, task_ids: Sequence[str]) -> None:
        for task_id in task_ids:
            self.purged[task_id] = self.tasks.pop(task_id)


@dataclass
class _Tally:
    examples: int = 0
    steps: int = 0
    runs: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    tokens: set[str] = field(default_factory=set)  # every token the store handed out, all examples


def _watched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Counts steps and remembers failures (so teardown leaves the evidence in place)."""

    @functools.wraps(fn)
    def wrapper(self: "StorageMachine", *args: Any, **kwargs: Any) -> Any:
        if not self.steps:
            self.tally.examples += 1  # examples that ran no rule are not counted
        self.steps += 1
        self.ran[fn.__name__] += 1
        self.tally.steps += 1
        self.tally.rules[fn.__name__] += 1
        try:
            return fn(self, *args, **kwargs)
        except (StopTest, HypothesisException):
            raise  # Hypothesis's own control flow (data exhausted, assume()), not a failure
        except BaseException:
            self.failed = True
            raise

    return wrapper


def _error_type(attempt_error: ErrorInfo | None) -> str | None:
    return attempt_error.type if attempt_error else None


class StorageMachine(RuleBasedStateMachine):
    """Bound to one open store by ``StatefulCompliance`` (a subclass per test run)."""

    store: Storage
    tally: _Tally
    max_tasks = 10
    short_lease = (0.15, 0.3)

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex[:10]
        self.tag = tag
        self.queues = (f"sm{tag}-a", f"sm{tag}-b")  # fresh per example: examples never meet
        self.model = ReferenceModel()
        self.claims: dict[str, ClaimedTask] = {}  # the live claim per task (the engine needs its task)
        self.snapshot: dict[str, Task] = {}      # backend state after the last step
        self.serial = 0
        self.steps = 0
        self.ran: Counter[str] = Counter()  # rules run in this example (some are rationed)
        self.failed = False

    def _next(self) -> int:
        self.serial += 1
        return self.serial

    def _in_status(self, status: TaskStatus) -> list[str]:
        return sorted(t.id for t in self.model.tasks.values() if t.status is status)

    def _has_dead(self) -> bool:
        return any(t.status is TaskStatus.DEAD for t in self.model.tasks.values())

    def _has_spent_tokens(self) -> bool:
        return any(t.spent_tokens for t in (*self.model.tasks.values(), *self.model.purged.values()))

    def _known_ids(self) -> list[str]:
        return sorted(set(self.model.tasks) | set(self.model.purged))

    def _draw_held(self, data: st.DataObject, max_size: int = 3) -> list[str]:
        held = sorted(t.id for t in self.model.held())
        return data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=max_size, unique=True), label="held")

    def _stale_candidates(self, exclude: Sequence[str] = ()) -> list[tuple[str, str]]:
        """(task id, token) pairs no store may accept: spent tokens, never-issued ones, and a
        live token presented for another task."""
        everything = {**self.model.purged, **self.model.tasks}
        pairs: list[tuple[str, str]] = [
            (task_id, token) for task_id, task in sorted(everything.items()) for token in task.spent_tokens]
        pairs += [(task_id, NEVER_ISSUED) for task_id in sorted(everything)]
        pairs.append((f"t{self.tag}-unknown", NEVER_ISSUED))
        held = sorted(self.model.held(), key=lambda t: t.id)
        pairs += [(a.id, b.held_token()) for a, b in zip(held, held[1:] + held[:1], strict=True) if a.id != b.id]
        return [(task_id, token) for task_id, token in pairs if task_id not in exclude]

    @initialize(max_attempts=st.integers(2, 4), far_backoff=st.booleans())
    def choose_queue_policy(self, max_attempts: int, far_backoff: bool) -> None:
        self.model = ReferenceModel(max_attempts, FAR_BACKOFF if far_backoff else ZERO_BACKOFF)

    def teardown(self) -> None:
        """Delete this example's tasks through the SPI, so the shared store stays small (some
        stores count by scanning) -- but leave everything in place after a failure."""
        if self.failed or not (self.model.tasks or self.model.purged):
            return
        held = self.model.held()
        if held:
            self.store.settle([Settlement(t.id, t.held_token(), Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                          error=ErrorInfo("e.Cleanup")) for t in held])
        for task in self.model.tasks.values():
            if task.status is TaskStatus.PENDING:
                self.store.cancel(task.id)
        for queue in self.queues:
            self.store.purge_dead(queue, DeadFilter())

        def emptied() -> bool:
            self.store.purge_succeeded(older_than_seconds=0, limit=1000)
            return all(sum(_counts(self.store.stats(q))) == 0 for q in self.queues)

        wait_until(emptied, timeout=5.0, interval=0.005, what="the example's tasks to be deleted")

    # -- producer ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.model.tasks) < self.max_tasks)
    @rule(data=st.data(), queue=st.integers(0, 1), count=st.integers(1, 3))
    @_watched
    def enqueue(self, data: st.DataObject, queue: int, count: int) -> None:
        items: list[NewTask] = []
        known = self._known_ids()
        for _ in range(count):
            if bool(known) and data.draw(st.booleans(), label="repeat an id"):
                task_id = data.draw(st.sampled_from(known), label="repeated id")
            else:
                task_id = f"t{self.tag}-{self._next():03d}"
            if any(item.id == task_id for item in items):
                continue  # the engine refuses a batch naming an id twice; backends never see one
            items.append(NewTask(
                id=task_id, queue=self.queues[queue], handler=data.draw(st.sampled_from(HANDLERS)),
                payload={"v": self._next()},
                max_attempts=data.draw(st.sampled_from([None, 1, 2, 3]), label="max_attempts"),
                backoff=data.draw(st.sampled_from([None, ZERO_BACKOFF, FAR_BACKOFF]), label="backoff"),
                # Mostly due at once: the interesting paths start with a claim.
                delay_seconds=data.draw(st.sampled_from([0.0, 0.0, 0.0, FAR]), label="delay"),
            ))
        results = self.store.enqueue(items)
        before = {item.id: self.model.tasks.get(item.id) for item in items}
        expected = self.model.enqueue(items)
        assert [r.task.id for r in results] == [i.id for i in items], "enqueue results out of input order"
        assert [(r.created, r.conflict) for r in results] == expected, "enqueue (created, conflict) flags"
        for result, item in zip(results, items, strict=True):
            old = before[item.id]
            if old is not None:  # an idempotent repeat returns the existing task untouched
                got = result.task
                assert (got.queue, got.handler, got.payload, got.status, got.attempt_count) == (
                    old.queue, old.handler, old.payload, old.status, old.attempt_count), f"repeat of {item.id}"

    # -- worker ------------------------------------------------------------------------------------
    @precondition(lambda self: any(self.model.due(q) for q in self.queues))
    @rule(data=st.data(), limit=st.integers(1, 4), short=st.booleans())
    @_watched
    def claim(self, data: st.DataObject, limit: int, short: bool) -> None:
        q = data.draw(st.sampled_from([q for q in self.queues if self.model.due(q)]), label="queue")
        seconds = data.draw(st.floats(*self.short_lease), label="short lease") if short else LONG_LEASE
        due = {t.id for t in self.model.due(q)}
        claimed = self.store.claim(q, limit, seconds)
        ids = [c.task.id for c in claimed]
        assert len(ids) == len(set(ids)), f"one claim returned a task twice: {ids}"
        assert set(ids) <= due, f"claimed tasks that are not due PENDING: {sorted(set(ids) - due)}"
        assert len(ids) == min(limit, len(due)), f"claimed {len(ids)} of {len(due)} due with limit {limit}"
        # Oldest first by the backend's own clock; ties at its resolution may go either way.
        ready = {task_id: present(self._snapshot(task_id).next_attempt_at, f"next_attempt_at of {task_id}") for task_id in due}
        taken = [ready[i] for i in ids]
        assert taken == sorted(taken), "claim did not return tasks oldest next_attempt_at first"
        left = due - set(ids)
        if taken and left:
            assert max(taken) <= min(ready[i] for i in left), "claim skipped an older due task"
        for c in claimed:
            m = self.model.tasks[c.task.id]
            assert c.claim_token and c.claim_token not in self.tally.tokens, "claim token reused"
            self.tally.tokens.add(c.claim_token)
            assert c.task.status is TaskStatus.IN_FLIGHT and c.task.attempts == (), "claim must carry no history"
            assert (c.task.queue, c.task.handler, c.task.payload, c.task.attempt_count, c.task.redrive_count,
                    c.task.max_attempts, c.task.backoff) == (
                m.queue, m.handler, m.payload, m.attempt_count, m.redrive_count, m.max_attempts, m.backoff), c.task.id
            held_for = (c.lease_expires_at - c.claimed_at).total_seconds()
            assert abs(held_for - seconds) < 0.01, f"lease of {held_for}s for a {seconds}s claim"
            self.model.claimed(c.task.id, c.claim_token, Lease.SHORT if short else Lease.LONG, c.lease_expires_at)
            self.claims[c.task.id] = c

    def _snapshot(self, task_id: str) -> Task:
        if task_id not in self.snapshot:
            task = self.store.get(task_id)
            assert task is not None, task_id
            self.snapshot[task_id] = task
        return self.snapshot[task_id]

    def _settlement(self, data: st.DataObject, task_id: str) -> tuple[Settlement, tuple[Any, ...]]:
        """One settlement for a held task and what the model expects it to do."""
        token = self.model.tasks[task_id].token
        assert token is not None
        kind = data.draw(st.sampled_from(SETTLE_KINDS), label=f"settle {task_id}")
        error = ErrorInfo(data.draw(st.sampled_from(ERROR_TYPES), label="error type"), "failed on purpose")
        if kind == "success":
            result = {"r": self._next()}
            return (Settlement(task_id, token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result),
                    (Outcome.SUCCESS, TaskStatus.SUCCEEDED, 0.0, None, result))
        if kind.startswith("policy-"):
            outcome = Outcome.RETRYABLE_FAILURE if kind == "policy-retryable" else Outcome.PERMANENT_FAILURE
            settlement = failed_attempt(self.model.policies, self.claims[task_id].task, token, outcome, error)
            status, delay = self.model.failure_decision(task_id, outcome)
            assert (settlement.status, settlement.retry_delay_seconds) == (status, delay), (
                f"engine policy decided {settlement.status.value}/{settlement.retry_delay_seconds}s for {task_id},"
                f" the model {status.value}/{delay}s (the claim returned the wrong budget fields?)")
            return settlement, (outcome, status, delay, error.type, None)
        outcome, status, delay = {
            "retry-now": (Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, 0.0),
            "retry-later": (Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, FAR),
            "retry-dead": (Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD, 0.0),
            "permanent": (Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, 0.0),
        }[kind]
        return (Settlement(task_id, token, outcome, status, retry_delay_seconds=delay, error=error),
                (outcome, status, delay, error.type, None))

    @precondition(lambda self: self.model.held())
    @rule(data=st.data(), with_stale=st.booleans())
    @_watched
    def settle(self, data: st.DataObject, with_stale: bool) -> None:
        chosen = self._draw_held(data)
        planned = [self._settlement(data, task_id) for task_id in chosen]
        batch = [settlement for settlement, _ in planned]
        stale_id = None
        if with_stale:  # a refused item must not stop the valid ones, nor change its task
            stale_id, token = data.draw(st.sampled_from(self._stale_candidates(exclude=chosen)), label="stale item")
            at = data.draw(st.integers(0, len(batch)), label="stale position")
            batch.insert(at, Settlement(stale_id, token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"stale": 1}))
            stale_before = self.store.get(stale_id)
        try:
            self.store.settle(batch)
            refused: tuple[str, ...] = ()
        except StaleClaim as exc:
            refused = exc.task_ids
        assert list(refused) == ([stale_id] if stale_id else []), f"settle refused {refused}"
        if stale_id:
            assert self.store.get(stale_id) == stale_before, f"a refused settle changed {stale_id}"
        for task_id, (_, (outcome, status, delay, error_type, result)) in zip(chosen, planned, strict=True):
            self.model.settled(task_id, outcome, status, delay, error_type, result)
            del self.claims[task_id]

    @precondition(lambda self: self.ran["write_with_stale_token"] < 4 and (
        self._has_spent_tokens() or len(self.model.held()) >= 2))
    @rule(data=st.data(), write=st.sampled_from(("success", "retry", "dead", "lease-expired", "extend", "release")))
    @_watched
    def write_with_stale_token(self, data: st.DataObject, write: str) -> None:
        task_id, token = data.draw(st.sampled_from(self._stale_candidates()), label="stale ref")
        before = self.store.get(task_id)
        error = ErrorInfo("e.Stale", "late")
        writes: dict[str, Callable[[], object]] = {
            "success": lambda: self.store.settle([Settlement(task_id, token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
            "retry": lambda: self.store.settle([Settlement(
                task_id, token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=error)]),
            "dead": lambda: self.store.settle([Settlement(
                task_id, token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=error)]),
            "lease-expired": lambda: self.store.settle([Settlement(
                task_id, token, Outcome.LEASE_EXPIRED, TaskStatus.PENDING, error=error)]),
            "extend": lambda: self.store.extend_leases([ClaimRef(task_id, token)], LONG_LEASE),
            "release": lambda: self.store.release([ClaimRef(task_id, token)]),
        }
        with pytest.raises(StaleClaim) as refused:
            writes[write]()
        assert refused.value.task_ids == (task_id,), f"{write} refused {refused.value.task_ids}"
        assert self.store.get(task_id) == before, f"{write} with a stale token changed {task_id}"

    @precondition(lambda self: self.ran["lease_expired_while_lease_is_live"] < 2 and self.model.held(Lease.LONG))
    @rule(data=st.data())
    @_watched
    def lease_expired_while_lease_is_live(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(t.id for t in self.model.held(Lease.LONG))))
        before = self.store.get(task_id)
        with pytest.raises(StaleClaim):
            self.store.settle([Settlement(task_id, self.model.tasks[task_id].held_token(), Outcome.LEASE_EXPIRED,
                                          TaskStatus.PENDING, error=ErrorInfo(LEASE_EXPIRED))])
        assert self.store.get(task_id) == before, f"a refused LEASE_EXPIRED settle changed {task_id}"

    @precondition(lambda self: self.model.held())
    @rule(data=st.data(), short=st.booleans())
    @_watched
    def extend(self, data: st.DataObject, short: bool) -> None:
        chosen = self._draw_held(data)
        seconds = data.draw(st.floats(*self.short_lease), label="short lease") if short else LONG_LEASE
        floor = self.store.now()
        got = self.store.extend_leases([ClaimRef(i, self.model.tasks[i].held_token()) for i in chosen], seconds)
        assert sorted(got) == sorted(chosen), f"extend_leases answered for {sorted(got)}"
        for task_id in chosen:
            previous = self.model.tasks[task_id].lease_expires_at
            assert previous is not None
            assert got[task_id] >= previous, (
                f"extend_leases({seconds:.3f}s) shortened the lease of {task_id}: {previous} -> {got[task_id]}")
            assert got[task_id] >= floor + timedelta(seconds=seconds) - timedelta(milliseconds=2), (
                f"extend_leases({seconds:.3f}s) set {task_id} to {got[task_id]}, before now+{seconds:.3f}s")
            self.model.extended(task_id, Lease.SHORT if short else Lease.LONG, got[task_id])

    @precondition(lambda self: self.model.held())
    @rule(data=st.data())
    @_watched
    def release(self, data: st.DataObject) -> None:
        chosen = self._draw_held(data)
        due_at = {task_id: self._snapshot(task_id).next_attempt_at for task_id in chosen}
        self.store.release([ClaimRef(i, self.model.tasks[i].held_token()) for i in chosen])
        for task_id in chosen:
            # Back in line where it was: a released task must not jump or lose its place.
            got = self.store.get(task_id)
            assert got is not None and got.next_attempt_at == due_at[task_id], (
                f"release moved next_attempt_at of {task_id}: {due_at[task_id]} -> {got and got.next_attempt_at}")
            self.model.released(task_id)
            del self.claims[task_id]

    # -- time and the reaper -----------------------------------------------------------------------
    @precondition(lambda self: self.model.held(Lease.SHORT))
    @rule()
    @_watched
    def clock_passes_short_leases(self) -> None:
        # Backends keep their own clock: wait until it is past every short lease (<= short_lease).
        until = max(present(t.lease_expires_at, f"the lease of {t.id}") for t in self.model.held(Lease.SHORT))
        wait_until(lambda: self.store.now() > until, timeout=2.0, interval=0.01, what="short leases to lapse")
        self.model.clock_passed_short_leases()

    @precondition(lambda self: self.model.held() and not self.model.held(Lease.SHORT))
    @rule(queue=st.integers(0, 1), batch_size=st.sampled_from([1, 2, 100]))
    @_watched
    def reap(self, queue: int, batch_size: int) -> None:
        q = self.queues[queue]
        report = reap_expired_leases(self.store, self.model.policies, batch_size=batch_size, queue=q)
        reaped = self.model.reap(q)
        dead = sum(1 for _, status in reaped if status is TaskStatus.DEAD)
        assert (report.expired, report.rescheduled, report.dead_lettered, report.contended) == (
            len(reaped), len(reaped) - dead, dead, 0), f"reaper report {report}, model reaped {reaped}"
        for task_id, _ in reaped:
            del self.claims[task_id]

    # -- operator ----------------------------------------------------------------------------------
    def _draw_filter(self, data: st.DataObject) -> DeadFilter:
        kind = data.draw(st.sampled_from(("ids", "error_type", "handler", "both", "all")), label="filter")
        error_types = st.sampled_from(ERROR_TYPES + (LEASE_EXPIRED,))
        if kind == "ids" and self._known_ids():
            ids = data.draw(st.lists(st.sampled_from(self._known_ids()), min_size=1, max_size=3, unique=True))
            return DeadFilter(ids=tuple(ids))
        if kind == "error_type":
            return DeadFilter(error_type=data.draw(error_types))
        if kind == "handler":
            return DeadFilter(handler=data.draw(st.sampled_from(HANDLERS)))
        if kind == "both":
            return DeadFilter(error_type=data.draw(error_types), handler=data.draw(st.sampled_from(HANDLERS)))
        return DeadFilter()

    @precondition(lambda self: self._has_dead())
    @rule(data=st.data(), queue=st.integers(0, 1))
    @_watched
    def redrive(self, data: st.DataObject, queue: int) -> None:
        selection = self._draw_filter(data)
        count = self.store.redrive(self.queues[queue], selection)
        assert count == self.model.redrive(self.queues[queue], selection), f"redrive {selection} moved {count}"

    @precondition(lambda self: self._has_dead())
    @rule(data=st.data(), queue=st.integers(0, 1))
    @_watched
    def purge_dead(self, data: st.DataObject, queue: int) -> None:
        selection = self._draw_filter(data)
        count = self.store.purge_dead(self.queues[queue], selection)
        assert count == self.model.purge(self.queues[queue], selection), f"purge_dead {selection} deleted {count}"

    # Rules that are almost always enabled but change little are rationed per example, so the
    # steps go to claims, settlements and the reaper. Cancel ends a task for good; at the task cap
    # it is not rationed, so every state has some enabled rule.
    @precondition(lambda self: self._in_status(TaskStatus.PENDING) and (
        self.ran["cancel"] < 2 or len(self.model.tasks) >= self.max_tasks))
    @rule(data=st.data())
    @_watched
    def cancel(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(self._in_status(TaskStatus.PENDING)), label="cancel")
        got = self.store.cancel(task_id)
        assert (got.id, got.status) == (task_id, TaskStatus.CANCELLED), f"cancel returned {got}"
        assert self.model.cancel(task_id) == "cancelled"

    @precondition(lambda self: self.ran["cancel_refused"] < 3 and (self.model.purged or any(
        t.status is not TaskStatus.PENDING for t in self.model.tasks.values())))
    @rule(data=st.data())
    @_watched
    def cancel_refused(self, data: st.DataObject) -> None:
        choices = sorted(set(self.model.purged) | {
            t.id for t in self.model.tasks.values() if t.status is not TaskStatus.PENDING})
        task_id = data.draw(st.sampled_from(choices), label="cancel")
        before = self.store.get(task_id)
        expected = self.model.cancel(task_id)
        with pytest.raises(TaskNotFound if expected == "not-found" else TaskConflict):
            self.store.cancel(task_id)
        assert self.store.get(task_id) == before, f"a refused cancel changed {task_id}"

    @precondition(lambda self: self.model.finished())
    @rule(older_than=st.sampled_from([0.0, FAR]))
    @_watched
    def purge_succeeded(self, older_than: float) -> None:
        ours = sorted(t.id for t in self.model.finished())
        # "Older than 0 s" must include the latest update: wait for the clock to pass it.
        latest = max(present(self._snapshot(task_id).updated_at, f"updated_at of {task_id}") for task_id in ours)
        wait_until(lambda: self.store.now() > latest, timeout=2.0, interval=0.002, what="the clock to tick")
        count = self.store.purge_succeeded(older_than_seconds=older_than, limit=1000)
        if older_than == FAR:
            assert count == 0, f"retention of tasks older than {FAR}s deleted {count} fresh task(s)"
            return
        # Other examples clean up after themselves; a failed one may leave finished tasks behind.
        assert count >= len(ours), f"retention deleted {count} task(s), this example alone had {len(ours)}"
        self.model.retention(ours)

    # -- the comparison, after every step ----------------------------------------------------------
    @invariant()
    def backend_matches_model(self) -> None:
        try:
            self._compare_all()
        except (StopTest, HypothesisException):
            raise
        except BaseException:
            self.failed = True
            raise

    def _compare_all(self) -> None:
        now = self.store.now()
        self.snapshot = {}
        for task_id, expected in sorted(self.model.tasks.items()):
            if expected.status is TaskStatus.DEAD:
                continue  # list_dead returns them with full history: compared there
            got = self.store.get(task_id)
            assert got is not None, f"{task_id} is gone from the store"
            self.snapshot[task_id] = got
            _compare_task(expected, got, now)
        for task_id in sorted(self.model.purged):
            assert self.store.get(task_id) is None, f"purged {task_id} is still in the store"
        for queue in self.queues:
            self._compare_queue(queue, now)
        self._probe_stale_tokens()

    def _compare_queue(self, queue: str, now: datetime) -> None:
        counts = self.model.counts(queue)
        stats = self.store.stats(queue)
        assert _counts(stats) == (
            counts[TaskStatus.PENDING], counts[TaskStatus.IN_FLIGHT], counts[TaskStatus.DEAD],
            counts[TaskStatus.SUCCEEDED], counts[TaskStatus.CANCELLED]), f"stats({queue}) = {stats}"
        due = sorted(self.model.due(queue), key=lambda t: t.ready_seq)
        if not due:
            assert stats.oldest_pending_age_seconds == 0, f"nothing is due on {queue}, yet {stats}"
        # The backend's next_attempt_at must follow the order in which the model made tasks due.
        stamps = [present(self.snapshot[t.id].next_attempt_at, f"next_attempt_at of {t.id}") for t in due]
        assert stamps == sorted(stamps), f"next_attempt_at out of event order on {queue}"
        pages, cursor = 0, None
        dead: list[Task] = []
        while True:
            page = self.store.list_dead(queue, limit=DLQ_PAGE, cursor=cursor)
            assert len(page.tasks) <= DLQ_PAGE
            dead += page.tasks
            pages += 1
            assert pages <= 50, "list_dead paging does not end"
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        ids = [t.id for t in dead]
        assert len(ids) == len(set(ids)), f"list_dead returned a task twice: {ids}"
        assert sorted(ids) == sorted(t.id for t in self.model.in_queue(queue, TaskStatus.DEAD)), "DLQ contents"
        keys = [(t.dead_at, t.id) for t in dead]
        assert keys == sorted(keys), "list_dead not ordered by (dead_at, id)"
        for task in dead:
            _compare_task(self.model.tasks[task.id], task, now)

    def _probe_stale_tokens(self) -> None:
        """At most one holder per task: one spent token per task (rotating), a never-issued and a
        borrowed one, in one batch; every ref must be refused and nothing may move."""
        probe: dict[str, str] = {}
        for task_id, token in self._stale_candidates():
            probe.setdefault(task_id, token)
        everything = {**self.model.purged, **self.model.tasks}
        for task_id, task in everything.items():
            if task.spent_tokens:
                probe[task_id] = task.spent_tokens[self.tally.steps % len(task.spent_tokens)]
        refs = [ClaimRef(task_id, token) for task_id, token in sorted(probe.items())]
        with pytest.raises(StaleClaim) as refused:
            self.store.extend_leases(refs, LONG_LEASE)
        assert sorted(refused.value.task_ids) == sorted(probe), "a stale token was accepted"


def _counts(stats: Any) -> tuple[int, int, int, int, int]:
    return (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled)


def _compare_task(expected: ModelTask, got: Task, now: datetime) -> None:
    where = f"task {expected.id}"
    assert (got.queue, got.handler, got.payload) == (expected.queue, expected.handler, expected.payload), where
    assert (got.status, got.attempt_count, got.redrive_count) == (
        expected.status, expected.attempt_count, expected.redrive_count), (
        f"{where}: (status, attempt_count, redrive_count) = {(got.status.value, got.attempt_count, got.redrive_count)},"
        f" model {(expected.status.value, expected.attempt_count, expected.redrive_count)}")
    numbers = [a.attempt_no for a in got.attempts]
    assert numbers == list(range(1, len(numbers) + 1)), f"{where}: attempt numbers {numbers} are not 1..n"
    outcomes = [(a.outcome, _error_type(a.error)) for a in got.attempts]
    assert outcomes == expected.history, f"{where}: attempts {outcomes}, model {expected.history}"
    for attempt in got.attempts:
        assert attempt.started_at is not None and attempt.finished_at is not None, f"{where}: attempt times"
        assert attempt.started_at <= attempt.finished_at, f"{where}: attempt {attempt.attempt_no} ends before it starts"
    if expected.status is TaskStatus.IN_FLIGHT:
        assert got.lease_expires_at == expected.lease_expires_at, (
            f"{where}: lease_expires_at {got.lease_expires_at}, last reported {expected.lease_expires_at}")
        if expected.lease is Lease.LONG:
            left = present(got.lease_expires_at, f"{where}: a lease") - now
            assert left > timedelta(seconds=LONG_LEASE / 2), f"{where}: long lease too short"
        if expected.lease is Lease.LAPSED:
            assert present(got.lease_expires_at, f"{where}: a lease") <= now, f"{where}: lapsed lease is live again"
    else:
        assert got.lease_expires_at is None, f"{where}: {got.status.value} task keeps a lease"
    assert (got.dead_at is not None) == (expected.status is TaskStatus.DEAD), f"{where}: dead_at {got.dead_at}"
    if expected.status is TaskStatus.SUCCEEDED:
        assert got.result == expected.result, f"{where}: result {got.result!r}, model {expected.result!r}"
    if expected.status is TaskStatus.DEAD:
        assert _error_type(got.last_error) == expected.last_error_type, f"{where}: last_error {got.last_error}"
    if expected.status is TaskStatus.PENDING:
        assert got.next_attempt_at is not None
        if expected.due:
            assert got.next_attempt_at <= now, f"{where}: should be due, next_attempt_at {got.next_attempt_at}"
        else:
            assert got.next_attempt_at - now > timedelta(seconds=FAR / 2), f"{where}: should not be due yet"


class StatefulCompliance:
    """The model-based test of the kit (mixed into ``StorageCompliance``)."""

    #: Hypothesis examples and the most steps per example; scale for slow or very fast stores.
    stateful_examples = 30
    stateful_steps = 30
    #: Tasks one example may hold at once; bounds what every step compares.
    stateful_max_tasks = 10
    #: Wall-clock budget. Examples run in consecutive Hypothesis runs sized from the measured cost
    #: per example, so a slow store runs fewer of them (the summary line says how many ran).
    stateful_budget_seconds = 40.0

    def test_stateful_model_matches_backend(self, storage_url: str) -> None:
        store = open_storage(storage_url)
        store.migrate()
        tally = _Tally()
        longest = getattr(self, "short_lease", 0.3)  # StorageCompliance's short lease, when mixed in
        machine = type("StorageModelMachine", (StorageMachine,), {
            "store": store, "tally": tally, "max_tasks": self.stateful_max_tasks,
            "short_lease": (longest / 2, longest),
        })
        started = time.monotonic()
        try:
            # Hypothesis has no time limit, so run it in chunks: the first is a quarter of the
            # examples, each later one as many as the measured cost per example lets fit.
            chunk = max(1, math.ceil(self.stateful_examples / 4))
            while tally.examples < self.stateful_examples:
                tally.runs += 1
                _run_state_machine(machine, settings=settings(
                    max_examples=chunk,
                    stateful_step_count=self.stateful_steps,
                    deadline=None,
                    derandomize=False,
                    print_blob=True,  # a failure prints @reproduce_failure: the exact run, replayable
                    database=None,    # the kit runs in other projects' trees: leave no .hypothesis/ behind
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large],
                ))
                spent = time.monotonic() - started
                per_example = spent / max(tally.examples, 1)
                chunk = min(self.stateful_examples - tally.examples,
                            int((self.stateful_budget_seconds - spent) / per_example))
                if chunk <= 0:
                    break
        finally:
            store.close()
            summary = (f"stateful: {tally.examples} examples, {tally.steps} steps in {tally.runs} run(s),"
                       f" {time.monotonic() - started:.1f}s; rules {dict(sorted(tally.rules.items()))}")
            log.info(summary)
            print(f"\n{summary}")


__all__ = ["StatefulCompliance", "ReferenceModel", "ModelTask", "Lease", "StorageMachine",
           "FAR", "LONG_LEASE", "ZERO_BACKOFF", "FAR_BACKOFF", "HANDLERS", "ERROR_TYPES", "NEVER_ISSUED"]
