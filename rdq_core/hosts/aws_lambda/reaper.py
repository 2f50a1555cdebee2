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
chunks of ``maintenance.RETENTION_CHUNK`` for at most ``RDQ_RETENTION_SECONDS`` of the pass, and
deletes the payload and result objects of the purged ones (``maintenance.apply_retention``). The
steps and their order are the maintenance pass every host runs (``rdq_core.engine.maintenance``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Callable

from aws_lambda_powertools.metrics import MetricUnit

from ...aws.eventbridge import publisher_from_settings
from ...events import EventSettings, OutboxEvent
from ...engine.outbox import DeliveryReport, Publisher
from ...engine.maintenance import MaintenancePlan, retention_hours_from_env, run_maintenance
from ...engine.operations import DriveReport
from ...engine.reaper import ReapReport
from ...storage.spi import Storage
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
    gauges = _Gauges()
    # The pass every host runs (rdq_core/engine/maintenance.py), each step guarded: a bad operation never
    # stops delivery, nor a bad event retention. The gauges read the state reaping left. Bulk
    # operations advance in what is left of the invocation, capped so the next scheduled reaping is
    # not delayed, and leaving the events their share; retention only where it is asked for
    # (RDQ_RETENTION_HOURS); otherwise `rdq reaper` runs it.
    plan = MaintenancePlan(
        policies=settings.policy_book(), reap_batch_size=settings.reaper_batch_size, publisher=publisher,
        retention_hours=retention_hours_from_env(), operation_seconds=settings.operation_seconds,
        event_seconds=settings.event_seconds, retention_seconds=settings.retention_seconds,
        host_steps=[("gauges", lambda until: gauges.publish(storage, until, clock))])
    report = run_maintenance(storage, plan, deadline=deadline, clock=clock, telemetry=MetricsTelemetry()).passed
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
