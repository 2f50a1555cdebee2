"""Reaping expired leases: a dead worker's claim becomes an ordinary failed attempt.

For each IN_FLIGHT task whose lease expired by the backend clock, the reaper records one
synthetic ``LEASE_EXPIRED`` attempt (numbered from history) and reschedules the task with
backoff, or dead-letters it when its budget is spent -- the same policy as any failure, not an
immediate hand-off. The settle is fenced by the token the task was held under, so racing
reapers, or a worker that extended its lease just in time, can never produce a second row.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from .errors import SchemaMissing, StaleClaim, StorageUnavailable
from .model import TaskStatus
from .outage import ReconnectBackoff, StorageHealth
from .retry import PolicyBook
from .outcomes import lease_expired, log_outcome
from .storage.spi import Storage
from .telemetry import Telemetry

log = logging.getLogger("rdq.reaper")


@dataclass
class ReapReport:
    expired: int = 0
    rescheduled: int = 0
    dead_lettered: int = 0
    contended: int = 0
    batches: int = 0


def reap_expired_leases(
    storage: Storage,
    policies: PolicyBook | None = None,
    *,
    batch_size: int = 100,
    deadline: float = math.inf,
    queue: str | None = None,
    telemetry: Telemetry | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ReapReport:
    """Reap in bounded batches until none is left or the deadline (on ``clock``) passes."""
    policies = policies or PolicyBook()
    report = ReapReport()
    while clock() < deadline:
        expired = storage.find_expired_leases(batch_size, queue=queue)
        if not expired:
            break
        report.batches += 1
        settlements = [lease_expired(item, policies) for item in expired]
        refused: set[str] = set()
        try:
            storage.settle(settlements)
        except StaleClaim as exc:
            # Another reaper got there first, or the worker renewed its lease in time.
            refused = set(exc.task_ids)
        tasks = {item.task.id: item.task for item in expired}
        dead_in_batch = 0
        for s in settlements:
            if s.task_id in refused:
                report.contended += 1
                continue
            log_outcome(tasks[s.task_id], s, policies, None)
            report.expired += 1
            if s.status is TaskStatus.DEAD:
                report.dead_lettered += 1
                dead_in_batch += 1
            else:
                report.rescheduled += 1
        if telemetry:
            telemetry.count("lease_expired", len(settlements) - len(refused))
            # A lease that expired on the last attempt dead-letters its task: counted with every
            # other dead-lettering, so the dead-lettered rate covers both ways a task dies.
            telemetry.count("dead_lettered", dead_in_batch)
        if len(expired) < batch_size:
            break
    if report.expired:
        log.info(
            "reaped %d expired lease(s): %d rescheduled, %d dead-lettered",
            report.expired, report.rescheduled, report.dead_lettered,
        )
    return report


def reap_forever(
    storage: Storage,
    policies: PolicyBook | None = None,
    *,
    interval: float = 5.0,
    batch_size: int = 100,
    should_stop: Callable[[], bool] = lambda: False,
    between_passes: Callable[[], object] = lambda: None,
    telemetry: Telemetry | None = None,
    max_backoff: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> None:
    """The long-running reaper: a pass every ``interval`` seconds until ``should_stop``.

    A storage outage does not end it: it logs one line when the outage starts, backs off
    (0.5 s doubling to ``max_backoff``) instead of hammering the store, and one line when the
    store answers again. ``between_passes`` runs after each successful pass (retention).
    """
    health = StorageHealth(log, clock=clock)
    backoff = ReconnectBackoff(max_backoff)
    while not should_stop():
        try:
            reap_expired_leases(storage, policies, batch_size=batch_size, telemetry=telemetry)
            between_passes()
        except (StorageUnavailable, SchemaMissing) as exc:
            health.failed("reaper", exc)
            pause = backoff.next()
        else:
            health.ok()
            backoff.reset()
            pause = interval
        wake_at = clock() + pause
        while not should_stop() and clock() < wake_at:
            sleep(min(0.05, pause))
