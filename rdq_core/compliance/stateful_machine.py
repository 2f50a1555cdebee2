"""The rule-based state machine of the model-based test (``stateful``): Hypothesis draws its rules
(enqueue, claim, settle, extend, release, reap, redrive, purge, cancel, the clock passing short
leases, writes with stale tokens), each applied to the store and to ``ReferenceModel``, and after
every step the store must match the model."""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException, StopTest
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ..errors import StaleClaim, TaskConflict, TaskNotFound
from ..model import (
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
from ..engine.outcomes import LEASE_EXPIRED, failed_attempt
from ..storage.spi import Storage
from .support import present, wait_until
from .stateful_model import (
    ERROR_TYPES,
    FAR,
    FAR_BACKOFF,
    HANDLERS,
    LONG_LEASE,
    NEVER_ISSUED,
    SETTLE_KINDS,
    ZERO_BACKOFF,
    Lease,
    ReferenceModel,
    compare_queue,
    compare_task,
    counts_of,
)


@dataclass
class Tally:
    """What the examples of one test run did: counts for its summary line, and every token the
    store handed out (later examples write with them as stale tokens)."""

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



class StorageMachine(RuleBasedStateMachine):
    """Bound to one open store by ``StatefulCompliance`` (a subclass per test run)."""

    store: Storage
    tally: Tally
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
            return all(sum(counts_of(self.store.stats(q))) == 0 for q in self.queues)

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
            compare_task(expected, got, now)
        for task_id in sorted(self.model.purged):
            assert self.store.get(task_id) is None, f"purged {task_id} is still in the store"
        for queue in self.queues:
            compare_queue(self.store, self.model, queue, self.snapshot, now)
        self._probe_stale_tokens()

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

