"""One maintenance pass for every host: the Lambda reaper (and ``rdq dev``, which invokes it),
``rdq reaper`` and ``rdq worker`` run the same steps, in the same order, each guarded.

1. **reap** -- expired leases become ``LEASE_EXPIRED`` attempts (``rdq_core.engine.reaper``): first,
   because a dead worker's tasks waiting is what every other step is least worth;
2. the host's own steps, if any (the Lambda reaper's queue gauges read the state reaping left);
3. **operations** -- bulk redrive, purge and cancel jobs advance at their own rate;
4. **events** -- the outbox is delivered, the operations' own ``rdq.operation.finished`` included;
5. **metrics** -- the console's per-minute rollup takes what finished since the last pass
   (where the store keeps one);
6. **retention** -- finished tasks older than the retention are deleted with their payload
   objects, last, because nothing waits for it.

Each step runs under ``maintenance_pass``: one that raises is logged and the next still runs, so
a poisoned operation never stops delivery, nor a refused event retention. Only a store that
cannot be reached ends the pass after reaping: every other step would meet the same outage. Each host chooses the
time a step may take (``MaintenancePlan``) within the pass's deadline; what a step leaves is
taken up by the next pass.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import payload_retention
from ..errors import UnsupportedOperation
from .outbox import DeliveryReport, Publisher, deliver_events
from .operations import drive_operations
from .reaper import PassReport, ReapReport, maintenance_pass, reap_expired_leases, store_outage
from .retry import PolicyBook
from ..storage.spi import Storage
from .telemetry import Telemetry

log = logging.getLogger("rdq.reaper")

#: Finished tasks deleted per retention statement (bounded so one pass never holds a long lock).
RETENTION_CHUNK = 1000

#: The steps in the order every host runs them (a host's own steps go after ``reap``).
STEP_ORDER = ("reap", "operations", "events", "metrics", "retention")


@dataclass(frozen=True)
class MaintenancePlan:
    """What one host's pass does, and how long each step may take (seconds, within the pass)."""

    policies: PolicyBook = field(default_factory=PolicyBook)
    reap_batch_size: int = 100
    #: Queues to reap (``None``: every queue).
    reap_queues: Sequence[str | None] = (None,)
    #: Where the outbox goes; ``None``: events stay in the outbox for a host that has a publisher.
    publisher: Publisher | None = None
    #: Finished tasks older than this are deleted; ``None``: no retention in this host.
    retention_hours: float | None = None
    operation_seconds: float = 40.0
    event_seconds: float = 10.0
    retention_seconds: float = 10.0
    #: Steps of the host's own, run after reaping, each given the pass's deadline.
    host_steps: Sequence[tuple[str, Callable[[float], Any]]] = ()


@dataclass
class MaintenanceReport:
    """What a pass did, step by step; ``failed`` names the steps that raised."""

    passed: PassReport

    @property
    def reaped(self) -> ReapReport:
        return self.passed.result("reap", ReapReport())  # type: ignore[no-any-return]

    @property
    def delivery(self) -> DeliveryReport:
        return self.passed.result("events", DeliveryReport())  # type: ignore[no-any-return]

    @property
    def retention_deleted(self) -> int:
        return int(self.passed.result("retention", 0) or 0)

    @property
    def failed(self) -> dict[str, BaseException]:
        return self.passed.failed


def run_maintenance(storage: Storage, plan: MaintenancePlan, *, deadline: float,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep,
                    telemetry: Telemetry | None = None,
                    stopping: Callable[[], bool] = lambda: False) -> MaintenanceReport:
    """One pass of every step in ``STEP_ORDER`` (plus the host's own after reaping), each
    guarded, none past ``deadline`` (a ``clock()`` instant); ``stopping`` ends the long steps
    early (a host shutting down)."""

    def reap() -> ReapReport:
        total = ReapReport()
        for queue in plan.reap_queues:
            report = reap_expired_leases(storage, plan.policies, batch_size=plan.reap_batch_size, deadline=deadline,
                                         queue=queue, telemetry=telemetry, clock=clock)
            for name in ("expired", "rescheduled", "dead_lettered", "contended", "batches", "failed"):
                setattr(total, name, getattr(total, name) + getattr(report, name))
        return total

    def bounded(seconds: float, reserve: float = 0.0) -> float:
        return min(deadline - reserve, clock() + seconds)

    def stoppable_clock() -> float:
        # A stopping host ends a long step at its next check, as if its time were spent.
        return math.inf if stopping() else clock()

    reaping = maintenance_pass([("reap", reap)])
    if store_outage(reaping) is not None:
        return MaintenanceReport(reaping)  # the other steps would only meet the same outage
    event_reserve = plan.event_seconds if plan.publisher is not None else 0.0
    steps: list[tuple[str, Callable[[], Any]]] = [
        (name, functools.partial(step, deadline)) for name, step in plan.host_steps]
    steps += [
        ("operations", lambda: drive_operations(
            storage, deadline=bounded(plan.operation_seconds, event_reserve), clock=stoppable_clock,
            sleep=lambda seconds: sleep(min(seconds, 0.5)))),
        ("events", lambda: DeliveryReport() if plan.publisher is None else deliver_events(
            storage, plan.publisher, deadline=bounded(plan.event_seconds), clock=clock)),
        ("metrics", lambda: _roll_up_metrics(storage)),
        ("retention", lambda: 0 if plan.retention_hours is None else apply_retention(
            storage, plan.retention_hours, bounded(plan.retention_seconds), stoppable_clock)),
    ]
    rest = maintenance_pass(steps)
    reaping.results.update(rest.results)
    reaping.failed.update(rest.failed)
    return MaintenanceReport(reaping)


def apply_retention(storage: Storage, hours: float, deadline: float, clock: Callable[[], float]) -> int:
    """Delete finished tasks older than ``hours``, with their payload objects, in chunks until
    nothing is that old or ``deadline`` passes; the rest waits for the next pass. Lanes found with
    nothing that old are not read again in this pass."""
    purged = 0
    idle_lanes: set[tuple[str, str]] = set()
    while clock() < deadline and (batch := payload_retention.purge_finished_tasks(
            storage, hours * 3600, RETENTION_CHUNK, idle_lanes=idle_lanes)):
        purged += batch
    if purged:
        log.info("retention: deleted %d finished task(s) older than %gh", purged, hours)
    return purged


def retention_hours_from_env() -> float | None:
    """``RDQ_RETENTION_HOURS`` when set to a positive number; ``None`` (no retention in this host)
    when unset, zero or not a number (logged)."""
    text = os.environ.get("RDQ_RETENTION_HOURS", "").strip()
    if not text:
        return None
    try:
        hours = float(text)
    except ValueError:
        log.error("RDQ_RETENTION_HOURS is not a number; retention skipped", extra={"value": text[:40]})
        return None
    return hours if math.isfinite(hours) and hours > 0 else None


def _roll_up_metrics(storage: Storage) -> Any:
    try:
        return storage.roll_up_metrics()
    except UnsupportedOperation:  # a store without the rollup (a third-party backend) has nothing to do
        return None
