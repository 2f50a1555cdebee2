"""Running one task's handler under its deadline, and abandoning one that overruns it.

The handler gets a ``TaskContext`` whose deadline is the earlier of its own timeout and the
batch's deadline; what it returns or raises goes to ``rdq_core.outcomes`` to be decided.

With ``abandon_overdue_handlers`` (the long-running worker), each handler runs on a helper
thread of its claim loop; one that overruns its timeout keeps running *and keeps its task*
until it returns (Python cannot stop a thread), while the batch goes on with a fresh helper.
The host reads ``overruns()`` and bounds them (``rdq worker`` restarts its process).
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import payloads
from . import outcomes, tracecontext
from .handlers import HandlerSpec, Snooze, TaskContext
from .logs import task_log_keys
from .model import ClaimedTask, Settlement
from .retry import PolicyBook
from .telemetry import Telemetry

# The engine's lines keep one logger name whichever module writes them; operators filter on it.
log = logging.getLogger("rdq.runner")


@dataclass(frozen=True)
class Overrun:
    """A handler still running past its timeout (``abandon_overdue_handlers``)."""

    task_id: str
    handler: str
    timeout_seconds: float
    #: Monotonic time its timeout was spent.
    overdue_since: float


def run_handler(item: ClaimedTask, spec: HandlerSpec, ctx: TaskContext, policies: PolicyBook) -> Settlement:
    """Call the handler on this thread and have its result or exception decided."""
    task = item.task
    try:
        # The handler's own log lines carry the task's keys (on this thread only); it runs inside
        # the attempt's span when OpenTelemetry is in use (``rdq_core.tracecontext``).
        with task_log_keys(task_id=task.id, queue=task.queue, attempt=ctx.attempt), tracecontext.attempt_span(
            task_id=task.id, queue=task.queue, handler=task.handler, attempt=ctx.attempt,
            redrive_count=ctx.redrive_count, headers=task.headers,
        ) as traceparent:
            ctx.traceparent = traceparent
            # A payload kept in the payload store is fetched and hash-checked here (rdq_core/payloads.py).
            result = spec.func(payloads.task_payload(task), ctx)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a crashing handler is a failed attempt, never a dead loop
        return outcomes.from_exception(item, exc, policies)
    if isinstance(result, Snooze):  # returned rather than raised: the same request
        return outcomes.snoozed(item, result)
    return payloads.handler_outcome(item, result, policies)  # a large result goes to the payload store


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
        self._lock = threading.Lock()
        self._overruns: dict[str, Overrun] = {}
        #: Handlers running now (task id -> handler name), for a host that reports what it waits for.
        self._running: dict[str, str] = {}

    def running(self) -> dict[str, str]:
        """Task id -> handler name of every handler running now (overrunning ones included)."""
        with self._lock:
            return dict(self._running)

    def overruns(self) -> list[Overrun]:
        """Handlers running past their timeout right now; their tasks are still held."""
        with self._lock:
            return list(self._overruns.values())

    def close(self) -> None:
        """Let idle helper threads exit (overrunning ones exit when their handler returns)."""
        with self._lock:
            threads, self._all_handler_threads = self._all_handler_threads, []
        for thread in threads:
            thread.close()

    def execute(
        self,
        item: ClaimedTask,
        spec: HandlerSpec,
        deadline: float,
        extend: Callable[[float | None], None],
        settle_late: Callable[[Settlement], None],
    ) -> Settlement | None:
        """Run ``item``'s handler until its timeout or ``deadline``, whichever comes first; None
        when it overran and was left running (``settle_late`` then gets its outcome)."""
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
        )
        with self._lock:
            self._running[task.id] = spec.name
        try:
            if self.abandon_overdue_handlers:
                return self._execute_on_helper_thread(item, spec, ctx, run_until, settle_late)
            return run_handler(item, spec, ctx, self.policies)
        finally:
            with self._lock:
                if task.id not in self._overruns:  # an overrunning handler is still running
                    self._running.pop(task.id, None)

    def _execute_on_helper_thread(
        self, item: ClaimedTask, spec: HandlerSpec, ctx: TaskContext, run_until: float,
        settle_late: Callable[[Settlement], None],
    ) -> Settlement | None:
        """Run the handler on this claim loop's helper thread and wait until its time is up.

        A handler that overruns keeps running and *keeps its task*: the claim stays in the
        ledger (the heartbeat renews it), the claim loop goes on with a fresh helper, and when
        the handler returns its real outcome is settled. Only once the host has ended the
        process can the lease lapse, so two executions of one task never overlap.
        """
        outcome: list[Settlement] = []
        overran = False  # set under `lock`; a plain flag, not an Event: one fewer Condition per task
        finished = threading.Event()
        lock = threading.Lock()

        def job() -> None:
            settlement = run_handler(item, spec, ctx, self.policies)
            with lock:
                outcome.append(settlement)
                late = overran
                finished.set()
            if late:
                outcomes.log_outcome(item.task, settlement, self.policies, None)
                try:
                    settle_late(settlement)
                finally:
                    with self._lock:
                        self._overruns.pop(item.task.id, None)
                        self._running.pop(item.task.id, None)
                log.warning("overrunning handler %r of task %s returned; settled its outcome (%s)",
                            spec.name, item.task.id, settlement.outcome.value)

        self._helper_thread().submit(job)
        if finished.wait(max(0.0, run_until - self.clock())):
            return outcome[0]
        with lock:
            if finished.is_set():  # it made it at the last moment
                return outcome[0]
            overran = True
            self._handler_threads.current = None  # the next task gets a fresh helper
            with self._lock:
                self._overruns[item.task.id] = Overrun(item.task.id, spec.name, spec.timeout_seconds, self.clock())
        self.telemetry.count("abandoned_handlers")
        log.error(
            "handler %r of task %s overran its timeout of %gs; it keeps running and keeps its task "
            "(the lease is still renewed), the rest of the batch goes on",
            spec.name, item.task.id, spec.timeout_seconds,
        )
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
    """A daemon thread running handler jobs for one claim loop, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue_module.SimpleQueue[Callable[[], None] | None] = queue_module.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="rdq-handler", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # keep serving; the claim loop times the job out
                log.exception("handler job failed outside the handler")

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
