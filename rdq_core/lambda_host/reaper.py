"""The reaper function, one maintenance pass per invocation: reap expired leases in bounded
batches, publish queue gauges, advance bulk operations, deliver the outbox, and (when
``RDQ_RETENTION_HOURS`` is set) apply retention. Each step is guarded: one that raises is logged
and the rest of the pass still runs.

Gauges per queue (dimension ``queue``) and totals (dimension ``service`` only, which the
template's alarms watch): ``QueueDepth`` (pending), ``DeadTasks``, ``OldestPendingAge`` (seconds).
A queue's gauges are published only while it has live work (pending, in flight or dead): each
metric costs money per month, and a queue used once must not cost it forever. Its last published
values are zero, so a graph or alarm does not hold the last non-zero reading.

With an event bus, ``OutboxUndeliveredAge`` (seconds, dimension ``service``): the age of the
oldest outbox event the pass took and could not deliver, 0 when it delivered all it took; the
template's outbox alarm watches it.

Retention (``RDQ_RETENTION_HOURS``, the template's ``RetentionHours``) purges finished tasks in
chunks of ``RETENTION_CHUNK`` for at most ``RDQ_RETENTION_SECONDS`` of the pass, and deletes the
payload and result objects of the purged ones (``payloads.purge_finished_tasks``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Callable

from aws_lambda_powertools.metrics import MetricUnit

from .. import payloads
from ..events import DeliveryReport, EventSettings, OutboxEvent, Publisher, deliver_events, publisher_from_settings
from ..operations import DriveReport, drive_operations
from ..reaper import ReapReport, maintenance_pass, reap_expired_leases
from ..storage.spi import Storage
from .connection import shared_storage
from .invocation import InvocationClock, ModulePin, configured_timeout
from .observability import MetricsTelemetry, add_metric, log_invocation, logger, metrics, publish_queue_gauge, tracer
from .settings import Settings


def run_reaper_invocation(
    event: dict[str, Any], context: Any, settings: Settings | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    settings = settings or Settings.from_env()
    invocation = InvocationClock(context, configured_timeout(), clock)
    storage = shared_storage(settings)
    deadline = invocation.check() - settings.settle_reserve_seconds
    configured = event_publisher()
    publisher = None if configured is None else _UndeliveredAge(configured)
    event_share = settings.event_seconds if publisher is not None else 0.0
    retention_hours = _retention_hours()
    gauges = _Gauges()
    # Each step is guarded (rdq_core.reaper.maintenance_pass): one that raises is logged and the
    # next still runs, so a bad operation never stops delivery, nor a bad event retention.
    report = maintenance_pass([
        ("reap", lambda: reap_expired_leases(
            storage, settings.policy_book(), batch_size=settings.reaper_batch_size, deadline=deadline,
            telemetry=MetricsTelemetry(), clock=clock)),
        ("gauges", lambda: gauges.publish(storage, deadline, clock)),
        # Bulk operations (redrive, purge, cancel as jobs) advance in what is left of the invocation,
        # capped so the next scheduled reaping is not delayed, and leaving the events their share.
        ("operations", lambda: drive_operations(
            storage, deadline=min(deadline - event_share, clock() + settings.operation_seconds), clock=clock)),
        # Then the outbox (operations' own rdq.operation.finished included), bounded the same way.
        ("events", lambda: DeliveryReport() if publisher is None else deliver_events(
            storage, publisher, deadline=min(deadline, clock() + settings.event_seconds), clock=clock)),
        # Retention only where it is asked for (RDQ_RETENTION_HOURS); otherwise `rdq reaper` runs it.
        ("retention", lambda: 0 if retention_hours is None else _apply_retention(
            storage, retention_hours, min(deadline, clock() + settings.retention_seconds), clock)),
    ])
    reaped: ReapReport = report.result("reap", ReapReport())
    operations: DriveReport = report.result("operations", DriveReport())
    delivery: DeliveryReport = report.result("events", DeliveryReport())
    if publisher is not None and "events" not in report.failed:
        add_metric("OutboxUndeliveredAge", MetricUnit.Seconds, publisher.oldest_undelivered_age())
    summary = {
        "expired": reaped.expired, "rescheduled": reaped.rescheduled, "dead_lettered": reaped.dead_lettered,
        "contended": reaped.contended, "batches": reaped.batches, "queues": gauges.queues,
        "queues_with_gauges": gauges.published,
        "pending": gauges.depth, "dead": gauges.dead, "oldest_pending_age_seconds": gauges.oldest,
        "operation_chunks": operations.chunks, "operation_tasks": operations.acted,
        "operations_finished": len(operations.finished), "operations_failed": len(operations.failed),
        "events_delivered": delivery.delivered, "events_refused": delivery.refused, "events_left": delivery.left,
        "retention_deleted": report.result("retention", 0), "failed_steps": sorted(report.failed),
    }
    log_invocation("reaper invocation done", summary, busy=bool(reaped.expired))
    return summary


class _Gauges:
    """Queue gauges per queue (dimension ``queue``) and totals; a queue whose stats cannot be read
    is logged and left out, and the others are still published. Only queues with live work get
    per-queue gauges; one that has just lost its live work gets zeros once, then nothing."""

    def __init__(self) -> None:
        self.depth = self.dead = self.queues = self.published = 0
        self.oldest = 0.0

    def publish(self, storage: Storage, deadline: float, clock: Callable[[], float]) -> None:
        queues = storage.list_queues()
        self.queues = len(queues)
        live: set[str] = set()
        for queue in queues:
            if clock() >= deadline:
                live |= _live_queues & set(queues)  # not read this pass: not taken as idle either
                break
            try:
                # Live work only (index-served): a queue's finished tasks are never read here.
                stats = storage.live_stats(queue)
            except Exception as exc:  # noqa: BLE001 - one queue must not hide the others' gauges
                logger.error("queue stats failed", extra={"queue": queue, "error_type": type(exc).__name__})
                if queue in _live_queues:
                    live.add(queue)
                continue
            self.depth += stats.pending
            self.dead += stats.dead
            self.oldest = max(self.oldest, stats.oldest_pending_age_seconds)
            if stats.live:
                live.add(queue)
            elif queue not in _live_queues:
                continue  # idle, and its zeros already published (or it never had gauges here)
            self.published += 1
            publish_queue_gauge(queue, "QueueDepth", stats.pending)
            publish_queue_gauge(queue, "DeadTasks", stats.dead)
            publish_queue_gauge(queue, "OldestPendingAge", stats.oldest_pending_age_seconds, MetricUnit.Seconds)
        _live_queues.clear()
        _live_queues.update(live)
        add_metric("QueueDepth", MetricUnit.Count, self.depth)
        add_metric("DeadTasks", MetricUnit.Count, self.dead)
        add_metric("OldestPendingAge", MetricUnit.Seconds, self.oldest)


#: Queues this container published gauges for on its last pass (kept while the container is warm).
_live_queues: set[str] = set()


def _retention_hours() -> float | None:
    """``RDQ_RETENTION_HOURS`` when set to a positive number: finished tasks older than that are
    deleted by this function too. Unset (the default), retention is left to ``rdq reaper``."""
    text = os.environ.get("RDQ_RETENTION_HOURS", "").strip()
    if not text:
        return None
    try:
        hours = float(text)
    except ValueError:
        logger.error("RDQ_RETENTION_HOURS is not a number; retention skipped", extra={"value": text[:40]})
        return None
    return hours if math.isfinite(hours) and hours > 0 else None


#: Finished tasks purged per store round trip by retention.
RETENTION_CHUNK = 1000


def _apply_retention(storage: Storage, hours: float, deadline: float, clock: Callable[[], float]) -> int:
    """Chunks until nothing is that old or the share of the pass is spent; the rest waits for the
    next tick. Lanes found with nothing that old are not read again in this pass."""
    purged = 0
    idle_lanes: set[tuple[str, str]] = set()
    while clock() < deadline and (batch := payloads.purge_finished_tasks(
            storage, hours * 3600, RETENTION_CHUNK, idle_lanes=idle_lanes)):
        purged += batch
    return purged


class _UndeliveredAge:
    """The pass's publisher, noting each event it was given and did not deliver (one refused and
    then accepted on a retry within the pass is not counted): refused events stay in the outbox
    and are taken again on a later pass, so their age is how long delivery has been failing."""

    def __init__(self, inner: Publisher) -> None:
        self._inner = inner
        self._undelivered: dict[str, datetime] = {}

    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        try:
            accepted = self._inner.publish(events)
        except Exception:
            self._note(events, [False] * len(events))
            raise
        self._note(events, accepted)
        return accepted

    def _note(self, events: Sequence[OutboxEvent], accepted: Sequence[bool]) -> None:
        for event, ok in zip(events, accepted, strict=False):
            if ok:
                self._undelivered.pop(event.id, None)
            else:
                self._undelivered[event.id] = event.at if event.at.tzinfo else event.at.replace(tzinfo=timezone.utc)

    def oldest_undelivered_age(self) -> float:
        if not self._undelivered:
            return 0.0
        return max(0.0, (datetime.now(timezone.utc) - min(self._undelivered.values())).total_seconds())


#: Where the outbox is delivered: EventBridge when ``RDQ_EVENT_BUS`` is set (made on first use and
#: kept by the container); ``rdq dev`` puts its ``LogPublisher`` here. None: no delivery.
publisher: Publisher | None = None


def event_publisher() -> Publisher | None:
    global publisher
    if publisher is None:
        publisher = publisher_from_settings(EventSettings.from_env())
    return publisher


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler(capture_response=False)
@metrics.log_metrics
def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    _modules.restore()  # before the lazy imports: the storage driver
    return run_reaper_invocation(event, context)


#: Taken last, when every module this entry point needs is loaded.
_modules = ModulePin(__name__)
