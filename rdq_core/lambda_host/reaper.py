"""The reaper function: reap expired leases in bounded batches, then publish queue gauges.

Gauges per queue (dimension ``queue``) and totals (dimension ``service`` only, which the
template's alarms watch): ``QueueDepth`` (pending), ``DeadTasks``, ``OldestPendingAge`` (seconds).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from aws_lambda_powertools.metrics import MetricUnit

from ..events import DeliveryReport, EventSettings, Publisher, deliver_events, publisher_from_settings
from ..operations import drive_operations
from ..reaper import reap_expired_leases
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
    report = reap_expired_leases(
        storage, settings.policy_book(), batch_size=settings.reaper_batch_size, deadline=deadline,
        telemetry=MetricsTelemetry(), clock=clock,
    )
    depth = dead = 0
    oldest = 0.0
    queues = storage.list_queues()
    for queue in queues:
        if clock() >= deadline:
            break
        stats = storage.stats(queue)
        depth += stats.pending
        dead += stats.dead
        oldest = max(oldest, stats.oldest_pending_age_seconds)
        publish_queue_gauge(queue, "QueueDepth", stats.pending)
        publish_queue_gauge(queue, "DeadTasks", stats.dead)
        publish_queue_gauge(queue, "OldestPendingAge", stats.oldest_pending_age_seconds, MetricUnit.Seconds)
    add_metric("QueueDepth", MetricUnit.Count, depth)
    add_metric("DeadTasks", MetricUnit.Count, dead)
    add_metric("OldestPendingAge", MetricUnit.Seconds, oldest)
    # Bulk operations (redrive, purge, cancel as jobs) advance in what is left of the invocation,
    # capped so the next scheduled reaping is not delayed, and leaving the events their share.
    publisher = event_publisher()
    event_share = settings.event_seconds if publisher is not None else 0.0
    operations = drive_operations(storage, deadline=min(deadline - event_share, clock() + settings.operation_seconds),
                                  clock=clock)
    # Then the outbox (operations' own rdq.operation.finished included), bounded the same way.
    delivery = DeliveryReport() if publisher is None else deliver_events(
        storage, publisher, deadline=min(deadline, clock() + settings.event_seconds), clock=clock)
    summary = {
        "expired": report.expired, "rescheduled": report.rescheduled, "dead_lettered": report.dead_lettered,
        "contended": report.contended, "batches": report.batches, "queues": len(queues),
        "pending": depth, "dead": dead, "oldest_pending_age_seconds": oldest,
        "operation_chunks": operations.chunks, "operation_tasks": operations.acted,
        "operations_finished": len(operations.finished),
        "events_delivered": delivery.delivered, "events_refused": delivery.refused, "events_left": delivery.left,
    }
    log_invocation("reaper invocation done", summary, busy=bool(report.expired))
    return summary


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
