"""The worker function: claim with an invocation-sized lease, run, settle, release, fan out.

Lease = the invocation's remaining time (``context.get_remaining_time_in_millis()``) + a grace
margin, recomputed at every claim. The lease therefore ends only after this invocation is
certainly over, so the reaper can never take a task from a live worker; if the invocation dies
(timeout, OOM), the reaper records LEASE_EXPIRED once the lease runs out.

The claim loop is the engine's (``rdq_core.engine.claiming``), shared with ``rdq worker``. Its
``BatchRunner`` starts a task only if its handler's ``timeout_seconds`` fits before
the deadline and releases the rest unstarted (no attempt spent). A task whose handler timeout
can never fit any invocation of this function (function timeout minus the settle reserve) is
dead-lettered on its first claim (``rdq.TimeoutExceedsWorker``) with a WARNING, so it cannot
sit at the head of a queue being claimed and released forever. The worker keeps claiming while
a round makes progress and time remains.

``HandlerConcurrency`` (``RDQ_HANDLER_CONCURRENCY``) runs that loop on as many threads at once
(``claiming.run_concurrently``, the code of ``rdq worker --concurrency``), each claiming its share
of ``BatchSize``; every claim is sized to what can plausibly start before the deadline
(``claiming.ClaimPace``), so a short invocation holds little it would only release.

Outcomes are settled within ``settle_interval`` of each task, and at the deadline (the
invocation's end minus the settle reserve) everything buffered is settled and every unstarted
claim released, even while a handler is still running: a handler that overruns the invocation
costs only its own task (LEASE_EXPIRED once its lease ends), never its batch neighbours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...engine.claiming import ClaimLoop, fitted_worker_name, per_thread_batch, run_concurrently
from ...client import Client
from ...errors import StorageUnavailable
from ...engine.handlers import registry
from ...engine.runner import BatchRunner
from ...storage.spi import Storage, WorkerSlot, WorkerStart
from .connection import shared_storage
from .invocation import InvocationClock, ModulePin, configured_timeout
from .invoker import FANOUT_SOURCE, WAKE_SOURCE, BackgroundInvocations, FleetStarts, invoker, workers_for_backlog
from .observability import LoggedRegistry, MetricsTelemetry, log_invocation, logger, metrics, tracer
from .settings import Settings


def _started_detail(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """The detail of an event from a fan-out or a wake-up ({} for any other event)."""
    if event.get("source") in (FANOUT_SOURCE, WAKE_SOURCE):
        detail = event.get("detail")
        if isinstance(detail, Mapping):
            return detail
    return {}


def _requested_queues(event: Mapping[str, Any]) -> tuple[str, ...]:
    queues = _started_detail(event).get("queues")
    if isinstance(queues, list):
        return tuple(q for q in queues if isinstance(q, str))
    return ()


def _take_slot(event: Mapping[str, Any], settings: Settings, storage: Storage, lease_seconds: float) -> WorkerSlot | None:
    """This invocation's slot: the one its starter reserved for it, if the event carries that
    reservation and it is still pending; otherwise any free slot."""
    start = WorkerStart.from_event(_started_detail(event).get("start"))
    if start is not None and start.fleet == settings.worker_fleet:
        slot = storage.take_reserved_worker_slot(start, lease_seconds)
        if slot is not None:
            return slot
    return storage.take_worker_slot(settings.worker_fleet, settings.max_worker_concurrency, lease_seconds)


def run_worker_invocation(
    event: Mapping[str, Any], context: Any, settings: Settings | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """The worker's whole job for one invocation; returns a summary (also logged)."""
    settings = settings or Settings.from_env()
    # The end is capped by the function timeout and re-checked below, once time has passed: a
    # remaining time that does not fall is not believed (see invocation.py).
    deadline = InvocationClock(context, configured_timeout(settings.worker_timeout_seconds), clock)
    registry.load_modules(settings.handler_modules)
    storage = shared_storage(settings)
    try:
        return _run_in_slot(event, settings, storage, deadline, clock, invocation_name(context))
    finally:
        _end_of_invocation(storage, settings)


def invocation_name(context: Any) -> str:
    """Who this invocation's claims say holds a running task (``Task.claimed_by``): the function,
    the request id and the log stream, which is what finds the invocation's logs in CloudWatch.
    The request id comes before the stream, so a name cut to length keeps it."""
    function = str(getattr(context, "function_name", "") or "")
    request = str(getattr(context, "aws_request_id", "") or "")
    stream = str(getattr(context, "log_stream_name", "") or "")
    return fitted_worker_name(function, f"request {request}" if request else "", f"log stream {stream}" if stream else "")


