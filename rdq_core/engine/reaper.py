"""Reaping expired leases: a dead worker's claim becomes an ordinary failed attempt.

For each IN_FLIGHT task whose lease expired by the backend clock, the reaper records one
synthetic ``LEASE_EXPIRED`` attempt (numbered from history) and reschedules the task with
backoff, or dead-letters it when its budget is spent -- the same policy as any failure, not an
immediate hand-off. The settle is fenced by the token the task was held under, so racing
reapers, or a worker that extended its lease just in time, can never produce a second row.

Reaping is the first step of the maintenance pass (reap → advance operations → deliver the
outbox → retention, and among them the console's per-minute metrics, ``Storage.roll_up_metrics``),
which ``maintenance_pass`` runs with each step guarded: a step that raises is
logged (its name and the error's type, never a payload) and the next step runs. Within reaping,
one task whose settlement cannot be built or written is logged and skipped; the rest are reaped.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import SchemaMissing, StaleClaim, StorageUnavailable
from ..model import TaskStatus
from .outage import ReconnectBackoff, StorageHealth
from .retry import PolicyBook
from .outcomes import lease_expired, log_outcome
from ..storage.spi import Storage
from .telemetry import Telemetry

log = logging.getLogger("rdq.reaper")


@dataclass
class ReapReport:
    expired: int = 0
    rescheduled: int = 0
    dead_lettered: int = 0
    contended: int = 0
    batches: int = 0
    #: Tasks whose reaping raised (each logged; tried again by the next pass).
    failed: int = 0


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
    broken: set[str] = set()  # tasks that raised in this call: not tried again until the next one
    while clock() < deadline:
        found = storage.find_expired_leases(batch_size, queue=queue)
        expired = [item for item in found if item.task.id not in broken]
        if not expired:
            break
        report.batches += 1
        settlements = []
        for item in expired:
            try:
                settlements.append(lease_expired(item, policies))
            except Exception as exc:  # noqa: BLE001 - one task's bad policy or history must not stop the rest
                broken.add(item.task.id)
                _log_task_failure("reaping", item.task.id, item.task.queue, exc)
        refused = _settle_each_if_needed(storage, settlements, broken)
        tasks = {item.task.id: item.task for item in expired}
        dead_in_batch = 0
        for s in settlements:
            if s.task_id in broken:
                continue
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
        if len(found) < batch_size or len(expired) < len(found):
            # A short batch is the last; a batch that held a broken task would find it again.
            break
    report.failed = len(broken)
    if report.expired:
        log.info(
            "reaped %d expired lease(s): %d rescheduled, %d dead-lettered",
            report.expired, report.rescheduled, report.dead_lettered,
        )
    return report


def _settle_each_if_needed(storage: Storage, settlements: list[Any], broken: set[str]) -> set[str]:
    """Settle the batch in one call; when the store refuses it as a whole for a reason other than
    a stale claim, settle task by task so that one bad task only fails itself (added to
    ``broken``). The ids refused as stale (someone else got there first)."""
    if not settlements:
        return set()
    first: BaseException | None = None
    try:
        storage.settle(settlements)
        return set()
    except StaleClaim as exc:
        # Another reaper got there first, or the worker renewed its lease in time.
        return set(exc.task_ids)
    except Exception as exc:  # perhaps one bad task: found below, one by one
        if len(settlements) == 1:
            raise
        first = exc
    refused: set[str] = set()
    failures = 0
    for settlement in settlements:
        try:
            storage.settle([settlement])
        except StaleClaim as exc:
            refused |= set(exc.task_ids)
        except Exception as exc:  # noqa: BLE001 - this one task only
            failures += 1
            broken.add(settlement.task_id)
            _log_task_failure("reaping", settlement.task_id, None, exc)
    if failures == len(settlements):
        raise first  # not one task could be settled: the store itself, not a task
    return refused


def _log_task_failure(step: str, task_id: str, queue: str | None, exc: BaseException) -> None:
    log.error("%s failed for one task; the others go on", step, extra={
        "step": step, "task_id": task_id, "queue": queue, "error_type": type(exc).__name__, "error": _brief(exc)})


def _brief(exc: BaseException) -> str:
    """An error's message, cut short: a driver's message may quote a statement's parameters."""
    return str(exc)[:200]


# -- the maintenance pass ---------------------------------------------------------------------------
@dataclass
class PassReport:
    """What each step of one maintenance pass returned, and which steps raised."""

    results: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)

    def result(self, step: str, default: Any = None) -> Any:
        return self.results.get(step, default)


def maintenance_pass(steps: Sequence[tuple[str, Callable[[], Any]]]) -> PassReport:
    """Run the pass's steps in order, each guarded: a step that raises is logged (the step and the
    error's type; never a payload) and the next step still runs. Steps guard their own items too
    (a bad task in reaping, a bad operation in ``drive_operations``), so this is the backstop."""
    report = PassReport()
    for name, step in steps:
        try:
            report.results[name] = step()
        except Exception as exc:  # one step must never stop the others
            report.failed[name] = exc
            log.error("maintenance step %s failed; the pass goes on", name, extra={
                "step": name, "error_type": type(exc).__name__, "error": _brief(exc)},
                exc_info=log.isEnabledFor(logging.DEBUG))
    return report


def store_outage(report: PassReport) -> BaseException | None:
    """The error a pass met because the store could not be reached (or holds no schema), if any."""
    return next((exc for exc in report.failed.values() if isinstance(exc, (StorageUnavailable, SchemaMissing))), None)


def maintain_forever(
    run_pass: Callable[[], PassReport],
    *,
    interval: float = 5.0,
    should_stop: Callable[[], bool] = lambda: False,
    max_backoff: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
    who: str = "reaper",
) -> None:
    """Run ``run_pass`` every ``interval`` seconds until ``should_stop``.

    A storage outage does not end it: it logs one line when the outage starts, backs off (0.5 s
    doubling to ``max_backoff``) instead of hammering the store, and one line when the store
    answers again. A step that raises for any other reason was logged by the pass, which went on.
    """
    health = StorageHealth(log, clock=clock)
    backoff = ReconnectBackoff(max_backoff)
    while not should_stop():
        outage = store_outage(run_pass())
        if outage is not None:
            health.failed(who, outage)
            pause = backoff.next()
        else:
            health.ok()
            backoff.reset()
            pause = interval
        wake_at = clock() + pause
        while not should_stop() and clock() < wake_at:
            sleep(min(0.05, pause))


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
    """Reaping every ``interval`` seconds, through outages (``maintain_forever``); ``between_passes``
    runs after reaping in each pass unless the store is down. Hosts run the whole maintenance pass
    instead (``rdq_core.engine.maintenance``); this is reaping alone, for harnesses that want only it."""

    def one_pass() -> PassReport:
        report = maintenance_pass([
            ("reap", lambda: reap_expired_leases(storage, policies, batch_size=batch_size, telemetry=telemetry))])
        if store_outage(report) is None:
            rest = maintenance_pass([("between_passes", between_passes)])
            report.results.update(rest.results)
            report.failed.update(rest.failed)
        return report

    maintain_forever(one_pass, interval=interval, should_stop=should_stop, max_backoff=max_backoff, clock=clock,
                     sleep=sleep)
