"""Writing a batch's outcomes and releases: buffered, retried through outages, never lost.

* outcomes are buffered and settled many per round trip, but never wait longer than
  ``settle_interval``: the buffer has its own thread, so a long next handler cannot keep a
  finished task unsettled (and the heartbeat renews buffered claims until they are written);
* at the batch's deadline that thread also settles everything and releases the unstarted rest
  of the batch, so a handler that overruns a Lambda invocation can only cost its own task;
* a settle or release that meets an outage is retried with backoff for up to one lease (bounded
  by the deadline): the store coming back within the lease keeps the outcome instead of
  re-running it; an unexpected error settles the batch one by one, so one item cannot take its
  neighbours' outcomes with it;
* whatever a store raises, every claim ends settled or released, or is dropped from the
  ``ClaimLedger`` so that its lease expires -- never renewed and forgotten;
* in a claim loop (``SettleBehind``), the last write of a batch happens on a thread of its own
  while the loop claims and runs the next batch, so the store's work and the handlers' overlap;
  one batch at a time is written behind, and the loop waits for it before it ends.
"""

from __future__ import annotations

import logging
import math
import queue as queue_module
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import StaleClaim, StorageUnavailable
from ..model import ClaimedTask, ClaimRef, Outcome, Settlement, TaskStatus
from ..storage.spi import Storage
from .telemetry import Telemetry

