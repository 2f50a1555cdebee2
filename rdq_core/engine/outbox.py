"""Delivering the outbox: lifecycle events (``rdq_core/events.py``) taken from the store in leased
batches, handed to a publisher, and removed once accepted -- at least once.

The maintenance pass runs ``deliver_events`` with the host's publisher: EventBridge
(``rdq_core/aws/eventbridge.py``) when a bus is configured, ``LogPublisher`` under ``rdq dev``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..aws.eventbridge import PUT_EVENTS_MAX_ENTRIES
from ..events import OutboxEvent

# The logger lifecycle events have always used, whichever module now writes the line.
log = logging.getLogger("rdq_core.events")

#: How long a taken batch stays leased to its deliverer before another may take it.
DEFAULT_LEASE_SECONDS = 60.0


class Outbox(Protocol):
    """What delivery needs of a store: the outbox half of the storage SPI (``Storage`` has it);
    a test's stand-in need implement nothing else."""

    def take_events(self, limit: int, *, lease_seconds: float) -> list[OutboxEvent]: ...

    def ack_events(self, ids: Sequence[str]) -> int: ...


class Publisher(Protocol):
    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        """Send up to ``PUT_EVENTS_MAX_ENTRIES`` events; whether each was accepted, in order.
        An exception means none was."""


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
