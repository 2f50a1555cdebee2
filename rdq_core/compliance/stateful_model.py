"""The reference model of the model-based test (``stateful``): a queue in plain Python, with time
made deterministic (every delay 0 or ``FAR``; a lease long, short or lapsed), and the check of
one stored task against its model. Reused by the cross-backend differential test
(``tests/backends/test_differential.py``)."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from ..model import (
    Backoff,
    DeadFilter,
    ErrorInfo,
    NewTask,
    Outcome,
    Task,
    TaskStatus,
)
from ..engine.retry import PolicyBook, RetryPolicy
from ..engine.outcomes import LEASE_EXPIRED
from ..storage.spi import Storage
from .support import present

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




def error_type_of(attempt_error: ErrorInfo | None) -> str | None:
    return attempt_error.type if attempt_error else None



def counts_of(stats: Any) -> tuple[int, int, int, int, int]:
    return (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled)


def compare_task(expected: ModelTask, got: Task, now: datetime) -> None:
    where = f"task {expected.id}"
    assert (got.queue, got.handler, got.payload) == (expected.queue, expected.handler, expected.payload), where
    assert (got.status, got.attempt_count, got.redrive_count) == (
        expected.status, expected.attempt_count, expected.redrive_count), (
        f"{where}: (status, attempt_count, redrive_count) = {(got.status.value, got.attempt_count, got.redrive_count)},"
        f" model {(expected.status.value, expected.attempt_count, expected.redrive_count)}")
    numbers = [a.attempt_no for a in got.attempts]
    assert numbers == list(range(1, len(numbers) + 1)), f"{where}: attempt numbers {numbers} are not 1..n"
    outcomes = [(a.outcome, error_type_of(a.error)) for a in got.attempts]
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
        assert error_type_of(got.last_error) == expected.last_error_type, f"{where}: last_error {got.last_error}"
    if expected.status is TaskStatus.PENDING:
        assert got.next_attempt_at is not None
        if expected.due:
            assert got.next_attempt_at <= now, f"{where}: should be due, next_attempt_at {got.next_attempt_at}"
        else:
            assert got.next_attempt_at - now > timedelta(seconds=FAR / 2), f"{where}: should not be due yet"


def compare_queue(store: Storage, model: ReferenceModel, queue: str, snapshot: dict[str, Task], now: datetime) -> None:
    """The store's view of ``queue`` against the model's: counts, the order tasks became due in
    (``snapshot``: the stored tasks just compared), and the DLQ paged through to its end."""
    counts = model.counts(queue)
    stats = store.stats(queue)
    assert counts_of(stats) == (
        counts[TaskStatus.PENDING], counts[TaskStatus.IN_FLIGHT], counts[TaskStatus.DEAD],
        counts[TaskStatus.SUCCEEDED], counts[TaskStatus.CANCELLED]), f"stats({queue}) = {stats}"
    due = sorted(model.due(queue), key=lambda t: t.ready_seq)
    if not due:
        assert stats.oldest_pending_age_seconds == 0, f"nothing is due on {queue}, yet {stats}"
    # The backend's next_attempt_at must follow the order in which the model made tasks due.
    stamps = [present(snapshot[t.id].next_attempt_at, f"next_attempt_at of {t.id}") for t in due]
    assert stamps == sorted(stamps), f"next_attempt_at out of event order on {queue}"
    pages, cursor = 0, None
    dead: list[Task] = []
    while True:
        page = store.list_dead(queue, limit=DLQ_PAGE, cursor=cursor)
        assert len(page.tasks) <= DLQ_PAGE
        dead += page.tasks
        pages += 1
        assert pages <= 50, "list_dead paging does not end"
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    ids = [t.id for t in dead]
    assert len(ids) == len(set(ids)), f"list_dead returned a task twice: {ids}"
    assert sorted(ids) == sorted(t.id for t in model.in_queue(queue, TaskStatus.DEAD)), "DLQ contents"
    keys = [(t.dead_at, t.id) for t in dead]
    assert keys == sorted(keys), "list_dead not ordered by (dead_at, id)"
    for task in dead:
        compare_task(model.tasks[task.id], task, now)