# The engine's lines keep one logger name whichever module writes them; operators filter on it.
log = logging.getLogger("rdq.runner")


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
    handler runs (however long: an overrunning handler keeps its task) and while its outcome
    waits in the settle buffer. A claim is dropped only once its settle or release has
    returned, or has failed for good.
    """

    def hold(self, claimed: Sequence[ClaimedTask]) -> None: ...

    def drop(self, refs: Sequence[ClaimRef]) -> None: ...


class BatchCursor:
    """A claimed batch as the runner walks it. The deadline watchdog (``OutcomeBuffer``) may
    take everything not yet started, to release it while a handler overruns."""

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


_SETTLED_METRIC = {TaskStatus.SUCCEEDED: "succeeded", TaskStatus.DEAD: "dead_lettered", TaskStatus.PENDING: "retried"}


class Settler:
    """The runner's writes: settle outcomes and release unstarted claims, through outages."""

    def __init__(
        self,
        storage: Storage,
        telemetry: Telemetry,
        *,
        lease_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.storage = storage
        self.telemetry = telemetry
        #: How long a write may keep retrying through an outage when the call names no lease of
        #: its own (see ``_write_budget``). A batch passes its own lease with each write.
        self.default_lease_seconds = lease_seconds
        self.clock = clock
        self.sleep = sleep

    def settle(
        self, settlements: list[Settlement], report: BatchReport, ledger: ClaimLedger, deadline: float = math.inf,
        lease_seconds: float | None = None,
    ) -> None:
        if not settlements:
            return
        refused: set[str] = set()
        failed: set[str] = set()
        try:
            self._with_retries(lambda: self.storage.settle(settlements), self._write_budget(deadline, lease_seconds))
        except StaleClaim as exc:
            refused = set(exc.task_ids)
        except StorageUnavailable:
            log.error("could not settle %d task(s): storage unavailable; their leases will expire", len(settlements))
            failed = {s.task_id for s in settlements}
        except Exception:  # an unclassified store error must not lose the batch
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
                self.telemetry.count("snoozed" if s.outcome is Outcome.SNOOZED else _SETTLED_METRIC[s.status])

    def release(
        self, items: Sequence[ClaimedTask], report: BatchReport, ledger: ClaimLedger, deadline: float = math.inf,
        lease_seconds: float | None = None,
    ) -> None:
        if not items:
            return
        refs = [item.ref for item in items]
        released = 0
        try:
            self._with_retries(lambda: self.storage.release(refs), self._write_budget(deadline, lease_seconds))
            released = len(refs)
        except StaleClaim as exc:
            released = len(refs) - len(exc.task_ids)
            report.stale += len(exc.task_ids)
        except StorageUnavailable:
            log.error("could not release %d task(s): storage unavailable; their leases will expire", len(refs))
            report.failed_writes += len(refs)
        except Exception:  # stop renewing them either way (finally), so they are reaped
            log.exception("could not release %d task(s): unexpected store error; their leases will expire", len(refs))
            report.failed_writes += len(refs)
        finally:
            ledger.drop(refs)
        report.released += released
        self.telemetry.count("released", released)

    def _settle_one_by_one(self, settlements: list[Settlement]) -> tuple[set[str], set[str]]:
        """After an unexpected error. Returns (refused as stale, failed for good); a failed
        task's lease expires and the reaper records LEASE_EXPIRED, so it is retried, never held."""
        refused: set[str] = set()
        failed: set[str] = set()
        for settlement in settlements:
            try:
                self.storage.settle([settlement])
            except StaleClaim:
                refused.add(settlement.task_id)
            except Exception:
                failed.add(settlement.task_id)
                log.exception("could not settle task %s; its lease will expire", settlement.task_id)
        return refused, failed

    def _write_budget(self, deadline: float, lease_seconds: float | None) -> float:
        """How long a settle/release may keep retrying through an outage: up to one lease
        (after that the reaper owns the task anyway), never past the deadline."""
        lease = self.default_lease_seconds if lease_seconds is None else lease_seconds
        return max(0.0, min(lease, deadline - self.clock() - 0.5))

    def _with_retries(
        self, write: Callable[[], None], budget_seconds: float, attempts: int = 3, first_delay: float = 0.2
    ) -> None:
        """Retry a write on StorageUnavailable: at least ``attempts`` times, and for as long as
        ``budget_seconds`` allows (backoff doubling to 2 s). Settlements are idempotent under
        fencing: a repeat of an applied settle is refused as stale, never applied twice."""
        delay = first_delay
        give_up_at = self.clock() + budget_seconds
        attempt = 0
        while True:
            attempt += 1
            try:
                write()
                if attempt > 1:
                    log.info("storage write succeeded on attempt %d after an outage", attempt)
                return
            except StorageUnavailable as exc:
                if attempt >= attempts and self.clock() + delay > give_up_at:
                    raise
                log.debug("storage write failed (%s); retrying in %.1fs", exc, delay)
                self.sleep(delay)
                delay = min(delay * 2, 2.0)


class OutcomeBuffer:
    """Outcomes waiting to be settled many per round trip, with a thread of its own that writes
    them once the oldest has waited ``settle_interval`` -- even while the runner is inside the
    next handler, however long that one runs. At the deadline it also settles everything and
    releases the unstarted rest of the batch."""

    def __init__(
        self,
        settler: Settler,
        report: BatchReport,
        ledger: ClaimLedger,
        batch: BatchCursor,
        deadline: float,
        *,
        settle_batch: int,
        settle_interval: float,
        lease_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        write_behind: bool = False,
    ) -> None:
        self._settler = settler
        #: The batch's lease, given when the batch started: bounds how long a write retries.
        self._lease_seconds = lease_seconds
        #: A full buffer is written by the buffer's thread rather than by the caller of ``add``
        #: (the runner's thread goes on with the next handler meanwhile).
        self._write_behind = write_behind
        self._full = False
        self._report = report
        self._ledger = ledger
        self._batch = batch
        self._deadline = deadline
        self._settle_batch = settle_batch
        self._settle_interval = settle_interval
        self._clock = clock
        self._pending: list[Settlement] = []
        self._oldest = math.inf
        self._lock = threading.Lock()
        # Serialises writes: the runner (batch full), the buffer's thread (age, deadline) and
        # close() never settle concurrently, and close() returns only after all are done.
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch_while_a_handler_runs(self) -> None:
        """Called before each handler: from here on something may wait on it -- a buffered
        outcome, or (with a deadline) unstarted claims -- so start the watcher if it is not
        running. A batch of one task on Lambda, the common case at low load, needs no thread."""
        if self._thread is None and (self._pending or (math.isfinite(self._deadline) and self._batch.has_unstarted())):
            self._start_watcher()

    def _start_watcher(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="rdq-settle", daemon=True)
        self._thread.start()

    def add(self, settlement: Settlement) -> None:
        with self._lock:
            if not self._pending:
                self._oldest = self._clock()
                self._wake.set()  # the watcher re-arms its timer for this one
            self._pending.append(settlement)
            full = len(self._pending) >= self._settle_batch
        if not full:
            return
        if not self._write_behind:
            self.flush()
            return
        with self._lock:
            self._full = True
        self._wake.set()
        if self._thread is None:
            self._start_watcher()

    def flush(self) -> None:
        with self._write_lock:
            with self._lock:
                batch, self._pending, self._oldest, self._full = self._pending, [], math.inf, False
            self._settler.settle(batch, self._report, self._ledger, self._deadline, self._lease_seconds)

    def release_unstarted(self) -> None:
        """Release every claim of the batch whose handler has not started."""
        with self._write_lock:
            self._settler.release(self._batch.take_unstarted(), self._report, self._ledger, self._deadline,
                                  self._lease_seconds)

    def close(self) -> None:
        """Stop the watcher (after any write it has in progress) and settle what is left."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def _watch(self) -> None:
        clock = self._clock
        deadline_handled = False
        while True:
            with self._lock:
                if self._closed:
                    return
                due = -math.inf if self._full else self._oldest + self._settle_interval
            if not deadline_handled:
                due = min(due, self._deadline)
            wait = due - clock()
            if wait > 0:
                self._wake.wait(None if math.isinf(wait) else wait)
                self._wake.clear()
                continue
            if not deadline_handled and clock() >= self._deadline:
                deadline_handled = True
                self.release_unstarted()
            self.flush()


class SettleBehind:
    """One claim loop's batch being finished behind it: the batch's last settle (and anything
    else its ``finish`` does) runs on a thread of its own while the loop claims and runs the next
    batch. At most one batch at a time: handing over the next one first waits for this one, so
    settles happen in batch order and a slow store slows the loop down instead of piling up
    batches. The claims stay in the ledger (renewed) until their settle has returned. One thread
    serves every batch of the loop (started with the first, ended by ``close``)."""

    def __init__(self) -> None:
        self._finishes: queue_module.SimpleQueue[Callable[[], None] | None] = queue_module.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    def hand_over(self, finish: Callable[[], None]) -> None:
        self.wait()
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="rdq-settle-behind", daemon=True)
            self._thread.start()
        self._finishes.put(finish)

    def wait(self) -> None:
        """Until the batch handed over last is finished (its outcomes written or given up on)."""
        self._idle.wait()

    def close(self) -> None:
        """Finish what was handed over, then end the thread."""
        self.wait()
        if self._thread is not None:
            self._finishes.put(None)
            self._thread.join()
            self._thread = None

    def _serve(self) -> None:
        while (finish := self._finishes.get()) is not None:
            try:
                finish()
            except Exception:  # the Settler already logs and accounts for store errors; this is a bug
                log.exception("unexpected error finishing a batch behind the claim loop")
            finally:
                self._idle.set()
