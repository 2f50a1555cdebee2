"""Running a claimed batch: execute handlers, classify outcomes, settle in batches.

Shared by both hosts: the Lambda worker passes the invocation's deadline; the long-running
``rdq worker`` passes no deadline and renews leases with a heartbeat instead.

Rules enforced here:
* a task starts only if its handler's ``timeout_seconds`` (plus a settle margin) still fits
  before the deadline; the rest of the batch is *released* (no attempt spent);
* ``PermanentError`` and an unknown handler dead-letter at once; any other exception, including
  panic-like ``BaseException`` s such as ``SystemExit`` or ``RecursionError``, is a retryable
  failure recorded with its type and a truncated stack;
* outcomes are buffered and settled many per round trip;
* with ``abandon_overdue_handlers`` (the long-running worker), each handler runs on a helper
  thread and is abandoned when its ``timeout_seconds`` is spent: the batch goes on, the hung
  task's lease runs out and the reaper records LEASE_EXPIRED (a late result is still offered to
  storage, fenced, and refused once the task was reaped);
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
from typing import Callable, Sequence

from .errors import InvalidInput, PermanentError, StaleClaim, StorageUnavailable
from .handlers import HandlerRegistry, TaskContext, registry as default_registry
from .model import ClaimedTask, ClaimRef, ErrorInfo, Outcome, Settlement, TaskStatus
from .retry import PolicyBook
from .storage.spi import Storage
from .telemetry import Telemetry
from .validation import Limits, json_value

log = logging.getLogger("rdq.runner")

UNKNOWN_HANDLER = "rdq.UnknownHandler"
INVALID_RESULT = "rdq.InvalidResult"
LEASE_EXPIRED = "rdq.LeaseExpired"


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
    message = message[: Limits.error_message_chars]
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
    #: Handlers that overran their timeout and were left behind (``abandon_overdue_handlers``).
    abandoned: int = 0

    def add(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1


class ClaimLedger:
    """Claims a worker holds, for the heartbeat. The default does nothing (Lambda host)."""

    def hold(self, claimed: Sequence[ClaimedTask]) -> None: ...

    def running(self, ref: ClaimRef, until: float) -> None: ...

    def drop(self, refs: Sequence[ClaimRef]) -> None: ...


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
    ) -> None:
        self.storage = storage
        self.policies = policies or PolicyBook()
        self.registry = registry or default_registry
        self.telemetry = telemetry or Telemetry()
        self.lease_seconds = lease_seconds
        self.settle_batch = settle_batch
        self.settle_interval = settle_interval
        self.settle_margin = settle_margin
        self.clock = clock
        self.abandon_overdue_handlers = abandon_overdue_handlers
        # One helper thread per calling thread (claim loop), replaced when a handler hangs.
        self._handler_threads = threading.local()
        self._all_handler_threads: list[_HandlerThread] = []
        self._threads_lock = threading.Lock()

    def close(self) -> None:
        """Let idle helper threads exit (hung ones exit if their handler ever returns)."""
        with self._threads_lock:
            threads, self._all_handler_threads = self._all_handler_threads, []
        for thread in threads:
            thread.close()

    def run(
        self,
        claimed: Sequence[ClaimedTask],
        deadline: float = math.inf,
        ledger: ClaimLedger | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> BatchReport:
        """Run ``claimed`` in order until done or out of time; settle and release everything."""
        ledger = ledger or ClaimLedger()
        report = BatchReport()
        pending: list[Settlement] = []
        unstarted: list[ClaimedTask] = []
        first_buffered = 0.0
        for index, item in enumerate(claimed):
            if should_stop():
                unstarted += claimed[index:]
                break
            spec = self.registry.get(item.task.handler)
            needed = (spec.timeout_seconds if spec else 0.0) + self.settle_margin
            if deadline - self.clock() < needed:
                # Too long for the time left; a quicker task later in the batch may still fit.
                unstarted.append(item)
                continue
            report.started += 1
            settlement = self.execute(item, deadline, ledger)
            if settlement is None:
                # Abandoned after overrunning its timeout: nothing to settle; its lease expires.
                report.abandoned += 1
                continue
            report.add(settlement.outcome)
            if not pending:
                first_buffered = self.clock()
            pending.append(settlement)
            if len(pending) >= self.settle_batch or self.clock() - first_buffered >= self.settle_interval:
                self._flush(pending, report, ledger, deadline)
                pending = []
        self._flush(pending, report, ledger, deadline)
        self._release(unstarted, report, ledger, deadline)
        return report

    def execute(self, item: ClaimedTask, deadline: float, ledger: ClaimLedger) -> Settlement | None:
        """Run one task's handler and turn what happened into a settlement decision; None when
        the handler overran its timeout and was abandoned (``abandon_overdue_handlers``)."""
        task = item.task
        spec = self.registry.get(task.handler)
        if spec is None:
            error = ErrorInfo(UNKNOWN_HANDLER, f"no handler named {task.handler!r} is registered in this worker")
            return Settlement(task.id, item.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=error)
        run_until = min(deadline, self.clock() + spec.timeout_seconds)
        ledger.running(item.ref, run_until)
        ctx = TaskContext(
            task_id=task.id,
            queue=task.queue,
            attempt=task.attempt_count + 1,
            redrive_count=task.redrive_count,
            headers=task.headers,
            deadline=run_until,
            extend=lambda seconds: self._extend(item.ref, seconds),
        )
        if self.abandon_overdue_handlers:
            return self._execute_on_helper_thread(item, spec, ctx, run_until, ledger)
        return self._invoke(item, spec, ctx)

    def _invoke(self, item: ClaimedTask, spec, ctx: TaskContext) -> Settlement:
        task = item.task
        try:
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
                task, item.claim_token, Outcome.RETRYABLE_FAILURE, ErrorInfo(INVALID_RESULT, problem)
            )
        return Settlement(task.id, item.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)

    def _execute_on_helper_thread(
        self, item: ClaimedTask, spec, ctx: TaskContext, run_until: float, ledger: ClaimLedger
    ) -> Settlement | None:
        """Run the handler on this claim loop's helper thread and wait until its time is up.

        Python cannot kill a thread, so a handler that overruns is *abandoned*: the helper is
        replaced, the claim loop goes on with the batch, the heartbeat stops renewing the task
        (its ``until`` has passed) and the reaper records LEASE_EXPIRED. If the handler ever
        returns, its outcome is still offered to storage, fenced by the claim token.
        """
        state = {"settlement": None, "abandoned": False}
        finished = threading.Event()
        lock = threading.Lock()

        def job() -> None:
            settlement = self._invoke(item, spec, ctx)
            with lock:
                state["settlement"] = settlement
                late = state["abandoned"]
                finished.set()
            if late:
                self._flush([settlement], BatchReport(), ledger)

        self._helper_thread().submit(job)
        if finished.wait(max(0.0, run_until - self.clock())):
            return state["settlement"]
        with lock:
            if finished.is_set():  # it made it at the last moment
                return state["settlement"]
            state["abandoned"] = True
            self._handler_threads.current = None  # the next task gets a fresh helper
        self.telemetry.count("abandoned_handlers")
        log.error(
            "handler %r of task %s overran its timeout of %gs; abandoned it (its lease will "
            "expire and the reaper will record LEASE_EXPIRED), serving the rest of the batch",
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
        self.storage.extend_leases([ref], seconds or self.lease_seconds)

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
        try:
            _with_retries(lambda: self.storage.settle(settlements), budget_seconds=self._write_budget(deadline))
        except StaleClaim as exc:
            # The lease was lost (reaped after expiry): the late outcome is fenced off by design.
            refused = set(exc.task_ids)
            report.stale += len(refused)
            self.telemetry.count("stale_settlements", len(refused))
            log.warning("settle refused for %d task(s) whose claim was lost: %s", len(refused), ", ".join(sorted(refused)))
        except StorageUnavailable:
            log.error("could not settle %d task(s): storage unavailable; their leases will expire", len(settlements))
            return
        finally:
            ledger.drop([ClaimRef(s.task_id, s.claim_token) for s in settlements])
        for s in settlements:
            if s.task_id not in refused:
                self.telemetry.count(_SETTLED_METRIC[s.status])

    def _release(
        self, items: Sequence[ClaimedTask], report: BatchReport, ledger: ClaimLedger, deadline: float = math.inf
    ) -> None:
        if not items:
            return
        refs = [item.ref for item in items]
        try:
            _with_retries(lambda: self.storage.release(refs), budget_seconds=self._write_budget(deadline))
            report.released += len(refs)
        except StaleClaim as exc:
            report.released += len(refs) - len(exc.task_ids)
            report.stale += len(exc.task_ids)
        except StorageUnavailable:
            log.error("could not release %d task(s): storage unavailable; their leases will expire", len(refs))
        finally:
            ledger.drop(refs)
        self.telemetry.count("released", report.released)


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