def _run_in_slot(event: Mapping[str, Any], settings: Settings, storage: Storage, deadline: InvocationClock,
                 clock: Callable[[], float], worker: str) -> dict[str, Any]:
    # An EventBridge Scheduler trigger (schedules.py) enqueues its period's task first, slot or
    # not: the firing is idempotent, and a full fleet must not drop it.
    fired = _fire_schedule(event, storage, deadline)
    invocation_end = deadline.check()
    # A slot of the fleet before any claim, however this invocation was started: the store, not
    # the number of invocations, caps the workers running. Leased like a task (the time left plus
    # the grace), so the slot of an invocation killed at its timeout comes back by itself.
    slot = _take_slot(event, settings, storage, _lease_seconds(invocation_end, settings, clock))
    if slot is None:
        summary: dict[str, Any] = {"slot": None, "claimed": 0, "started": 0, "released": 0, "too_long": 0,
                                   "outcomes": {}, "fanned_out": 0, **_fired_summary(fired)}
        log_invocation("worker invocation found every slot held", summary, busy=False)
        return summary
    try:
        summary = _work_holding_slot(event, settings, storage, deadline, fired, invocation_end, clock, worker)
    finally:
        _free_slot(storage, slot)
    summary["slot"] = slot.number
    # Its own slot is free again: what is left of the backlog gets workers now, not at the next
    # tick. An invocation that found nothing leaves without asking.
    if summary["claimed"] and _may_fan_out(settings):
        summary["fanned_out"] += _accepted(
            _fan_out(storage, tuple(summary["queues"]), settings, invocation_end, already_working=0),
            invocation_end, clock)
    # A tick that found nothing is the common case; keep it out of the INFO log.
    log_invocation("worker invocation done", summary, busy=bool(summary["claimed"]))
    return summary


def _work_holding_slot(
    event: Mapping[str, Any], settings: Settings, storage: Storage, deadline: InvocationClock,
    fired: "_FiredHere | None", invocation_end: float, clock: Callable[[], float], worker: str,
) -> dict[str, Any]:
    """Claim and run until the work deadline; the summary."""
    function_timeout = deadline.timeout_seconds
    telemetry = MetricsTelemetry()
    queues = settings.queues or _requested_queues(event) or ((fired.queue,) if fired else ()) \
        or tuple(storage.list_queues())
    summary: dict[str, Any] = {"queues": list(queues), "claimed": 0, "started": 0, "released": 0, "too_long": 0,
                               "outcomes": {}, "fanned_out": 0, **_fired_summary(fired)}
    if not queues:
        return summary

    work_deadline = invocation_end - settings.settle_reserve_seconds
    # Best-effort and in the background: the claims below never wait for it (invoker.py). A worker
    # started by a fan-out was counted by the one that started it.
    fan_out = _fan_out(storage, queues, settings, work_deadline, already_working=1) \
        if _may_fan_out(settings) and event.get("source") != FANOUT_SOURCE else None

    runner = BatchRunner(
        storage, settings.policy_book(), LoggedRegistry(registry), telemetry,
        lease_seconds=_lease_seconds(invocation_end, settings, clock),
        longest_run_seconds=function_timeout - settings.settle_reserve_seconds,
        longest_run_reason=f"the worker function's {function_timeout:g}s timeout minus its "
                           f"{settings.settle_reserve_seconds:g}s settle reserve",
        clock=clock,
    )
    # Keeps claiming while a round makes progress and time remains; no idle pause: an
    # invocation that finds nothing to do ends, and errors end it too (Lambda retries).
    # HandlerConcurrency loops run at once (one handler each), sharing the batch between them,
    # and each claims only what it can plausibly start in the time left (ClaimPace).
    threads = settings.handler_concurrency
    done = run_concurrently(ClaimLoop(
        storage, runner, queues=lambda: queues, batch_size=per_thread_batch(settings.batch_size, threads),
        lease_seconds=lambda: _lease_seconds(invocation_end, settings, clock), deadline=work_deadline,
        telemetry=telemetry, clock=clock, fit_to_deadline=True, worker=worker,
    ), threads, name="rdq-handler")
    summary.update(claimed=done.claimed, started=done.started, released=done.released, too_long=done.too_long,
                   outcomes=done.outcomes)
    summary["fanned_out"] = _accepted(fan_out, invocation_end, clock)
    return summary


def _fired_summary(fired: "_FiredHere | None") -> dict[str, Any]:
    if fired is None:
        return {}
    return {"scheduled": {"schedule": fired.schedule, "task_id": fired.task_id, "created": fired.created}}


def _free_slot(storage: Storage, slot: WorkerSlot) -> None:
    """Free the slot as the invocation ends; if the store cannot be reached, its lease frees it."""
    try:
        if not storage.free_worker_slot(slot):
            logger.warning("worker slot was no longer held at the end of the invocation",
                           extra={"fleet": slot.fleet, "slot": slot.number})
    except StorageUnavailable as exc:
        logger.warning("worker slot not freed; its lease frees it", extra={"slot": slot.number, "error": str(exc)})


