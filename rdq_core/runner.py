"""Running a claimed batch: execute handlers, classify outcomes, settle in batches.

Shared by both hosts: the Lambda worker passes the invocation's deadline; the long-running
``rdq worker`` passes no deadline and renews leases with a heartbeat instead.

Rules enforced here:
* a task starts only if its handler's ``timeout_seconds`` (plus a settle margin) still fits
  before the deadline; the rest of the batch is *released* (no attempt spent);
* ``PermanentError`` and an unknown handler dead-letter at once; any other exception, including
  panic-like ``BaseException`` s such as ``SystemExit`` or ``RecursionError``, is a retryable
  failure recorded with its type and a truncated stack;
* outcomes are buffered and settled many per round trip.
"""

from __future__ import annotations

import json
import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .errors import PermanentError, StaleClaim, StorageUnavailable
from .handlers import HandlerRegistry, TaskContext, registry as default_registry
from .model import ClaimedTask, ClaimRef, ErrorInfo, Outcome, Settlement, TaskStatus
from .retry import PolicyBook
from .storage.spi import Storage
from .telemetry import Telemetry
from .validation import Limits, has_nul

log = logging.getLogger("rdq.runner")

UNKNOWN_HANDLER = "rdq.UnknownHandler"
INVALID_RESULT = "rdq.InvalidResult"
LEASE_EXPIRED = "rdq.LeaseExpired"


def error_from_exception(exc: BaseException) -> ErrorInfo:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    stack = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    return truncated_error(name, str(exc), stack)


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
        first_buffered = 0.0
        for index, item in enumerate(claimed):
            spec = self.registry.get(item.task.handler)
            needed = (spec.timeout_seconds if spec else 0.0) + self.settle_margin
            if should_stop() or deadline - self.clock() < needed:
                rest = list(claimed[index:])
                self._flush(pending, report, ledger)
                pending = []
                self._release(rest, report, ledger)
                break
            report.started += 1
            settlement = self.execute(item, deadline, ledger)
            report.add(settlement.outcome)
            if not pending:
                first_buffered = self.clock()
            pending.append(settlement)
            if len(pending) >= self.settle_batch or self.clock() - first_buffered >= self.settle_interval:
                self._flush(pending, report, ledger)
                pending = []
        self._flush(pending, report, ledger)
        return report

    def execute(self, item: ClaimedTask, deadline: float, ledger: ClaimLedger) -> Settlement:
        """Run one task's handler and turn what happened into a settlement decision."""
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

    # -- storage writes --------------------------------------------------------------------
    def _extend(self, ref: ClaimRef, seconds: float | None) -> None:
        self.storage.extend_leases([ref], seconds or self.lease_seconds)

    def _flush(self, settlements: list[Settlement], report: BatchReport, ledger: ClaimLedger) -> None:
        if not settlements:
            return
        refused: set[str] = set()
        try:
            _with_retries(lambda: self.storage.settle(settlements))
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

    def _release(self, items: Sequence[ClaimedTask], report: BatchReport, ledger: ClaimLedger) -> None:
        if not items:
            return
        refs = [item.ref for item in items]
        try:
            _with_retries(lambda: self.storage.release(refs))
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
    try:
        encoded = json.dumps(result, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        return f"handler returned a value that is not JSON-serialisable: {exc}"[: Limits.error_message_chars]
    if "\\u0000" in encoded and has_nul(result):
        return "handler result contains a NUL character (\\u0000), which storage cannot hold"
    if len(encoded.encode()) > Limits.result_bytes:
        return f"handler result exceeds {Limits.result_bytes} bytes once encoded as JSON"
    return None


def _with_retries(write: Callable[[], None], attempts: int = 3, first_delay: float = 0.2) -> None:
    """Retry a write on StorageUnavailable a few times: settlements are idempotent under
    fencing (a repeat of an applied settle is refused as stale, never applied twice)."""
    delay = first_delay
    for attempt in range(attempts):
        try:
            write()
            return
        except StorageUnavailable:
            if attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay *= 2
