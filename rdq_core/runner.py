"""Running a claimed batch: execute handlers, classify outcomes, settle in batches.

Shared by both hosts: the Lambda worker passes the invocation's deadline; the long-running
``rdq worker`` passes no deadline and renews leases with a heartbeat instead.

Rules enforced here (each one is a test in the compliance kit):
* a task starts only if its handler's ``timeout_seconds`` (plus a settle margin) still fits
  before the deadline; the rest of the batch is *released* (no attempt spent). A handler whose
  timeout can never fit this host (``longest_run_seconds``) is dead-lettered on its first claim
  with ``rdq.TimeoutExceedsWorker`` instead of being released forever;
* ``PermanentError`` and an unknown handler dead-letter at once; any other exception, including
  panic-like ``BaseException`` s such as ``SystemExit`` or ``RecursionError``, is a retryable
  failure recorded with its type and a truncated stack; error text is made valid Unicode first;
* outcomes are buffered and settled many per round trip, but never wait longer than
  ``settle_interval``: the buffer has its own thread, so a long next handler cannot keep a
  finished task unsettled (and the heartbeat renews buffered claims until they are written);
* with ``abandon_overdue_handlers`` (the long-running worker), each handler runs on a helper
  thread; one that overruns its timeout keeps running *and keeps its task* until it returns,
  while the batch goes on. The host bounds the overrun (``rdq worker`` restarts its process);
* whatever a store raises, every claim of the batch ends settled, released or, for an
  overrunning handler, still held and tracked -- never renewed and forgotten;
* a settle that meets an outage is retried with backoff for up to one lease (bounded by the
  deadline): the store coming back within the lease keeps the outcome instead of re-running it.
"""

from __future__ import annotations

import logging
import math
import queue as queue_module
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .errors import InvalidInput, PermanentError, StaleClaim, StorageUnavailable
from .handlers import HandlerRegistry, HandlerSpec, TaskContext, registry as default_registry
from .logs import task_log_keys
from .model import ClaimedTask, ClaimRef, ErrorInfo, Outcome, Settlement, Task, TaskStatus
from .retry import PolicyBook
from .storage.spi import Storage
from .telemetry import Telemetry
from .validation import Limits, json_value, repaired_text

log = logging.getLogger("rdq.runner")
#: One line per task outcome (``rdq worker``, ``rdq dev``, the Lambda worker, the reaper).
task_log = logging.getLogger("rdq.task")

UNKNOWN_HANDLER = "rdq.UnknownHandler"
INVALID_RESULT = "rdq.InvalidResult"
LEASE_EXPIRED = "rdq.LeaseExpired"
TIMEOUT_EXCEEDS_WORKER = "rdq.TimeoutExceedsWorker"


def error_from_exception(exc: BaseException) -> ErrorInfo:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    # Free the failed handler's locals first: after a MemoryError they hold the hoard, and
    # formatting needs memory. Line numbers survive; frames still executing are skipped.
    traceback.clear_frames(exc.__traceback__)
    # A poison exception may fail to describe itself (a raising __str__); that must not take
    # the worker down with it.
    try:
        message = str(exc)
    except Exception as describe_error:  # noqa: BLE001
        message = f"<str() of the exception failed: {type(describe_error).__name__}>"
    try:
        stack = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    except Exception as describe_error:  # noqa: BLE001
        stack = f"<the traceback could not be formatted: {type(describe_error).__name__}>"
    return truncated_error(name, message, stack)


def truncated_error(kind: str, message: str, stack: str | None = None) -> ErrorInfo:
    """The one way the engine builds an attempt's error: bounded, and valid text on every store."""
    kind = repaired_text(kind)
    message = repaired_text(message[: Limits.error_message_chars])
    if stack is not None:
        stack = repaired_text(stack)
    if stack is not None and len(stack) > Limits.error_stack_chars:
        # Keep the tail: the innermost frames say where it broke.
        stack = "…" + stack[-(Limits.error_stack_chars - 1):]
    return ErrorInfo(kind, message, stack)


