"""Running a claimed batch: claim → execute → decide → settle, for both hosts.

The Lambda worker passes the invocation's deadline; the long-running ``rdq worker`` passes no
deadline and renews leases with a heartbeat instead (its ``ClaimLedger``). The parts:
``execution`` walks the batch and runs each handler under its deadline (the long-running worker
hands the whole walk to a helper thread and abandons a handler that overruns),
``outcomes`` decides what happened, ``settling`` buffers and writes the decisions. The per-task
steps below (``_run_one``) therefore run on that helper thread there, including a buffer flush.

Scheduling, enforced here (each rule is a test in the compliance kit): a task starts only if
its handler's ``timeout_seconds`` (plus a settle margin) still fits before the deadline; the rest
of the batch is *released* (no attempt spent). A handler whose timeout can never fit this host
(``longest_run_seconds``) is dead-lettered on its first claim with ``rdq.TimeoutExceedsWorker``
instead of being released forever. Whatever happens, every claim of the batch ends settled,
released or, for an overrunning handler, still held and tracked -- never renewed and forgotten.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from . import outcomes
from .execution import HandlerExecution, Overrun
from ..flow import RATE_START_SLACK
from .handlers import HandlerRegistry, HandlerSpec, registry as default_registry
from ..model import ClaimedTask, ClaimRef, Outcome, Settlement
from .retry import PolicyBook
from .settling import BatchCursor, BatchReport, ClaimLedger, OutcomeBuffer, SettleBehind, Settler
from ..storage.spi import Storage
from .telemetry import Telemetry
from .transactions import Completion

log = logging.getLogger("rdq.runner")

__all__ = ["BatchReport", "BatchRunner", "ClaimLedger", "Overrun"]


@dataclass(frozen=True, eq=False)  # compared by identity: one per run
class _ActiveBatch:
    cursor: BatchCursor
    buffer: OutcomeBuffer
    report: BatchReport
    ledger: ClaimLedger
    deadline: float
    #: When the claim came back (this host's clock): a rate-keyed task starts within
    #: RATE_START_SLACK of it or is released unstarted.
    received: float
    #: The lease the batch was claimed with, given when it started and never changed: the least
    #: an ``extend_lease`` renews to, and how long a write of its outcomes may retry.
    lease_seconds: float


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
        sleep: Callable[[float], object] = time.sleep,
        abandon_overdue_handlers: bool = False,
        longest_run_seconds: float = math.inf,
        longest_run_reason: str = "",
    ) -> None:
        self.storage = storage
        self.policies = policies or PolicyBook()
        self.registry = registry or default_registry
        self.telemetry = telemetry or Telemetry()
        self.settle_batch = settle_batch
        self.settle_interval = settle_interval
        self.settle_margin = settle_margin
        self.clock = clock
        #: The longest time this host can ever give one task (a Lambda worker: its function
        #: timeout minus the settle reserve). A handler whose timeout needs more never runs.
        self.longest_run_seconds = longest_run_seconds
        self.longest_run_reason = longest_run_reason
        self.execution = HandlerExecution(self.policies, self.telemetry,
                                          abandon_overdue_handlers=abandon_overdue_handlers, clock=clock)
        self.settler = Settler(storage, self.telemetry, lease_seconds=lease_seconds, clock=clock, sleep=sleep)
        self._lock = threading.Lock()
        self._active_batches: list[_ActiveBatch] = []
        #: Batches claimed ahead of their run (``rdq_core.engine.claiming.ClaimAhead``), each with
        #: ``release_now() -> int``, for ``settle_and_release_now``.
        self._claimed_ahead: list[Any] = []

    @property
    def lease_seconds(self) -> float:
        """The lease of a batch run without one of its own (``run(lease_seconds=None)``). A claim
        loop passes each batch the lease it claimed that batch with instead."""
        return self.settler.default_lease_seconds

    def close(self) -> None:
        """Let idle helper threads exit (overrunning ones exit when their handler returns)."""
        self.execution.close()

    def running(self) -> dict[str, str]:
        """Task id -> handler name of every handler running now (overrunning ones included)."""
        return self.execution.running()

    def overruns(self) -> list[Overrun]:
        """Handlers running past their timeout right now; their tasks are still held."""
        return self.execution.overruns()

    def track_claimed_ahead(self, waiting: Any, tracked: bool = True) -> None:
        """Count ``waiting`` (a ``ClaimAhead``) among what ``settle_and_release_now`` releases, or
        stop counting it."""
        with self._lock:
            if tracked:
                self._claimed_ahead.append(waiting)
            elif waiting in self._claimed_ahead:
                self._claimed_ahead.remove(waiting)

    def settle_and_release_now(self) -> int:
        """For a host about to exit at once (a second Ctrl-C): write every buffered outcome and
        release every claim whose handler has not started, in every batch in progress and every
        batch claimed ahead. Running handlers are left to their leases. Returns the number of
        claims released."""
        with self._lock:
            active = list(self._active_batches)
        released = 0
        for batch in active:
            batch.buffer.flush()
            before = batch.report.released
            self.settler.release(batch.cursor.take_unstarted(), batch.report, batch.ledger, batch.deadline,
                                 batch.lease_seconds)
            released += batch.report.released - before
        with self._lock:
            ahead = list(self._claimed_ahead)
        for waiting in ahead:
            released += waiting.release_now()
        return released

    def run(
        self,
        claimed: Sequence[ClaimedTask],
        deadline: float = math.inf,
        ledger: ClaimLedger | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        settle_behind: SettleBehind | None = None,
        lease_seconds: float | None = None,
    ) -> BatchReport:
        """Run ``claimed`` in order until done or out of time; settle and release everything.

        With ``settle_behind`` (a claim loop's), the batch's outcomes are written on other
        threads: a full buffer by the buffer's thread, the rest once the batch is done by
        ``settle_behind``'s, so this returns while the last settle is still on its way (its
        ``stale`` and ``failed_writes`` counts arrive with it). A batch that ends with claims
        not started (stopping, out of time) is finished here, as without it.

        ``lease_seconds``: the lease ``claimed`` was taken with (default ``self.lease_seconds``);
        it belongs to this batch alone, so batches of other threads keep theirs."""
        received = self.clock()
        lease = self.lease_seconds if lease_seconds is None else lease_seconds
        ledger = ledger or ClaimLedger()
        ledger.hold(claimed)
        report = BatchReport()
        cursor = BatchCursor(self._rate_limited_first(claimed))
        buffer = OutcomeBuffer(self.settler, report, ledger, cursor, deadline, settle_batch=self.settle_batch,
                               settle_interval=self.settle_interval, lease_seconds=lease, clock=self.clock,
                               write_behind=settle_behind is not None)
        active = _ActiveBatch(cursor, buffer, report, ledger, deadline, received, lease)
        with self._lock:
            self._active_batches.append(active)
        finish = functools.partial(self._finish, active)
        try:
            # Overrunning handlers were left running, their tasks still held (see execution).
            report.abandoned += self.execution.run_batch(cursor.take, lambda item: self._run_one(item, active, should_stop))
        except BaseException:
            finish()
            raise
        if settle_behind is not None and not cursor.has_unstarted():
            settle_behind.hand_over(finish)
        else:
            finish()
        return report

    def _finish(self, batch: _ActiveBatch) -> None:
        """Write what the batch's buffer holds, release its unstarted claims, forget it."""
        try:
            batch.buffer.close()
            self.settler.release(batch.cursor.take_unstarted(), batch.report, batch.ledger, batch.deadline,
                                 batch.lease_seconds)
        finally:
            with self._lock:
                self._active_batches.remove(batch)

    def _run_one(self, item: ClaimedTask, batch: _ActiveBatch, should_stop: Callable[[], bool]) -> bool:
        """Start, set aside or dead-letter one claimed task; False when the batch stops here."""
        if should_stop():
            batch.cursor.set_aside(item)
            return False
        spec = self.registry.get(item.task.handler)  # looked up once per task
        needed = (spec.timeout_seconds if spec else 0.0) + self.settle_margin
        if spec is not None and needed > self.longest_run_seconds:
            batch.report.too_long += 1
            batch.buffer.add(self._too_long_for_host(item, spec, needed))
            return True
        if batch.deadline - self.clock() < needed:
            # Too long for the time left; a quicker task later in the batch may still fit.
            batch.cursor.set_aside(item)
            return True
        if self._rate_limited(item) and self.clock() - batch.received > RATE_START_SLACK:
            # Its rate slot was counted from the claim: starting it now could put more starts
            # in one window than the rate allows. Released, it gives the slot back and is
            # claimed again (first in its batch, so it starts at once).
            self.telemetry.count("rate_start_released")
            batch.cursor.set_aside(item)
            return True
        batch.report.started += 1
        batch.buffer.watch_while_a_handler_runs()
        began = self.clock()
        # ctx.transaction() (rdq_core/engine/transactions.py): a completion written in the handler's own
        # transaction stops the claim's renewal at once, and nothing more is settled for it.
        completion = Completion(self.storage, item, started_after_seconds=max(0.0, began - batch.received),
                                on_settled=lambda: batch.ledger.drop([item.ref]))
        settlement = replace(self._execute(item, spec, batch, completion),
                             started_after_seconds=max(0.0, began - batch.received))
        if completion.settled:
            self._settled_in_transaction(item, completion, settlement, batch.report, self.clock() - began)
            return True
        batch.report.add(settlement.outcome)
        outcomes.log_outcome(item.task, settlement, self.policies, self.clock() - began)
        # Buffered outcomes are durable within settle_interval even while the next
        # handler runs (the buffer's own thread writes them), and the ledger renews
        # their leases until then: a finished task is never reaped and run again.
        batch.buffer.add(settlement)
        return True

    def _rate_limited(self, item: ClaimedTask) -> bool:
        return item.task.rate_key is not None and self.policies.flow_for(item.task.queue).rate_limit is not None

    def _rate_limited_first(self, claimed: Sequence[ClaimedTask]) -> Sequence[ClaimedTask]:
        """The batch with its rate-limited tasks first (each group in claim order): a rate limit
        counts starts, and a task can start at its claim only if nothing runs before it."""
        if not any(self._rate_limited(item) for item in claimed):
            return claimed
        return sorted(claimed, key=lambda item: not self._rate_limited(item))

    def _execute(self, item: ClaimedTask, spec: HandlerSpec | None, batch: _ActiveBatch,
                 completion: Completion | None = None) -> Settlement:
        if spec is None:
            return outcomes.unknown_handler(item)

        def settle_late(settlement: Settlement) -> None:
            # An overrunning handler's outcome, once it returns, is written on its own -- unless
            # its transaction already settled the task.
            if completion is None or not completion.settled:
                self.settler.settle([settlement], BatchReport(), batch.ledger, lease_seconds=batch.lease_seconds)

        return self.execution.execute(
            item, spec, batch.deadline,
            extend=lambda seconds: self._extend(item.ref, seconds, batch.lease_seconds),
            settle_late=settle_late,
            completion=completion,
        )

    def _settled_in_transaction(self, item: ClaimedTask, completion: Completion, returned: Settlement,
                                report: BatchReport, seconds: float) -> None:
        """Account for a task whose outcome its handler's transaction decided (committed, or
        fenced out by a lost claim); the store already holds it, so nothing is written."""
        if completion.committed is not None:
            report.add(Outcome.SUCCESS)
            self.telemetry.count("succeeded")
            outcomes.log_outcome(item.task, completion.committed, self.policies, seconds)
            if returned.outcome is not Outcome.SUCCESS:
                log.warning("task %s: the handler failed after its transaction committed (%s); the task stays "
                            "SUCCEEDED", item.task.id, returned.error.type if returned.error else returned.outcome.value)
            return
        report.stale += 1
        self.telemetry.count("stale_settlements")
        log.warning("task %s: its transaction was fenced out (the claim was lost: lease expired and reaped) and "
                    "rolled back; the reaper's LEASE_EXPIRED attempt stands", item.task.id)

    def _too_long_for_host(self, item: ClaimedTask, spec: HandlerSpec, needed: float) -> Settlement:
        message = outcomes.timeout_exceeds_worker_message(spec.name, spec.timeout_seconds, needed, self.settle_margin,
                                                          self.longest_run_seconds, self.longest_run_reason)
        log.warning("dead-lettering task %s: %s", item.task.id, message)
        self.telemetry.count("too_long_for_worker")
        settlement = outcomes.timeout_exceeds_worker(item, message)
        outcomes.log_outcome(item.task, settlement, self.policies, None)
        return settlement

    def _extend(self, ref: ClaimRef, seconds: float | None, lease_seconds: float) -> None:
        # Never less than a normal lease: on Lambda that lease already outlives the invocation,
        # so a handler asking for a short extension cannot let its task go while it runs.
        # (Stores also never move an expiry earlier.)
        self.storage.extend_leases([ref], max(seconds or 0.0, lease_seconds))
