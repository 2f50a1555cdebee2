"""Lifecycle events: what rdq tells the rest of the account, through a transactional outbox.

A state change that others may react to writes an *event* into the store's outbox **in the same
atomic step** as the change itself (the settle statement or script, the redrive statement or
script; MongoDB: on the task document in the same update, moved to the outbox collection right
after). The reaper then delivers the outbox in batches (``deliver_events``) to EventBridge and
removes an event only once EventBridge accepted it, so delivery is **at least once**: a crash
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

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping, Protocol, Sequence

log = logging.getLogger(__name__)

TASK_DEAD = "rdq.task.dead"
TASK_REDRIVEN = "rdq.task.redriven"
TASK_SUCCEEDED = "rdq.task.succeeded"
OPERATION_FINISHED = "rdq.operation.finished"
EVENT_TYPES = (TASK_DEAD, TASK_REDRIVEN, TASK_SUCCEEDED, OPERATION_FINISHED)

#: PutEvents takes at most this many entries per call.
PUT_EVENTS_MAX_ENTRIES = 10
#: EventBridge refuses an entry above 256 KB (Source + DetailType + Detail + …); rdq keeps each
#: entry's Detail well under it so the other fields always fit.
MAX_DETAIL_BYTES = 250_000
#: An error message in an event is cut to this many characters (the task keeps it whole).
MAX_ERROR_MESSAGE_CHARS = 2048
#: How long a taken batch stays leased to its deliverer before another may take it.
DEFAULT_LEASE_SECONDS = 60.0


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


def detail_json(event: OutboxEvent) -> str:
    """The ``Detail`` text, under EventBridge's entry limit: a payload that would not fit is
    dropped and said so."""
    body = event.to_dict()
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_DETAIL_BYTES and "payload" in body:
        body["payload"] = None
        body["payload_omitted"] = "too large for an event"
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return text


def put_events_entry(event: OutboxEvent, settings: EventSettings) -> dict[str, Any]:
    entry: dict[str, Any] = {"Source": settings.source, "DetailType": event.type, "Detail": detail_json(event),
                             "Time": event.at}
    if settings.bus:
        entry["EventBusName"] = settings.bus
    return entry


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


# -- delivery ------------------------------------------------------------------------------------
class Outbox(Protocol):
    """What delivery needs of a store: the outbox half of the storage SPI (``Storage`` has it).
    Named here so that this module, which the storage SPI imports for its event types, does not
    import the SPI back."""

    def take_events(self, limit: int, *, lease_seconds: float) -> list[OutboxEvent]: ...

    def ack_events(self, ids: Sequence[str]) -> int: ...


class Publisher(Protocol):
    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        """Send up to ``PUT_EVENTS_MAX_ENTRIES`` events; whether each was accepted, in order.
        An exception means none was."""


class EventBridgePublisher:
    """``PutEvents`` with short timeouts and one botocore attempt per call: retries are
    ``deliver_events``'s, bounded by the reaper's deadline, so a slow EventBridge never holds the
    reaper past its budget."""

    def __init__(self, settings: EventSettings, client: Any = None) -> None:
        self.settings = settings
        if client is None:
            from .aws.clients import aws_client

            client = aws_client("events")
        self.client = client

    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        reply = self.client.put_events(Entries=[put_events_entry(e, self.settings) for e in events])
        results = reply.get("Entries") or []
        # An entry without an ErrorCode was accepted (it carries an EventId).
        accepted = [not result.get("ErrorCode") and bool(result.get("EventId")) for result in results]
        if len(accepted) != len(events):
            return [False] * len(events)
        for event, result in zip(events, results, strict=True):
            if result.get("ErrorCode"):
                log.warning("event not accepted", extra={"event": event.id, "error_code": result.get("ErrorCode"),
                                                         "error_message": result.get("ErrorMessage")})
        return accepted


class LogPublisher:
    """``rdq dev``: each event is one log line and stays readable (``GET /v1/events``) in a
    bounded in-memory buffer, numbered in delivery order."""

    def __init__(self, keep: int = 1000) -> None:
        self._lock = threading.Lock()
        self._delivered: deque[tuple[int, dict[str, Any]]] = deque(maxlen=keep)
        self._sequence = 0

    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        with self._lock:
            for event in events:
                self._sequence += 1
                self._delivered.append((self._sequence, event.to_dict()))
                log.info("event %s %s queue=%s task=%s", event.type, event.id, event.queue, event.task_id or "-")
        return [True] * len(events)

    def page(self, after: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """Delivered events numbered above ``after``, oldest first, and the last number given."""
        with self._lock:
            found = [{"seq": seq, **body} for seq, body in self._delivered if seq > after][:limit]
            return found, (found[-1]["seq"] if found else max(after, 0))


@dataclass
class DeliveryReport:
    delivered: int = 0
    #: Entries EventBridge refused (or calls that failed), counted per try.
    refused: int = 0
    #: Events still in the outbox when the pass ended (delivered on a later pass).
    left: int = 0
    calls: int = 0


def deliver_events(
    storage: Outbox, publisher: Publisher, *, deadline: float, clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep, lease_seconds: float = DEFAULT_LEASE_SECONDS,
    first_backoff_seconds: float = 0.2, tries_per_batch: int = 4,
) -> DeliveryReport:
    """Deliver the outbox until it is empty or ``deadline`` (on ``clock``) comes: take a leased
    batch, publish it (failed entries again, with backoff, up to ``tries_per_batch`` calls),
    remove exactly what was accepted. What is left stays leased until ``lease_seconds`` pass,
    then any deliverer takes it again; meanwhile the next batch goes, so an entry EventBridge
    keeps refusing never holds up the others."""
    report = DeliveryReport()
    while clock() < deadline:
        events = storage.take_events(PUT_EVENTS_MAX_ENTRIES, lease_seconds=lease_seconds)
        if not events:
            break
        waiting, backoff, tries = list(events), first_backoff_seconds, 0
        while waiting and clock() < deadline and tries < tries_per_batch:
            tries += 1
            report.calls += 1
            try:
                accepted = publisher.publish(waiting)
            except Exception as exc:  # noqa: BLE001 - the service or the network: the whole batch again
                log.warning("event delivery failed: %s: %s", type(exc).__name__, exc)
                accepted = [False] * len(waiting)
            done = [event.id for event, ok in zip(waiting, accepted, strict=True) if ok]
            if done:
                storage.ack_events(done)
                report.delivered += len(done)
            waiting = [event for event, ok in zip(waiting, accepted, strict=True) if not ok]
            if waiting:
                report.refused += len(waiting)
                pause = min(backoff, deadline - clock())
                if pause > 0 and tries < tries_per_batch:
                    sleep(pause)
                backoff *= 2
        report.left += len(waiting)
    return report


def publisher_from_settings(settings: EventSettings) -> Publisher | None:
    """EventBridge when a bus is configured; None (no delivery) otherwise."""
    return EventBridgePublisher(settings) if settings.enabled and settings.bus else None
