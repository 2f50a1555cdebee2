"""The task and attempt model shared by the engine, every backend and every host.

Task states and their transitions (drawn in docs/state-machine.md)::

    PENDING   --claim-->                    IN_FLIGHT
    PENDING   --cancel-->                   CANCELLED
    IN_FLIGHT --success-->                  SUCCEEDED
    IN_FLIGHT --failure, budget left-->     PENDING    (after backoff; one attempt row)
    IN_FLIGHT --lease expired, budget left-> PENDING   (reaper; one LEASE_EXPIRED row)
    IN_FLIGHT --failure/expiry, budget spent, or PermanentError--> DEAD
    IN_FLIGHT --release (never started)-->  PENDING    (no attempt row, budget unchanged)
    IN_FLIGHT --Snooze(seconds)-->          PENDING    (one SNOOZED row, budget unchanged)
    DEAD      --redrive-->                  PENDING    (budget reset, history kept)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping


class TaskStatus(str, enum.Enum):
    PENDING = "PENDING"
    IN_FLIGHT = "IN_FLIGHT"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"
    CANCELLED = "CANCELLED"


class Outcome(str, enum.Enum):
    SUCCESS = "SUCCESS"
    RETRYABLE_FAILURE = "RETRYABLE_FAILURE"
    PERMANENT_FAILURE = "PERMANENT_FAILURE"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    #: The handler asked to run again later (``rdq_core.Snooze``): no retry budget spent.
    SNOOZED = "SNOOZED"


class DedupeMode(str, enum.Enum):
    """What an enqueue that matches an existing task by ``dedupe_key`` does (docs/flow-control.md)."""

    SKIP = "skip"
    REPLACE = "replace"
    DEBOUNCE = "debounce"


@dataclass(frozen=True)
class ErrorInfo:
    """What went wrong in one attempt. Message and stack are truncated by the engine."""

    type: str
    message: str = ""
    stack: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "stack": self.stack}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "ErrorInfo | None":
        if not data:
            return None
        return cls(type=data["type"], message=data.get("message") or "", stack=data.get("stack"))


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``initial * factor**(n-1)``, capped, then jittered by ±jitter."""

    initial_seconds: float = 1.0
    factor: float = 2.0
    max_seconds: float = 600.0
    jitter: float = 0.2

    def to_dict(self) -> dict[str, float]:
        return {
            "initial_seconds": self.initial_seconds,
            "factor": self.factor,
            "max_seconds": self.max_seconds,
            "jitter": self.jitter,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Backoff | None":
        if data is None:
            return None
        return cls(**{k: float(v) for k, v in data.items()})


@dataclass(frozen=True)
class Attempt:
    """One row of a task's history, unique on (task_id, attempt_no).

    ``started_at`` is when the handler started: the claim's time (the backend's clock) plus how
    long after the claim came back the worker started it (the worker's own clock measures only
    that interval); the claim's time when the handler never ran (a lease that expired, a task
    dead-lettered without running). ``finished_at`` is when it was settled (or reaped), by the
    backend's clock.
    """

    attempt_no: int
    outcome: Outcome
    started_at: datetime | None
    finished_at: datetime | None
    error: ErrorInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt_no": self.attempt_no,
            "outcome": self.outcome.value,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "error": self.error.to_dict() if self.error else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Attempt":
        return cls(
            attempt_no=int(data["attempt_no"]),
            outcome=Outcome(data["outcome"]),
            started_at=_parse_iso(data.get("started_at")),
            finished_at=_parse_iso(data.get("finished_at")),
            error=ErrorInfo.from_dict(data.get("error")),
        )


@dataclass(frozen=True)
class Task:
    id: str
    queue: str
    handler: str
    payload: Any
    status: TaskStatus
    headers: Mapping[str, str] = field(default_factory=dict)
    attempt_count: int = 0
    redrive_count: int = 0
    max_attempts: int | None = None
    backoff: Backoff | None = None
    next_attempt_at: datetime | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    dead_at: datetime | None = None
    result: Any = None
    last_error: ErrorInfo | None = None
    attempts: tuple[Attempt, ...] = ()
    # Flow control (docs/flow-control.md): claim order and the limits a claim honours.
    priority: int = 0
    concurrency_key: str | None = None
    rate_key: str | None = None
    group: str | None = None
    dedupe_key: str | None = None
    #: While IN_FLIGHT: when the running attempt's claim was stamped (the store's clock); else None.
    claimed_at: datetime | None = None
    #: While IN_FLIGHT: who holds the running attempt's claim, as the claimer named itself
    #: (``rdq worker``: host, pid and name; Lambda: function, log stream and request id); None
    #: when the claimer gave no name, and always None unless IN_FLIGHT.
    claimed_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "handler": self.handler,
            "payload": self.payload,
            "headers": dict(self.headers),
            "status": self.status.value,
            "attempt_count": self.attempt_count,
            "redrive_count": self.redrive_count,
            "max_attempts": self.max_attempts,
            "backoff": self.backoff.to_dict() if self.backoff else None,
            "next_attempt_at": _iso(self.next_attempt_at),
            "lease_expires_at": _iso(self.lease_expires_at),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "dead_at": _iso(self.dead_at),
            "result": self.result,
            "last_error": self.last_error.to_dict() if self.last_error else None,
            "attempts": [a.to_dict() for a in self.attempts],
            "priority": self.priority,
            "concurrency_key": self.concurrency_key,
            "rate_key": self.rate_key,
            "group": self.group,
            "dedupe_key": self.dedupe_key,
            "claimed_at": _iso(self.claimed_at),
            "claimed_by": self.claimed_by,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Task":
        """The inverse of ``to_dict`` (keys it does not know, such as ``created``, are ignored)."""
        return cls(
            id=data["id"],
            queue=data["queue"],
            handler=data["handler"],
            payload=data.get("payload"),
            status=TaskStatus(data["status"]),
            headers=dict(data.get("headers") or {}),
            attempt_count=int(data.get("attempt_count") or 0),
            redrive_count=int(data.get("redrive_count") or 0),
            max_attempts=data.get("max_attempts"),
            backoff=Backoff.from_dict(data.get("backoff")),
            next_attempt_at=_parse_iso(data.get("next_attempt_at")),
            lease_expires_at=_parse_iso(data.get("lease_expires_at")),
            created_at=_parse_iso(data.get("created_at")),
            updated_at=_parse_iso(data.get("updated_at")),
            dead_at=_parse_iso(data.get("dead_at")),
            result=data.get("result"),
            last_error=ErrorInfo.from_dict(data.get("last_error")),
            attempts=tuple(Attempt.from_dict(a) for a in data.get("attempts") or ()),
            priority=int(data.get("priority") or 0),
            concurrency_key=data.get("concurrency_key"),
            rate_key=data.get("rate_key"),
            group=data.get("group"),
            dedupe_key=data.get("dedupe_key"),
            claimed_at=_parse_iso(data.get("claimed_at")),
            claimed_by=data.get("claimed_by"),
        )


@dataclass(frozen=True)
class NewTask:
    """A validated enqueue request (the engine validates; backends trust it).

    Exactly one of ``delay_seconds`` / ``run_at`` matters: ``run_at`` wins when set. The backend
    computes ``next_attempt_at = its own now() + delay_seconds``.
    """

    id: str
    queue: str
    handler: str
    payload: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    max_attempts: int | None = None
    backoff: Backoff | None = None
    delay_seconds: float = 0.0
    run_at: datetime | None = None
    priority: int = 0
    concurrency_key: str | None = None
    rate_key: str | None = None
    group: str | None = None
    #: Enqueue-time dedupe: a task of the same queue and key in ``dedupe_states`` (None: PENDING
    #: or IN_FLIGHT), or created within ``dedupe_for_seconds``, is returned instead of inserting.
    dedupe_key: str | None = None
    dedupe_for_seconds: float | None = None
    dedupe_states: tuple[TaskStatus, ...] | None = None
    dedupe_mode: DedupeMode = DedupeMode.SKIP
    dedupe_max_wait_seconds: float | None = None

    def flow_fields(self) -> dict[str, Any]:
        """The flow-control fields that differ from their defaults, JSON-shaped (as enqueue takes them)."""
        fields: dict[str, Any] = {
            "priority": self.priority or None, "concurrency_key": self.concurrency_key, "rate_key": self.rate_key,
            "group": self.group, "dedupe_key": self.dedupe_key, "dedupe_for_seconds": self.dedupe_for_seconds,
            "dedupe_states": [s.value for s in self.dedupe_states] if self.dedupe_states else None,
            "dedupe_mode": self.dedupe_mode.value if self.dedupe_key else None,
            "dedupe_max_wait_seconds": self.dedupe_max_wait_seconds,
        }
        return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class EnqueueResult:
    """Per-item result of an enqueue. ``created`` is False for an idempotent repeat.

    ``conflict`` is True when the id already exists on another queue; ``task`` is then the
    existing task (on its own queue) and nothing was written.
    """

    task: Task
    created: bool
    conflict: bool = False
    deduplicated: bool = False


@dataclass(frozen=True)
class ClaimRef:
    """The fencing pair every post-claim write presents."""

    task_id: str
    claim_token: str


@dataclass(frozen=True)
class ClaimedTask:
    """A task as handed to a worker (or a reaper) by a claim."""

    task: Task
    claim_token: str
    claimed_at: datetime
    lease_expires_at: datetime

    @property
    def ref(self) -> ClaimRef:
        return ClaimRef(self.task.id, self.claim_token)


@dataclass(frozen=True)
class Settlement:
    """The engine's decision for one claimed task; the backend applies it atomically.

    The backend, in one atomic step per task and only if ``claim_token`` still matches an
    IN_FLIGHT task (and, for LEASE_EXPIRED, only if its lease has expired by the backend clock):
    appends an attempt ``MAX(attempt_no)+1`` with ``outcome``/``error``, adds 1 to
    ``attempt_count`` (0 for SNOOZED, which is always PENDING: a snooze spends no budget), sets
    ``status`` (SUCCEEDED, PENDING or DEAD), clears the claim, sets
    ``next_attempt_at = now() + retry_delay_seconds`` for PENDING, ``dead_at = now()`` for DEAD,
    stores ``result`` for SUCCEEDED and ``last_error`` for failures.
    """

    task_id: str
    claim_token: str
    outcome: Outcome
    status: TaskStatus
    retry_delay_seconds: float = 0.0
    error: ErrorInfo | None = None
    result: Any = None
    #: How long after its claim came back the handler started (None: it never ran). The attempt's
    #: ``started_at`` is the claim's time plus this, never later than the settle.
    started_after_seconds: float | None = None


@dataclass(frozen=True)
class TaskFilter:
    """Selects tasks of one queue: by ids, or by the last error's type / handler (None = any)."""

    ids: tuple[str, ...] | None = None
    error_type: str | None = None
    handler: str | None = None

    def described(self, all: bool = False) -> dict[str, Any]:
        """The filter as the audit trail and bulk operations keep it: only what was given
        (``{"all": true}`` for an explicit everything)."""
        described: dict[str, Any] = {}
        if self.ids is not None:
            described["ids"] = list(self.ids)
        if self.error_type is not None:
            described["error_type"] = self.error_type
        if self.handler is not None:
            described["handler"] = self.handler
        if all and not described:
            described["all"] = True
        return described


#: The dead-letter operations' name for the same filter.
DeadFilter = TaskFilter


@dataclass(frozen=True)
class TaskPage:
    """One keyset page of tasks, and the opaque cursor of the next one (None on the last page)."""

    tasks: tuple[Task, ...]
    next_cursor: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"tasks": [t.to_dict() for t in self.tasks], "next_cursor": self.next_cursor}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TaskPage":
        return cls(tasks=tuple(Task.from_dict(t) for t in data.get("tasks") or ()), next_cursor=data.get("next_cursor"))


