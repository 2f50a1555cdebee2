"""The long-running worker host (``rdq worker``): claim, run, settle, with a lease heartbeat.

On a container host there is no invocation deadline, so the lease is short (``--lease``) and a
heartbeat thread renews it for every claim the worker holds: waiting in its batch, running, or
with its outcome waiting in the settle buffer. A claim stops being renewed only once it is
settled or released.

A handler that overruns its ``timeout_seconds`` keeps its task (Python cannot stop a thread):
the batch goes on without it, and if it has still not returned ``overrun_grace_seconds`` later
the worker stops claiming, settles and releases everything else, and ends with
``exit_reason = "handler_overran"``; ``rdq worker`` then kills every process under it (what
the handlers started: ``rdq_core.engine.process_tree``) and restarts its process, which is what stops
the handler's thread. Only after that can its lease lapse, so two executions of one task never
overlap (a process that left the worker's process tree, by a double fork, is the limit: see
docs/running-workers.md).

The worker also runs the maintenance pass itself (every ``reap_interval_seconds``, bounded by
it: ``rdq_core.engine.maintenance``), so a crashed worker's tasks come back, bulk operations advance and
the outbox is delivered without a separate ``rdq reaper``.

Storage outages: the claim loop (``rdq_core.engine.claiming``, shared with the Lambda worker) backs
off (0.5 s doubling to 30 s) and reconnects; the claim loop, the heartbeat and the reaper share
one ``StorageHealth``, so an outage logs one line when it starts and one when the store answers
again, however many retries happen in between.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...engine.claiming import ClaimLoop, fitted_worker_name, run_concurrently
from ...errors import StaleClaim, StorageUnavailable
from ...engine.execution import Overrun
from ...engine.handlers import HandlerRegistry
from ...model import ClaimedTask, ClaimRef
from ...engine.outage import StorageHealth
from ...engine.retry import PolicyBook
from ...aws.eventbridge import publisher_from_settings
from ...events import EventSettings
from ...engine.maintenance import MaintenancePlan, retention_hours_from_env, run_maintenance
from ...engine.reaper import store_outage
from ...engine.runner import BatchRunner
from ...engine.settling import ClaimLedger
from ...storage.spi import Storage
from ...engine.telemetry import Telemetry
from ...engine.wakeup import StopEvent, WakeSignal

log = logging.getLogger("rdq.worker")

QUEUE_LIST_TTL_SECONDS = 5.0


class HeartbeatLedger(ClaimLedger):
    """Claims held by this worker, renewed in one batched write per beat."""

    def __init__(self, storage: Storage, lease_seconds: float, health: StorageHealth | None = None) -> None:
        self.storage = storage
        self.lease_seconds = lease_seconds
        self.health = health or StorageHealth(log)
        self._held: dict[str, ClaimRef] = {}
        self._lock = threading.Lock()
        self.lost: set[str] = set()

    def hold(self, claimed: Sequence[ClaimedTask]) -> None:
        with self._lock:
            for item in claimed:
                self._held[item.task.id] = item.ref

    def drop(self, refs: Sequence[ClaimRef]) -> None:
        with self._lock:
            for ref in refs:
                if self._held.get(ref.task_id) == ref:
                    del self._held[ref.task_id]

    def held(self) -> list[ClaimRef]:
        with self._lock:
            return list(self._held.values())

    def beat(self) -> None:
        refs = self.held()
        if not refs:
            return
        try:
            self.storage.extend_leases(refs, self.lease_seconds)
        except StaleClaim as exc:
            # A claim settled or released while this beat was on its way is refused too, and is
            # no longer held by the time the refusal comes back: its settle won the race, nothing
            # was lost. One still held is lost -- only possible after the store was out of reach
            # for longer than a lease: it is someone else's now. Stop renewing it (its outcome
            # will be fenced off).
            still_held = {ref.task_id for ref in self.held()}
            lost = set(exc.task_ids) & still_held
            if lost:
                self.lost.update(lost)
                self.drop([ref for ref in refs if ref.task_id in lost])
                log.warning("lost the lease of %d task(s); their outcome will be fenced off", len(lost))
        except StorageUnavailable as exc:
            self.health.failed("heartbeat", exc)  # retried next beat
            return
        except Exception:  # a beat that fails oddly is retried, never the end of the heartbeat
            log.exception("unexpected error renewing %d lease(s); retrying next beat", len(refs))
            return
        self.health.ok()


#: ``Worker.exit_reason`` when it stopped because a handler overran past its grace period.
HANDLER_OVERRAN = "handler_overran"


#: How long the schedules loop lets the first claim go first (it waits only while that claim
#: has not reached the store yet, e.g. during an outage at start).
FIRST_CLAIM_HEAD_START_SECONDS = 3.0


@dataclass
class WorkerConfig:
    #: Queues to serve; empty means every queue in the store (re-read every few seconds).
    queues: Sequence[str] = ()
    batch_size: int = 10
    lease_seconds: float = 30.0
    #: Claim loops on threads of their own (``run_concurrently``): up to this many handlers run at
    #: once. Each loop claims ``batch_size`` per round trip.
    concurrency: int = 1
    #: Seconds an idle claim loop waits before claiming again; None: the store's
    #: ``idle_poll_seconds``. An enqueue wakes it at once where the store can push (``wake_up``).
    idle_poll_seconds: float | None = None
    #: Listen for enqueues (PostgreSQL LISTEN/NOTIFY, Redis pub/sub) to end an idle wait early.
    wake_up: bool = True
    #: Write each batch's last settle on a thread of its own while the next batch is claimed and
    #: run. It pays when the store has cores of its own (+23 % for one PostgreSQL worker here);
    #: where workers and database share a few cores and every core is busy, the extra concurrent
    #: statement costs more than the overlap gains (BENCHMARKS.md): turn it off there.
    settle_behind: bool = True
    #: How long past its timeout a handler may keep running (and its task held) before the
    #: worker stops so that its process can be restarted.
    overrun_grace_seconds: float = 2.0
    #: Seconds between this worker's own passes over expired leases; None: half the lease,
    #: between 0.5 s and 30 s. 0 turns the built-in reaper off.
    reap_interval_seconds: float | None = None
    reap_batch_size: int = 100
    #: Schedules (rdq_core.engine.schedules) this worker fires from a local file, every
    #: ``schedules_every_seconds`` (0: none); None: ``$RDQ_SCHEDULES_FILE`` or ./rdq-schedules.json.
    #: Ids are per period, so any number of workers (and ``rdq dev``) firing one file make one task.
    schedules_file: str | None = None
    schedules_every_seconds: float = 1.0
    #: A name for this worker, added to the host and process id its claims carry
    #: (``Task.claimed_by``): which deployment or container a running task is in.
    name: str = ""


class Worker:
    def __init__(
        self,
        storage: Storage,
        config: WorkerConfig,
        *,
        policies: PolicyBook | None = None,
        registry: HandlerRegistry | None = None,
        telemetry: Telemetry | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.storage = storage
        self.config = config
        self.policies = policies or PolicyBook()
        self.telemetry = telemetry or Telemetry()
        self.clock = clock
        self.sleep = sleep
        # A container host has no invocation deadline to cut a hung handler short, so each batch
        # runs on a helper thread watched by its claim loop, and an overrunning handler is left
        # running, its task still held, while the rest of its batch goes on (rdq_core.engine.execution).
        self.runner = BatchRunner(
            storage, self.policies, registry, self.telemetry, lease_seconds=config.lease_seconds,
            abandon_overdue_handlers=True, clock=clock, sleep=sleep,
        )
        self.health = StorageHealth(log, clock=clock)
        #: Who this worker's claims say holds a running task: the process an operator can find.
        self.worker_name = fitted_worker_name(f"{socket.gethostname()}:{os.getpid()}", config.name)
        self.ledger = HeartbeatLedger(storage, config.lease_seconds, self.health)
        self.stop_event = StopEvent()
        self.wake = WakeSignal(storage, config.queues, self.stop_event) if config.wake_up else None
        idle_poll = config.idle_poll_seconds if config.idle_poll_seconds is not None else storage.idle_poll_seconds
        self.claim_loop = self._claim_loop(idle_pause=idle_poll, health=self.health, wait=self.stop_event.wait,
                                           wake=self.wake)
        #: None while running or after a requested stop; ``HANDLER_OVERRAN`` when the worker
        #: stopped itself because a handler could not be stopped.
        self.exit_reason: str | None = None
        self._known_queues: tuple[float, list[str]] = (-math.inf, [])
        self._claim_loops_done = threading.Event()

    def run_forever(self) -> None:
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="rdq-heartbeat", daemon=True)
        heartbeat.start()
        if self.wake is not None:
            self.wake.start()
        threads: list[threading.Thread] = []
        if self._reap_interval() > 0:
            threads.append(threading.Thread(target=self._reap_loop, name="rdq-reaper", daemon=True))
        if self.config.schedules_every_seconds > 0:
            threads.append(threading.Thread(target=self._schedules_loop, name="rdq-schedules", daemon=True))
        for thread in threads:
            thread.start()
        try:
            # The claim loops, on ``concurrency`` threads (the Lambda worker's HandlerConcurrency
            # runs through the same function); they end only once the worker stops.
            run_concurrently(self.claim_loop, self.config.concurrency, name="rdq-worker", watch=self._check_overruns)
            while any(thread.is_alive() for thread in threads):
                self._check_overruns()
                for thread in threads:
                    thread.join(0.1)
        finally:
            self.stop_event.set()
            self._claim_loops_done.set()
            self.runner.close()

    def stop(self) -> None:
        """Finish the running task, release unstarted claims, settle, then return."""
        self.stop_event.set()

    def running(self) -> dict[str, str]:
        """Task id -> handler name of every handler running now."""
        return self.runner.running()

    def settle_and_release_now(self) -> int:
        """Before exiting at once: write buffered outcomes, release every unstarted claim."""
        self.stop_event.set()
        return self.runner.settle_and_release_now()

    def overruns(self) -> list[Overrun]:
        return self.runner.overruns()

    def drop_late_outcomes(self) -> None:
        """Before the host ends the overrunning handlers' processes: their outcomes, should they
        return now, are dropped; their tasks come back when their leases lapse."""
        self.runner.execution.drop_late_outcomes()

    def _check_overruns(self) -> None:
        if self.stop_event.is_set():
            return
        now = self.clock()
        hung = [o for o in self.runner.overruns() if now - o.overdue_since > self.config.overrun_grace_seconds]
        if hung:
            self.exit_reason = HANDLER_OVERRAN
            log.error(
                "handler(s) still running %gs past their timeout: %s; stopping this worker so its "
                "process can be restarted (their tasks' leases then lapse and they are retried)",
                self.config.overrun_grace_seconds,
                ", ".join(f"{o.handler!r} (task {o.task_id}, timeout {o.timeout_seconds:g}s)" for o in hung),
            )
            self.stop_event.set()

    def run_once(self) -> int:
        """Claim and run one batch per queue, settled before it returns; returns the number of
        tasks started."""
        return self.claim_loop.run_round().started

    def drain(self) -> int:
        """Claim and run batches until a round finds nothing it can start, with the claim loop
        of ``run_forever`` (each batch's last settle written while the next batch is claimed and
        run, unless ``settle_behind`` is off), and return the number of tasks started once every
        batch is settled. No idling, no reaper: for a burst job or a benchmark. The lease
        heartbeat is the caller's to run (``run_forever`` runs its own)."""
        return self._claim_loop().run().started

    def _claim_loop(self, **idling: Any) -> ClaimLoop:
        """This worker's claim loop: its store, runner, queues, batch, lease, ledger and stop
        flag; ``idling`` (idle pause, outage health, wait, wake-up) is what differs by use."""
        return ClaimLoop(
            self.storage, self.runner, queues=self._queues, batch_size=self.config.batch_size,
            lease_seconds=lambda: self.config.lease_seconds, should_stop=self.stop_event.is_set,
            ledger=self.ledger, telemetry=self.telemetry, clock=self.clock,
            settle_behind=self.config.settle_behind, claim_ahead=self.config.settle_behind,
            worker=self.worker_name, **idling,
        )

    def _queues(self) -> Sequence[str]:
        if self.config.queues:
            return self.config.queues
        read_at, queues = self._known_queues
        if self.clock() - read_at > QUEUE_LIST_TTL_SECONDS:
            queues = self.storage.list_queues()
            self._known_queues = (self.clock(), queues)
        return queues

    def _reap_interval(self) -> float:
        if self.config.reap_interval_seconds is not None:
            return self.config.reap_interval_seconds
        return min(max(self.config.lease_seconds / 2, 0.5), 30.0)

    def _reap_loop(self) -> None:
        """The maintenance pass every host runs (``rdq_core.engine.maintenance``), once per interval and
        bounded by it: reap expired leases (fenced settles make any number of workers reaping at
        once record exactly one LEASE_EXPIRED per lost lease), advance bulk operations, deliver
        the outbox where a bus is set, roll up the console's metrics, and apply retention where
        ``RDQ_RETENTION_HOURS`` asks for it. Each step is guarded; an outage is one log line."""
        interval = self._reap_interval()
        plan = MaintenancePlan(
            policies=self.policies, reap_batch_size=self.config.reap_batch_size,
            reap_queues=[*self.config.queues] or [None],
            publisher=publisher_from_settings(EventSettings.from_env()), retention_hours=retention_hours_from_env(),
            operation_seconds=interval / 2, event_seconds=interval / 4, retention_seconds=interval / 4)
        while not self.stop_event.wait(interval):
            report = run_maintenance(self.storage, plan, deadline=self.clock() + interval, clock=self.clock,
                                     telemetry=self.telemetry, stopping=self.stop_event.is_set)
            outage = store_outage(report.passed)
            if outage is not None:
                self.health.failed("reaper", outage)

    def _schedules_loop(self) -> None:
        """Fire the schedules file's due periods until the worker stops (schedules.ScheduleFirer),
        once the first claim has reached the store (or a few seconds have passed): loading the
        schedules and reading their file would otherwise slow the worker's first claim."""
        until = self.clock() + FIRST_CLAIM_HEAD_START_SECONDS
        while not self.health.answered.wait(0.05) and self.clock() < until:
            if self.stop_event.is_set():
                return
        from ...client import Client
        from ...engine.schedules import LocalScheduleBook, ScheduleFirer

        firer = ScheduleFirer(Client(self.storage), LocalScheduleBook(self.config.schedules_file))
        firer.run(self.stop_event, self.config.schedules_every_seconds)

    def _heartbeat_loop(self) -> None:
        """Renews every held claim until the claim loops have ended *and* nothing is held: a
        stopping worker still finishes its running tasks, and an overrunning handler keeps its
        task until it returns or the process ends."""
        interval = max(self.config.lease_seconds / 3, 0.05)
        while True:
            self.sleep(interval)
            if self._claim_loops_done.is_set() and not self.ledger.held():
                return
            self.ledger.beat()
