"""Running the handlers of a batch under their deadlines, and abandoning one that overruns.

The handler gets a ``TaskContext`` whose deadline is the earlier of its own timeout and the
batch's deadline; what it returns or raises goes to ``rdq_core.engine.outcomes`` to be decided.

Without ``abandon_overdue_handlers`` (the Lambda host) the batch is walked on the calling thread.

With it (the long-running worker), the claim loop hands the whole walk over its batch to a
helper thread as one job -- one thread handoff per batch, not per task -- and becomes its
watchdog. The job publishes the task whose handler runs now and when its time is up; the
watchdog sleeps until that time (or until the job ends), and a task published in between with
an earlier end wakes it. A handler that overruns keeps running *and keeps its task* until it
returns (Python cannot stop a thread): the watchdog marks it abandoned and hands the rest of the
batch to a job on a fresh helper; the stuck job, once its handler returns, settles that late
outcome on its own and takes nothing more. The host reads ``overruns()`` and bounds them
(``rdq worker`` restarts its process).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import queue as queue_module
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import payloads
from . import outcomes, tracecontext
from .handlers import HandlerSpec, Snooze, TaskContext, is_async, run_awaitable
from .logs import task_log_keys
from ..model import ClaimedTask, Settlement
from .retry import PolicyBook
from .telemetry import Telemetry
from .transactions import Completion

# The engine's lines keep one logger name whichever module writes them; operators filter on it.
log = logging.getLogger("rdq.runner")


#: How long past its deadline an ``async def`` handler has to finish being cancelled before the
#: watchdog treats it as an overrun.
ASYNC_CANCEL_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class Overrun:
    """A handler still running past its timeout (``abandon_overdue_handlers``)."""

    task_id: str
    handler: str
    timeout_seconds: float
    #: Monotonic time its timeout was spent.
    overdue_since: float


def run_handler(
    item: ClaimedTask, spec: HandlerSpec, ctx: TaskContext, policies: PolicyBook, *, interruptible: bool = True
) -> Settlement:
    """Call the handler on this thread and have its result or exception decided.

    ``interruptible``: a ``KeyboardInterrupt`` is raised on (the operator's Ctrl-C); without it,
    on a helper thread that signals never reach, it is the handler's own failure like any other."""
    task = item.task
    try:
        # The handler's own log lines carry the task's keys (on this thread only); it runs inside
        # the attempt's span when OpenTelemetry is in use (``rdq_core.engine.tracecontext``).
        with task_log_keys(task_id=task.id, queue=task.queue, attempt=ctx.attempt), tracecontext.attempt_span(
            task_id=task.id, queue=task.queue, handler=task.handler, attempt=ctx.attempt,
            redrive_count=ctx.redrive_count, headers=task.headers,
        ) as traceparent:
            ctx.traceparent = traceparent
            # A payload kept in the payload store is fetched and hash-checked here (rdq_core/engine/payloads.py).
            result = spec.func(payloads.task_payload(task), ctx)
            if inspect.isawaitable(result):  # a callable that returned a coroutine: run it here too
                result = run_awaitable(spec.name, result, ctx)
    except BaseException as exc:  # a crashing handler is a failed attempt, never a dead loop
        if interruptible and isinstance(exc, KeyboardInterrupt):
            raise
        return outcomes.from_exception(item, exc, policies)
    if isinstance(result, Snooze):  # returned rather than raised: the same request
        return outcomes.snoozed(item, result)
    return payloads.handler_outcome(item, result, policies)  # a large result goes to the payload store


class _Abandoned(BaseException):
    """Ends a job whose handler overran: the rest of its batch belongs to another job now.
    A BaseException so that nothing between ``execute`` and the job's loop catches it."""


class _BatchJob:
    """One walk over a batch on a helper thread, and what its watchdog reads of it (under ``cond``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        #: The task whose handler runs now, and when its time is up.
        self.task_id: str | None = None
        self.spec: HandlerSpec | None = None
        self.run_until = math.inf
        #: When the watchdog wakes by itself next: a task ending earlier must wake it.
        self.armed_until = math.inf
        #: Set by the watchdog: the running handler overran (or the watchdog left); the job
        #: settles that handler's outcome itself and takes nothing more.
        self.abandoned = False
        self.done = False
        self.error: BaseException | None = None

    def begin(self, task_id: str, spec: HandlerSpec, run_until: float) -> None:
        with self.cond:
            self.task_id, self.spec, self.run_until = task_id, spec, run_until
            if run_until < self.armed_until:
                self.cond.notify()

    def end(self) -> bool:
        """The handler returned; True when the watchdog had already given up on it."""
        with self.cond:
            self.task_id = self.spec = None
            return self.abandoned


class HandlerExecution:
    """Runs handlers for every claim loop of one runner and knows which are running now."""

    def __init__(
        self,
        policies: PolicyBook,
        telemetry: Telemetry,
        *,
        abandon_overdue_handlers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policies = policies
        self.telemetry = telemetry
        self.abandon_overdue_handlers = abandon_overdue_handlers
        self.clock = clock
        # One helper thread per calling thread (claim loop), replaced when a handler overruns.
        self._handler_threads = threading.local()
        self._all_handler_threads: list[_HandlerThread] = []
        # On a helper thread: the job it runs now (``execute`` reports to it).
        self._jobs = threading.local()
        self._lock = threading.Lock()
        self._overruns: dict[str, Overrun] = {}
        #: Handlers running now (task id -> handler name), for a host that reports what it waits for.
        self._running: dict[str, str] = {}
        #: Set by a host about to end its overrunning handlers (``drop_late_outcomes``).
        self._dropping_late_outcomes = False

    def running(self) -> dict[str, str]:
        """Task id -> handler name of every handler running now (overrunning ones included)."""
        with self._lock:
            return dict(self._running)

    def overruns(self) -> list[Overrun]:
        """Handlers running past their timeout right now; their tasks are still held."""
        with self._lock:
            return list(self._overruns.values())

    def drop_late_outcomes(self) -> None:
        """From now on, an overrunning handler that returns has its outcome dropped, not settled.
        For a host about to kill what its overrunning handlers started: a handler whose child was
        killed under it may well return "success", and the task must instead be retried once
        its lease lapses."""
        with self._lock:
            self._dropping_late_outcomes = True

    def close(self) -> None:
        """Let idle helper threads exit (overrunning ones exit when their handler returns)."""
        with self._lock:
            threads, self._all_handler_threads = self._all_handler_threads, []
        for thread in threads:
            thread.close()

    def run_batch(self, take: Callable[[], ClaimedTask | None], step: Callable[[ClaimedTask], bool]) -> int:
        """Call ``step`` on each item ``take`` gives until it gives None or ``step`` returns False;
        ``step`` runs the item's handler with ``execute``. Returns how many handlers overran and
        were left running (their outcome is settled by ``execute``'s ``settle_late``).

        An exception out of ``step`` is raised here, on the calling thread, in both modes."""
        if not self.abandon_overdue_handlers:
            while (item := take()) is not None and step(item):
                pass
            return 0
        abandoned = 0
        while True:
            job = _BatchJob()
            self._helper_thread().submit(functools.partial(self._walk, job, take, step))
            try:
                overran = self._watch(job)
            except BaseException:
                # Leaving early (an interrupt): the job settles its running handler's outcome
                # itself and stops; the caller releases what it has not taken.
                with job.cond:
                    job.abandoned = True
                raise
            if overran is None:
                if job.error is not None:
                    raise job.error
                return abandoned
            abandoned += 1
            task_id, spec = overran
            self._handler_threads.current = None  # the rest of the batch gets a fresh helper
            self.telemetry.count("abandoned_handlers")
            log.error(
                "handler %r of task %s overran its timeout of %gs; it keeps running and keeps its task "
                "(the lease is still renewed), the rest of the batch goes on",
                spec.name, task_id, spec.timeout_seconds,
            )

    def execute(
        self,
        item: ClaimedTask,
        spec: HandlerSpec,
        deadline: float,
        extend: Callable[[float | None], None],
        settle_late: Callable[[Settlement], None],
        completion: Completion | None = None,
    ) -> Settlement:
        """Run ``item``'s handler on this thread until its timeout or ``deadline``, whichever
        comes first. Inside a ``run_batch`` job, a handler the watchdog gave up on has its
        outcome passed to ``settle_late`` when it returns, and the job ends there."""
        task = item.task
        run_until = min(deadline, self.clock() + spec.timeout_seconds)
        ctx = TaskContext(
            task_id=task.id,
            queue=task.queue,
            attempt=task.attempt_count + 1,
            redrive_count=task.redrive_count,
            headers=task.headers,
            deadline=run_until,
            extend=extend,
            completion=completion,  # ctx.transaction(): exactly-once effects (rdq_core/engine/transactions.py)
        )
        with self._lock:
            self._running[task.id] = spec.name
        job: _BatchJob | None = getattr(self._jobs, "job", None)
        if job is None:
            try:
                return run_handler(item, spec, ctx, self.policies)
            finally:
                with self._lock:
                    self._running.pop(task.id, None)
        # An async handler cancels itself at run_until: the watchdog gives it a moment to, so
        # that only one that ignores cancellation (a blocking call inside) counts as an overrun.
        job.begin(task.id, spec, run_until + (ASYNC_CANCEL_GRACE_SECONDS if is_async(spec.func) else 0.0))
        try:
            settlement = run_handler(item, spec, ctx, self.policies, interruptible=False)
        finally:
            late = job.end()
            if not late:
                with self._lock:
                    self._running.pop(task.id, None)
        if not late:
            return settlement
        # Overran: the claim stayed in the ledger (the heartbeat renewed it) while the batch
        # went on without it; its real outcome is written now. Only once the host has ended
        # the process can the lease lapse, so two executions of one task never overlap.
        with self._lock:
            dropped = self._dropping_late_outcomes
        if dropped:
            with self._lock:
                self._overruns.pop(task.id, None)
                self._running.pop(task.id, None)
            log.warning("overrunning handler %r of task %s returned as the worker ended it; its outcome (%s) is "
                        "dropped and the task is retried once its lease lapses",
                        spec.name, task.id, settlement.outcome.value)
            raise _Abandoned
        outcomes.log_outcome(task, settlement, self.policies, None)
        try:
            settle_late(settlement)
        finally:
            with self._lock:
                overran = self._overruns.pop(task.id, None) is not None
                self._running.pop(task.id, None)
        if overran:
            log.warning("overrunning handler %r of task %s returned; settled its outcome (%s)",
                        spec.name, task.id, settlement.outcome.value)
        raise _Abandoned

    def _walk(self, job: _BatchJob, take: Callable[[], ClaimedTask | None], step: Callable[[ClaimedTask], bool]) -> None:
        """The job on the helper thread. Always marks itself done, so the watchdog never hangs."""
        self._jobs.job = job
        try:
            while not job.abandoned and (item := take()) is not None and step(item):
                pass
        except _Abandoned:
            pass
        except BaseException as exc:  # handed to the watchdog, raised on its thread
            with job.cond:
                abandoned = job.abandoned
            if abandoned:  # nobody waits for this job any more
                log.exception("error in a batch job after the batch went on without it")
            else:
                job.error = exc
        finally:
            self._jobs.job = None
            with job.cond:
                job.done = True
                job.cond.notify()

    def _watch(self, job: _BatchJob) -> tuple[str, HandlerSpec] | None:
        """Wait until ``job`` is done (None) or its running handler overruns: then that task
        (recorded as an ``Overrun``, the job marked abandoned)."""
        with job.cond:
            while not job.done:
                job.armed_until = job.run_until if job.task_id is not None else math.inf
                wait = job.armed_until - self.clock()
                if wait > 0:
                    job.cond.wait(None if math.isinf(wait) else wait)
                    continue
                assert job.task_id is not None and job.spec is not None
                job.abandoned = True
                with self._lock:
                    self._overruns[job.task_id] = Overrun(job.task_id, job.spec.name, job.spec.timeout_seconds,
                                                          self.clock())
                return job.task_id, job.spec
        return None

    def _helper_thread(self) -> _HandlerThread:
        helper = getattr(self._handler_threads, "current", None)
        if helper is None:
            helper = _HandlerThread()
            self._handler_threads.current = helper
            with self._lock:
                self._all_handler_threads = [t for t in self._all_handler_threads if t.thread.is_alive()]
                self._all_handler_threads.append(helper)
        return helper


class _HandlerThread:
    """A daemon thread running batch jobs for one claim loop, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue_module.SimpleQueue[Callable[[], None] | None] = queue_module.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="rdq-handler", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # keep serving (a job hands its own errors to its watchdog)
                log.exception("handler job failed outside the handler")

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