@dataclass
class BatchReport:
    started: int = 0
    released: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    stale: int = 0
    #: Handlers that overran their timeout and were left running (``abandon_overdue_handlers``);
    #: their tasks stay held until they return.
    abandoned: int = 0
    #: Tasks dead-lettered on claim because their handler's timeout can never fit this host.
    too_long: int = 0
    #: Settlements or releases a store refused with an error the engine does not classify.
    failed_writes: int = 0

    def add(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1


class ClaimLedger:
    """Claims a worker holds, for a heartbeat to renew. The default does nothing (the Lambda
    host's lease already outlives its invocation).

    Every claim is held from ``hold`` until ``drop``: while it waits in the batch, while its
    handler runs (however long: an overrunning handler keeps its task, see ``BatchRunner``) and
    while its outcome waits in the settle buffer. A claim is dropped only once its settle or
    release has returned, or has failed for good.
    """

    def hold(self, claimed: Sequence[ClaimedTask]) -> None: ...

    def drop(self, refs: Sequence[ClaimRef]) -> None: ...


@dataclass(frozen=True)
class Overrun:
    """A handler still running past its timeout (``abandon_overdue_handlers``)."""

    task_id: str
    handler: str
    timeout_seconds: float
    #: Monotonic time its timeout was spent.
    overdue_since: float


class BatchRunner:
    def __init__(
        self,
        storage: Storage,
        policies: PolicyBook | None = None,
        registry: HandlerRegistry | None = None,
        telemetry: Telemetry | None = None,
        *,
        lease_seconds: float = 60.0,
        settle_batch: int = 100,
        settle_interval: float = 0.5,
        settle_margin: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        abandon_overdue_handlers: bool = False,
        longest_run_seconds: float = math.inf,
        longest_run_reason: str = "",
    ) -> None:
        self.storage = storage
        self.policies = policies or PolicyBook()
        self.registry = registry or default_registry
        self.telemetry = telemetry or Telemetry()
        #: The lease a claim is taken with; also the least an ``extend_lease`` renews to.
        self.lease_seconds = lease_seconds
        self.settle_batch = settle_batch
        self.settle_interval = settle_interval
        self.settle_margin = settle_margin
        self.clock = clock
        self.abandon_overdue_handlers = abandon_overdue_handlers
        #: The longest time this host can ever give one task (a Lambda worker: its function
        #: timeout minus the settle reserve). A handler whose timeout needs more never runs.
        self.longest_run_seconds = longest_run_seconds
        self.longest_run_reason = longest_run_reason
        # One helper thread per calling thread (claim loop), replaced when a handler overruns.
        self._handler_threads = threading.local()
        self._all_handler_threads: list[_HandlerThread] = []
        self._threads_lock = threading.Lock()
        self._overruns: dict[str, Overrun] = {}
        #: Handlers running now (task id -> handler name), for a host that reports what it waits for.
        self._running: dict[str, str] = {}
        self._active_batches: list[tuple[_BatchCursor, _OutcomeBuffer, BatchReport, ClaimLedger, float]] = []

    def close(self) -> None:
        """Let idle helper threads exit (overrunning ones exit when their handler returns)."""
        with self._threads_lock:
            threads, self._all_handler_threads = self._all_handler_threads, []
        for thread in threads:
            thread.close()

    def running(self) -> dict[str, str]:
        """Task id -> handler name of every handler running now (overrunning ones included)."""
        with self._threads_lock:
            return dict(self._running)

    def settle_and_release_now(self) -> int:
        """For a host about to exit at once (a second Ctrl-C): write every buffered outcome and
        release every claim whose handler has not started, in every batch in progress. Running
        handlers are left to their leases. Returns the number of claims released."""
        with self._threads_lock:
            active = list(self._active_batches)
        released = 0
        for batch, outcomes, report, ledger, deadline in active:
            outcomes.flush()
            before = report.released
            self._release(batch.take_unstarted(), report, ledger, deadline)
            released += report.released - before
        return released

    def overruns(self) -> list[Overrun]:
        """Handlers running past their timeout right now; their tasks are still held."""
        with self._threads_lock:
            return list(self._overruns.values())

    def run(
        self,
        claimed: Sequence[ClaimedTask],
        deadline: float = math.inf,
        ledger: ClaimLedger | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> BatchReport:
        """Run ``claimed`` in order until done or out of time; settle and release everything.

        Whatever happens inside -- a handler, a store raising something unexpected, the
        deadline passing while a handler overruns -- every claim ends settled, released, or
        (an overrunning handler's) still held and tracked; none is left renewed and forgotten.
        """
        ledger = ledger or ClaimLedger()
        ledger.hold(claimed)
        report = BatchReport()
        batch = _BatchCursor(claimed)
        outcomes = _OutcomeBuffer(self, report, ledger, batch, deadline)
        active = (batch, outcomes, report, ledger, deadline)
        with self._threads_lock:
            self._active_batches.append(active)
        try:
            while (item := batch.take()) is not None:
                if should_stop():
                    batch.set_aside(item)
                    break
                spec = self.registry.get(item.task.handler)
                needed = (spec.timeout_seconds if spec else 0.0) + self.settle_margin
                if spec is not None and needed > self.longest_run_seconds:
                    report.too_long += 1
                    outcomes.add(self._too_long_for_host(item, spec, needed))
                    continue
                if deadline - self.clock() < needed:
                    # Too long for the time left; a quicker task later in the batch may still fit.
                    batch.set_aside(item)
                    continue
                report.started += 1
                outcomes.watch_while_a_handler_runs()
                began = self.clock()
                settlement = self.execute(item, spec, deadline, ledger)
                if settlement is None:
                    # Overran its timeout: still running, its task still held (see execute).
                    report.abandoned += 1
                    continue
                report.add(settlement.outcome)
                log_outcome(item.task, settlement, self.policies, self.clock() - began)
                # Buffered outcomes are durable within settle_interval even while the next
                # handler runs (the buffer's own thread writes them), and the ledger renews
                # their leases until then: a finished task is never reaped and run again.
                outcomes.add(settlement)
        finally:
            outcomes.close()
            self._release(batch.take_unstarted(), report, ledger, deadline)
            with self._threads_lock:
                self._active_batches.remove(active)
        return report

    def execute(self, item: ClaimedTask, spec: HandlerSpec | None, deadline: float, ledger: ClaimLedger) -> Settlement | None:
        """Run one task's handler (``spec``, as ``run`` looked it up) and turn what happened into
        a settlement decision; None when the handler overran its timeout and was left running
        (``abandon_overdue_handlers``)."""
        task = item.task
        if spec is None:
            error = truncated_error(UNKNOWN_HANDLER, f"no handler named {task.handler!r} is registered in this worker")
            return Settlement(task.id, item.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=error)
        run_until = min(deadline, self.clock() + spec.timeout_seconds)
        ctx = TaskContext(
            task_id=task.id,
            queue=task.queue,
            attempt=task.attempt_count + 1,
            redrive_count=task.redrive_count,
            headers=task.headers,
            deadline=run_until,
            extend=lambda seconds: self._extend(item.ref, seconds),
        )
        with self._threads_lock:
            self._running[task.id] = spec.name
        try:
            if self.abandon_overdue_handlers:
                return self._execute_on_helper_thread(item, spec, ctx, run_until, ledger)
            return self._invoke(item, spec, ctx)
        finally:
            with self._threads_lock:
                if task.id not in self._overruns:  # an overrunning handler is still running
                    self._running.pop(task.id, None)

    def _too_long_for_host(self, item: ClaimedTask, spec, needed: float) -> Settlement:
        message = (
            f"handler {spec.name!r} has timeout_seconds={spec.timeout_seconds:g}, so a run needs "
            f"{needed:g}s with the {self.settle_margin:g}s settle margin, but this worker can give a task "
            f"at most {self.longest_run_seconds:g}s"
            + (f" ({self.longest_run_reason})" if self.longest_run_reason else "")
            + "; lower the handler's timeout or raise the worker's"
        )
        log.warning("dead-lettering task %s: %s", item.task.id, message)
        self.telemetry.count("too_long_for_worker")
        settlement = Settlement(item.task.id, item.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                error=truncated_error(TIMEOUT_EXCEEDS_WORKER, message))
        log_outcome(item.task, settlement, self.policies, None)
        return settlement

    def _invoke(self, item: ClaimedTask, spec, ctx: TaskContext) -> Settlement:
        task = item.task
        try:
            # The handler's own log lines carry the task's keys (on this thread only).
            with task_log_keys(task_id=task.id, queue=task.queue, attempt=ctx.attempt):
                result = spec.func(task.payload, ctx)
        except PermanentError as exc:
            return self.policies.settle_failure(task, item.claim_token, Outcome.PERMANENT_FAILURE, error_from_exception(exc))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a crashing handler is a retryable failure
            return self.policies.settle_failure(task, item.claim_token, Outcome.RETRYABLE_FAILURE, error_from_exception(exc))
        problem = _result_problem(result)
        if problem is not None:
            return self.policies.settle_failure(
                task, item.claim_token, Outcome.RETRYABLE_FAILURE, truncated_error(INVALID_RESULT, problem)
            )
        return Settlement(task.id, item.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)

    def _execute_on_helper_thread(
        self, item: ClaimedTask, spec, ctx: TaskContext, run_until: float, ledger: ClaimLedger
    ) -> Settlement | None:
        """Run the handler on this claim loop's helper thread and wait until its time is up.

        Python cannot stop a thread, so a handler that overruns keeps running and *keeps its
        task*: the claim stays in the ledger (the heartbeat renews it), the claim loop goes on
        with a fresh helper, and when the handler returns its real outcome is settled. The host
        decides how long to tolerate an overrun (``overruns()``); ``rdq worker`` restarts its
        process past a grace period, which stops the handler for real, and only then can the
        lease lapse. Two executions of one task can therefore never overlap.
        """
        state: dict[str, Any] = {"settlement": None, "overran": False}
        finished = threading.Event()
        lock = threading.Lock()

        def job() -> None:
            settlement = self._invoke(item, spec, ctx)
            with lock:
                state["settlement"] = settlement
                late = state["overran"]
                finished.set()
            if late:
                log_outcome(item.task, settlement, self.policies, None)
                try:
                    self._flush([settlement], BatchReport(), ledger)
                finally:
                    with self._threads_lock:
                        self._overruns.pop(item.task.id, None)
                        self._running.pop(item.task.id, None)
                log.warning("overrunning handler %r of task %s returned; settled its outcome (%s)",
                            spec.name, item.task.id, settlement.outcome.value)

        self._helper_thread().submit(job)
        if finished.wait(max(0.0, run_until - self.clock())):
            return state["settlement"]
        with lock:
            if finished.is_set():  # it made it at the last moment
                return state["settlement"]
            state["overran"] = True
            self._handler_threads.current = None  # the next task gets a fresh helper
            with self._threads_lock:
                self._overruns[item.task.id] = Overrun(item.task.id, spec.name, spec.timeout_seconds, self.clock())
        self.telemetry.count("abandoned_handlers")
        log.error(
            "handler %r of task %s overran its timeout of %gs; it keeps running and keeps its task "
            "(the lease is still renewed), the rest of the batch goes on",
            spec.name, item.task.id, spec.timeout_seconds,
        )
        return None

    def _helper_thread(self) -> "_HandlerThread":
        helper = getattr(self._handler_threads, "current", None)
        if helper is None:
            helper = _HandlerThread()
            self._handler_threads.current = helper
            with self._threads_lock:
                self._all_handler_threads = [t for t in self._all_handler_threads if t.thread.is_alive()]
                self._all_handler_threads.append(helper)
        return helper

    # -- storage writes --------------------------------------------------------------------
    def _extend(self, ref: ClaimRef, seconds: float | None) -> None:
        # Never less than a normal lease: on Lambda that lease already outlives the invocation,
        # so a handler asking for a short extension cannot let its task go while it runs.
        # (Stores also never move an expiry earlier.)
        self.storage.extend_leases([ref], max(seconds or 0.0, self.lease_seconds))

    def _write_budget(self, deadline: float) -> float:
        """How long a settle/release may keep retrying through an outage: up to one lease
        (after that the reaper owns the task anyway), never past the deadline."""
        return max(0.0, min(self.lease_seconds, deadline - self.clock() - 0.5))

    def _flush(
        self, settlements: list[Settlement], report: BatchReport, ledger: ClaimLedger, deadline: float = math.inf
    ) -> None:
        if not settlements:
            return
        refused: set[str] = set()
        failed: set[str] = set()
        try:
            _with_retries(lambda: self.storage.settle(settlements), budget_seconds=self._write_budget(deadline))
        except StaleClaim as exc:
            refused = set(exc.task_ids)
        except StorageUnavailable:
            log.error("could not settle %d task(s): storage unavailable; their leases will expire", len(settlements))
            failed = {s.task_id for s in settlements}
        except Exception:  # noqa: BLE001 - an unclassified store error must not lose the batch
            log.exception("the store refused a settle of %d task(s) with an unexpected error; settling them one by one",
                          len(settlements))
            refused, failed = self._settle_one_by_one(settlements)
        finally:
            ledger.drop([ClaimRef(s.task_id, s.claim_token) for s in settlements])
        if refused:
            # The lease was lost (reaped after expiry): the late outcome is fenced off by design.
            report.stale += len(refused)
            self.telemetry.count("stale_settlements", len(refused))
            log.warning("settle refused for %d task(s) whose claim was lost: %s", len(refused), ", ".join(sorted(refused)))
        report.failed_writes += len(failed)
        for s in settlements:
            if s.task_id not in refused and s.task_id not in failed:
                self.telemetry.count(_SETTLED_METRIC[s.status])

    def _settle_one_by_one(self, settlements: list[Settlement]) -> tuple[set[str], set[str]]:
        """After an unexpected error: one item cannot take its neighbours' outcomes with it.
        Returns (refused as stale, failed for good); a failed task's lease expires and the
        reaper records LEASE_EXPIRED, so it is retried, never held."""
        refused: set[str] = set()
        failed: set[str] = set()
        for settlement in settlements:
            try:
                self.storage.settle([settlement])
            except StaleClaim:
                refused.add(settlement.task_id)
            except Exception:  # noqa: BLE001
                failed.add(settlement.task_id)
                log.exception("could not settle task %s; its lease will expire", settlement.task_id)
        return refused, failed

    def _release(
        self, items: Sequence[ClaimedTask], report: BatchReport, ledger: ClaimLedger, deadline: float = math.inf
    ) -> None:
        if not items:
            return
        refs = [item.ref for item in items]
        released = 0
        try:
            _with_retries(lambda: self.storage.release(refs), budget_seconds=self._write_budget(deadline))
            released = len(refs)
        except StaleClaim as exc:
            released = len(refs) - len(exc.task_ids)
            report.stale += len(exc.task_ids)
        except StorageUnavailable:
            log.error("could not release %d task(s): storage unavailable; their leases will expire", len(refs))
            report.failed_writes += len(refs)
        except Exception:  # noqa: BLE001 - stop renewing them either way (finally), so they are reaped
            log.exception("could not release %d task(s): unexpected store error; their leases will expire", len(refs))
            report.failed_writes += len(refs)
        finally:
            ledger.drop(refs)
        report.released += released
        self.telemetry.count("released", released)


class _BatchCursor:
    """A claimed batch as the claim loop walks it. The deadline watchdog (``_OutcomeBuffer``)
    may take everything not yet started, to release it while a handler overruns."""

    def __init__(self, items: Sequence[ClaimedTask]) -> None:
        self._items = list(items)
        self._next = 0
        self._set_aside: list[ClaimedTask] = []
        self._lock = threading.Lock()

    def take(self) -> ClaimedTask | None:
        with self._lock:
            if self._next >= len(self._items):
                return None
            self._next += 1
            return self._items[self._next - 1]

    def set_aside(self, item: ClaimedTask) -> None:
        """Not started (no time for it, or stopping): released at the end, or by the watchdog."""
        with self._lock:
            self._set_aside.append(item)

    def has_unstarted(self) -> bool:
        with self._lock:
            return bool(self._set_aside) or self._next < len(self._items)

    def take_unstarted(self) -> list[ClaimedTask]:
        with self._lock:
            rest = self._set_aside + self._items[self._next:]
            self._next = len(self._items)
            self._set_aside = []
        return rest


class _OutcomeBuffer:
    """Outcomes waiting to be settled many per round trip, with a thread of its own that writes
    them once the oldest has waited ``settle_interval`` -- even while the claim loop is inside
    the next handler, however long that one runs. At the deadline it also settles everything
    and releases the unstarted rest of the batch, so a handler that overruns a Lambda
    invocation can only cost its own task."""

    def __init__(self, runner: BatchRunner, report: BatchReport, ledger: ClaimLedger, batch: _BatchCursor,
                 deadline: float) -> None:
        self._runner = runner
        self._report = report
        self._ledger = ledger
        self._batch = batch
        self._deadline = deadline
        self._pending: list[Settlement] = []
        self._oldest = math.inf
        self._lock = threading.Lock()
        # Serialises writes: the claim loop (batch full), the buffer's thread (age, deadline)
        # and close() never settle concurrently, and close() returns only after all are done.
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch_while_a_handler_runs(self) -> None:
        """Called before each handler: from here on something may wait on it -- a buffered
        outcome, or (with a deadline) unstarted claims -- so start the watcher if it is not
        running. A batch of one task on Lambda, the common case at low load, needs no thread."""
        if self._thread is None and (self._pending or (math.isfinite(self._deadline) and self._batch.has_unstarted())):
            self._thread = threading.Thread(target=self._watch, name="rdq-settle", daemon=True)
            self._thread.start()

    def add(self, settlement: Settlement) -> None:
        with self._lock:
            if not self._pending:
                self._oldest = self._runner.clock()
                self._wake.set()  # the watcher re-arms its timer for this one
            self._pending.append(settlement)
            full = len(self._pending) >= self._runner.settle_batch
        if full:
            self.flush()

    def flush(self) -> None:
        with self._write_lock:
            with self._lock:
                batch, self._pending, self._oldest = self._pending, [], math.inf
            self._runner._flush(batch, self._report, self._ledger, self._deadline)

    def close(self) -> None:
        """Stop the watcher (after any write it has in progress) and settle what is left."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def _watch(self) -> None:
        clock = self._runner.clock
        deadline_handled = False
        while True:
            with self._lock:
                if self._closed:
                    return
                due = self._oldest + self._runner.settle_interval
            if not deadline_handled:
                due = min(due, self._deadline)
            wait = due - clock()
            if wait > 0:
                self._wake.wait(None if math.isinf(wait) else wait)
                self._wake.clear()
                continue
            if not deadline_handled and clock() >= self._deadline:
                deadline_handled = True
                with self._write_lock:
                    self._runner._release(self._batch.take_unstarted(), self._report, self._ledger, self._deadline)
            self.flush()


def log_outcome(task: Task, settlement: Settlement, policies: PolicyBook, seconds: float | None) -> None:
    """One line per outcome: readable on a terminal, and every field in ``rdq_task`` for the
    JSON formats. Dead-lettering is a WARNING: someone has to look at it."""
    level = logging.WARNING if settlement.status is TaskStatus.DEAD else logging.INFO
    if not task_log.isEnabledFor(level):  # the hot path of a drain: build nothing
        return
    error = settlement.error
    fields = {
        "task_id": task.id,
        "queue": task.queue,
        "handler": task.handler,
        "try": task.attempt_count + 1,
        "max_tries": policies.for_task(task).max_attempts,
        "outcome": settlement.outcome.value,
        "status": settlement.status.value,
        "duration_ms": None if seconds is None else round(seconds * 1000, 1),
        "error_type": error.type if error else None,
    }
    took = "" if seconds is None else f" in {_human_duration(seconds)}"
    what = {TaskStatus.SUCCEEDED: "", TaskStatus.DEAD: "; dead-lettered"}.get(
        settlement.status, f"; retry in {_human_duration(settlement.retry_delay_seconds)}")
    because = f": {error.type}: {error.message[:200]}" if error else ""
    task_log.log(
        level, "%s %s/%s try %d/%d %s%s%s%s", task.id, task.queue, task.handler, fields["try"], fields["max_tries"],
        settlement.outcome.value, took, because, what, extra={"rdq_task": fields},
    )


def _human_duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


_SETTLED_METRIC = {TaskStatus.SUCCEEDED: "succeeded", TaskStatus.DEAD: "dead_lettered", TaskStatus.PENDING: "retried"}


def _result_problem(result: object) -> str | None:
    """Why a handler's return value cannot be stored, or None. The same rules as a payload
    (plain JSON, no NUL, no lone surrogate, bounded depth) with the 64 KiB result limit."""
    try:
        json_value(result, Limits.result_bytes, "handler result")
    except InvalidInput as exc:
        return str(exc)[: Limits.error_message_chars]
    # RecursionError: nesting too deep to encode; any other error: a poison value (e.g. a dict
    # subclass whose items() raises). Either way a failed attempt, never a dead claim loop.
    except Exception as exc:  # noqa: BLE001
        return f"handler result is not JSON-serialisable: {type(exc).__name__}: {exc}"[: Limits.error_message_chars]
    return None


def _with_retries(
    write: Callable[[], None], attempts: int = 3, first_delay: float = 0.2, budget_seconds: float = 0.0
) -> None:
    """Retry a write on StorageUnavailable: at least ``attempts`` times, and for as long as
    ``budget_seconds`` allows (backoff doubling to 2 s). Settlements are idempotent under
    fencing: a repeat of an applied settle is refused as stale, never applied twice."""
    delay = first_delay
    give_up_at = time.monotonic() + budget_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            write()
            if attempt > 1:
                log.info("storage write succeeded on attempt %d after an outage", attempt)
            return
        except StorageUnavailable as exc:
            if attempt >= attempts and time.monotonic() + delay > give_up_at:
                raise
            log.debug("storage write failed (%s); retrying in %.1fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class _HandlerThread:
    """A daemon thread running handler jobs for one claim loop, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="rdq-handler", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # noqa: BLE001 - keep serving; the claim loop times the job out
                log.exception("handler job failed outside the handler")

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
