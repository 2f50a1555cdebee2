"""Lifecycle events: what rdq tells the rest of the account, through a transactional outbox.

A state change that others may react to writes an *event* into the store's outbox **in the same
atomic step** as the change itself (the settle statement or script, the redrive statement or
script; MongoDB: on the task document in the same update, moved to the outbox collection right
after). The maintenance pass then delivers the outbox in batches (``deliver_events``,
``rdq_core/engine/outbox.py``) to EventBridge (``rdq_core/aws/eventbridge.py``) and removes an
event only once EventBridge accepted it, so delivery is **at least once**: a crash
between the write and the delivery, or between the delivery and the removal, delivers the event
(again) on a later pass. An event's id names one state change: a redelivery carries the id it was
written with, and no other change ever gets that id, so a consumer deduplicates by ``id``::

    rdq.task.dead           <task id>:dead:<attempt number>:<incarnation>
    rdq.task.succeeded      <task id>:succeeded:<attempt number>:<incarnation>      (opt-in)
    rdq.task.redriven       <task id>:redriven:<redrive count after>:<incarnation>
    rdq.operation.finished  op:<operation id>:finished

``<incarnation>`` tells apart two tasks that had the same id one after the other: a task id may
be used again once its task is purged (or removed by retention), and the new task's events never
repeat an id of the old one's. It is fixed when the task is created and is opaque to consumers:
PostgreSQL, SQLite and Redis write the task's ``created_at`` in microseconds since the Unix epoch
(by the store's clock), MongoDB the random incarnation of the task's document
(``task_event_id``).

Events are written only when switched on (``RDQ_EVENTS=on``, or ``RDQ_EVENT_BUS`` set): a store
without a consumer never pays for them. Payloads are left out unless
``RDQ_EVENTS_INCLUDE_PAYLOAD=on`` (``docs/security.md`` says why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping

TASK_DEAD = "rdq.task.dead"
TASK_REDRIVEN = "rdq.task.redriven"
TASK_SUCCEEDED = "rdq.task.succeeded"
OPERATION_FINISHED = "rdq.operation.finished"
EVENT_TYPES = (TASK_DEAD, TASK_REDRIVEN, TASK_SUCCEEDED, OPERATION_FINISHED)

#: An error message in an event is cut to this many characters (the task keeps it whole).
MAX_ERROR_MESSAGE_CHARS = 2048


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class EventSettings:
    """Which events a store writes, and how they are delivered (read from the environment)."""

    #: Write events at all (``RDQ_EVENTS``; on by default when ``RDQ_EVENT_BUS`` is set).
    enabled: bool = False
    #: Also write ``rdq.task.succeeded`` (``RDQ_EVENTS_SUCCEEDED``): one event per finished task.
    succeeded: bool = False
    #: Copy the task's payload into task events (``RDQ_EVENTS_INCLUDE_PAYLOAD``; off, see security.md).
    include_payload: bool = False
    #: The events' ``Source`` (``RDQ_EVENT_SOURCE``).
    source: str = "rdq"
    #: The EventBridge bus name or ARN (``RDQ_EVENT_BUS``; ``default`` is the account's default bus).
    bus: str = ""

    @classmethod
    def from_env(cls) -> "EventSettings":
        bus = os.environ.get("RDQ_EVENT_BUS", "").strip()
        return cls(enabled=_flag("RDQ_EVENTS", bool(bus)), succeeded=_flag("RDQ_EVENTS_SUCCEEDED"),
                   include_payload=_flag("RDQ_EVENTS_INCLUDE_PAYLOAD"),
                   source=os.environ.get("RDQ_EVENT_SOURCE", "").strip() or "rdq", bus=bus)

    @property
    def settled_statuses(self) -> tuple[str, ...]:
        """The statuses a settle writes a task event for (``TaskStatus`` values)."""
        if not self.enabled:
            return ()
        return ("DEAD", "SUCCEEDED") if self.succeeded else ("DEAD",)

    @property
    def redriven(self) -> bool:
        """Whether a redrive writes ``rdq.task.redriven`` per task."""
        return self.enabled


@dataclass(frozen=True)
class OutboxEvent:
    """One event as the outbox keeps it: ``detail`` holds the facts the store wrote with the
    change (task events: handler, attempt, redrive_count, error, payload when included)."""

    id: str
    type: str
    queue: str
    task_id: str | None
    at: datetime
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The event as EventBridge's ``Detail`` (and the dev route) carries it."""
        body: dict[str, Any] = {"id": self.id, "type": self.type, "queue": self.queue, "at": self.at.isoformat()}
        if self.task_id is not None:
            body["task_id"] = self.task_id
        detail = dict(self.detail)
        if detail.get("payload") is None:
            detail.pop("payload", None)  # left out (the default) or none
        error = detail.get("error")
        if isinstance(error, Mapping):
            # The type and a bounded message; never the stack (it names files and lines).
            message = str(error.get("message") or "")
            detail["error"] = {"type": error.get("type"), "message": message[:MAX_ERROR_MESSAGE_CHARS],
                               "truncated": len(message) > MAX_ERROR_MESSAGE_CHARS}
        body.update((key, value) for key, value in detail.items() if key not in body)
        return body


def task_event_id(task_id: str, kind: str, number: int, incarnation: str | int) -> str:
    """The id of a task event: ``kind`` is ``dead``, ``succeeded`` or ``redriven``; ``number``
    the attempt number (a redrive: the redrive count after it); ``incarnation`` the stamp the
    task was created with (see the module's docstring).

    The SQL and Lua stores build the same text inside the write that changes the task; the id
    is stored with the event, so every redelivery carries it unchanged."""
    return f"{task_id}:{kind}:{number}:{incarnation}"


def operation_finished_event(operation: Any) -> OutboxEvent:
    """``rdq.operation.finished`` for an operation (``rdq_core.engine.operations.Operation``) as it ends."""
    return OutboxEvent(
        id=f"op:{operation.id}:finished", type=OPERATION_FINISHED, queue=operation.queue, task_id=None,
        at=operation.finished_at,
        detail={"operation_id": operation.id, "kind": operation.action, "status": operation.status,
                "matched": operation.matched, "done": operation.done, "selection": dict(operation.selection),
                "started_at": None if operation.started_at is None else operation.started_at.isoformat(),
                "finished_at": operation.finished_at.isoformat()},
    )