#: A page of the dead-letter queue (tasks carry their attempts).
DeadPage = TaskPage


@dataclass(frozen=True)
class QueueStats:
    queue: str
    pending: int
    in_flight: int
    dead: int
    succeeded: int
    cancelled: int
    oldest_pending_age_seconds: float
    #: Workers claim nothing from a paused queue; enqueues are still accepted.
    paused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "pending": self.pending,
            "in_flight": self.in_flight,
            "dead": self.dead,
            "succeeded": self.succeeded,
            "cancelled": self.cancelled,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "paused": self.paused,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QueueStats":
        return cls(
            queue=data["queue"],
            pending=int(data["pending"]),
            in_flight=int(data["in_flight"]),
            dead=int(data["dead"]),
            succeeded=int(data["succeeded"]),
            cancelled=int(data["cancelled"]),
            oldest_pending_age_seconds=float(data["oldest_pending_age_seconds"]),
            paused=bool(data.get("paused", False)),
        )


@dataclass(frozen=True)
class Document:
    """A small JSON document the engine keeps in the store (bulk operations, their per-queue
    locks), versioned for compare-and-set: ``version`` starts at 1 and grows by one per write."""

    kind: str
    key: str
    version: int
    body: Mapping[str, Any]


@dataclass(frozen=True)
class AuditEntry:
    """One operator action as the audit trail keeps it: who did what to which queue, when (by
    the store's clock), with what selection, and how many tasks it changed."""

    id: str
    at: datetime
    actor: str
    action: str
    queue: str
    selection: Mapping[str, Any] = field(default_factory=dict)
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "at": _iso(self.at), "actor": self.actor, "action": self.action, "queue": self.queue,
                "selection": dict(self.selection), "count": self.count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AuditEntry":
        at = _parse_iso(data["at"])
        assert at is not None, "an audit entry has a time"
        return cls(id=data["id"], at=at, actor=data["actor"], action=data["action"], queue=data["queue"],
                   selection=dict(data.get("selection") or {}), count=int(data.get("count") or 0))


@dataclass(frozen=True)
class AuditPage:
    """Audit entries, newest first, and the cursor of the next (older) page."""

    entries: tuple[AuditEntry, ...]
    next_cursor: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries], "next_cursor": self.next_cursor}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AuditPage":
        return cls(entries=tuple(AuditEntry.from_dict(e) for e in data.get("entries") or ()),
                   next_cursor=data.get("next_cursor"))


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_iso(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value is not None else None