def _end_of_invocation(storage: Storage, settings: Settings) -> None:
    """Close the store connections left idle: a frozen environment would keep them open, and the
    database would count them, until Lambda recycles it (docs/serverless.md, the connection budget)."""
    if settings.close_idle_connections:
        storage.close_idle_connections()


# -- schedules (rdq_core.engine.schedules) ----------------------------------------------------------
#: The key of a Scheduler-triggered invocation's event (``rdq_core.aws.scheduler.EVENT_KEY``; a test
#: holds them equal). The schedules module itself, a sizeable share of the worker's cold import,
#: is loaded only for such an invocation.
SCHEDULE_EVENT_KEY = "rdq_schedule"

@dataclass(frozen=True)
class _FiredHere:
    schedule: str
    queue: str
    task_id: str
    created: bool


def _fire_schedule(event: Mapping[str, Any], storage: Storage, deadline: InvocationClock) -> _FiredHere | None:
    """An invocation by an EventBridge Scheduler schedule enqueues that period's task (id
    ``sched.<name>.<scheduled time>``) before working. Idempotent, so a duplicate or retried
    trigger makes no second task. A store that fails is retried here while time remains; after
    that the firing's invocation fails, and Lambda retries it through the ``schedules`` alias
    (twice, within 6 hours) before recording it in the failed-firings queue (template.yaml)."""
    if not isinstance(event, Mapping) or SCHEDULE_EVENT_KEY not in event:
        return None
    from ...engine.schedules import fire, scheduled_firing

    firing = scheduled_firing(event)
    if firing is None:
        return None
    schedule, instant = firing
    client = Client(storage)
    pause = 0.5
    while True:
        try:
            fired = fire(client, schedule, instant)
            break
        except StorageUnavailable:
            if deadline.remaining() < pause + 10:
                logger.error("schedule not fired: the store is unavailable",
                             extra={"schedule": schedule.name, "task_id": schedule.task_id(instant)})
                raise
            time.sleep(pause)
            pause = min(pause * 2, 4.0)
    logger.info("schedule fired" if fired.created else "schedule period already fired",
                extra={"schedule": schedule.name, "task_id": fired.task_id, "queue": schedule.queue})
    return _FiredHere(schedule.name, schedule.queue, fired.task_id, fired.created)


def _lease_seconds(invocation_end: float, settings: Settings, clock: Callable[[], float]) -> float:
    return max(invocation_end - clock(), 0.0) + settings.lease_grace_seconds


#: Seconds a worker that fanned out waits, after its own work, for the invocations still under
#: way, so its summary counts them; what is left then runs on or is lost with the container.
FAN_OUT_FINAL_WAIT_SECONDS = 1.0


def _accepted(fan_out: BackgroundInvocations | None, invocation_end: float, clock: Callable[[], float]) -> int:
    """The fan-out's invocations accepted, waiting briefly (never past the invocation) for the rest."""
    if fan_out is None:
        return 0
    return fan_out.wait(min(FAN_OUT_FINAL_WAIT_SECONDS, max(invocation_end - clock(), 0.0)))


def _may_fan_out(settings: Settings) -> bool:
    return bool(settings.worker_function) and settings.max_worker_concurrency > 1


def _fan_out(storage: Storage, queues: tuple[str, ...], settings: Settings, deadline: float, *,
             already_working: int) -> BackgroundInvocations | None:
    """Reserve in the store a slot for each worker the backlog needs beyond those running or on
    their way (this invocation included while it holds its slot), then start exactly those from a
    background thread, each taking its reservation over. The slots bound the fleet and one starter
    decides at a time, so any worker may fan out without a chain reaction or surplus invocations.
    None when none is needed."""
    backlog = 0
    for queue in queues:
        stats = storage.live_stats(queue)  # index-served: the queue's finished tasks are not read
        # Something is due now (not only delayed), and a worker may claim it (not paused).
        if stats.oldest_pending_age_seconds > 0 and not stats.paused:
            backlog += stats.pending
    fleet_size = workers_for_backlog(backlog, settings.batch_size, settings.max_worker_concurrency)
    if fleet_size <= already_working:
        return None  # an idle or small backlog costs no read of the slots
    fleet = FleetStarts(storage, settings.worker_fleet, settings.max_worker_concurrency)
    starts = fleet.reserve(fleet_size)
    if not starts:
        return None
    logger.info("fanning out", extra={"backlog": backlog, "extra_workers": len(starts), "fleet_size": fleet_size})
    return invoker.fan_out(settings.worker_function, queues, starts, deadline, fleet)


@logger.inject_lambda_context(clear_state=True)
@tracer.capture_lambda_handler(capture_response=False)
@metrics.log_metrics
def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    _modules.restore()  # before the lazy imports: handler modules, the storage driver
    return run_worker_invocation(event, context)


#: Taken last, when every module this entry point needs is loaded.
_modules = ModulePin(__name__)
