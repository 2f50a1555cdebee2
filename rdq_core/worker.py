"""The long-running worker host (``rdq worker``): claim, run, settle, with a lease heartbeat.

On a container host there is no invocation deadline, so the lease is short (``--lease``) and a
heartbeat thread renews it for every claim the worker holds. A running task is renewed only
until its handler's ``timeout_seconds`` is spent: a hung handler then loses its lease, the
reaper records LEASE_EXPIRED, and the worker's late settle is fenced off (``StaleClaim``).
Handlers run on a helper thread, so a hung one is abandoned and the rest of its batch served.

Storage outages: the claim loop backs off (0.5 s doubling to 30 s) and reconnects; the claim
loop and the heartbeat share one ``StorageHealth``, so an outage logs one line when it starts
and one when the store answers again, however many retries happen in between.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .errors import StaleClaim, StorageUnavailable
from .handlers import HandlerRegistry
from .model import ClaimedTask, ClaimRef
from .outage import ReconnectBackoff, StorageHealth
from .retry import PolicyBook
from .runner import BatchRunner, ClaimLedger
from .storage.spi import Storage
from .telemetry import Telemetry

log = logging.getLogger("rdq.worker")

QUEUE_LIST_TTL_SECONDS = 5.0


class HeartbeatLedger(ClaimLedger):
    """Claims held by this worker, renewed in one batched write per beat."""

    def __init__(self, storage: Storage, lease_seconds: float, health: StorageHealth | None = None) -> None:
        self.storage = storage
        self.lease_seconds = lease_seconds
        self.health = health or StorageHealth(log)
        self._held: dict[str, tuple[ClaimRef, float]] = {}
        self._lock = threading.Lock()
        self.lost: set[str] = set()

    def hold(self, claimed: Sequence[ClaimedTask]) -> None:
        with self._lock:
            for item in claimed:
                self._held[item.task.id] = (item.ref, math.inf)

    def running(self, ref: ClaimRef, until: float) -> None:
        with self._lock:
            self._held[ref.task_id] = (ref, until)

    def drop(self, refs: Sequence[ClaimRef]) -> None:
        with self._lock:
            for ref in refs:
                self._held.pop(ref.task_id, None)

    def beat(self) -> None:
        now = time.monotonic()
        with self._lock:
            refs = [ref for ref, until in self._held.values() if until > now]
        if not refs:
            return
        try:
            self.storage.extend_leases(refs, self.lease_seconds)
        except StaleClaim as exc:
            self.lost.update(exc.task_ids)
            log.warning("lost the lease of %d task(s); their outcome will be fenced off", len(exc.task_ids))
        except StorageUnavailable as exc:
            self.health.failed("heartbeat", exc)  # retried next beat
            return
        self.health.ok()


@dataclass
class WorkerConfig:
    #: Queues to serve; empty means every queue in the store (re-read every few seconds).
    queues: Sequence[str] = ()
    batch_size: int = 10
    lease_seconds: float = 30.0
    concurrency: int = 1
    idle_poll_seconds: float = 1.0


class Worker:
    def __init__(
        self,
        storage: Storage,
        config: WorkerConfig,
        *,
        policies: PolicyBook | None = None,
        registry: HandlerRegistry | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.storage = storage
        self.config = config
        self.telemetry = telemetry or Telemetry()
        # A container host has no invocation deadline to cut a hung handler short, so handlers
        # run on a helper thread and are abandoned when their timeout is spent.
        self.runner = BatchRunner(
            storage, policies, registry, self.telemetry, lease_seconds=config.lease_seconds,
            abandon_overdue_handlers=True,
        )
        self.health = StorageHealth(log)
        self.ledger = HeartbeatLedger(storage, config.lease_seconds, self.health)
        self.stop_event = threading.Event()
        self._known_queues: tuple[float, list[str]] = (-math.inf, [])

    def run_forever(self) -> None:
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="rdq-heartbeat", daemon=True)
        heartbeat.start()
        loops = [
            threading.Thread(target=self._claim_loop, name=f"rdq-worker-{n}", daemon=True)
            for n in range(self.config.concurrency)
        ]
        for loop in loops:
            loop.start()
        try:
            while any(loop.is_alive() for loop in loops):
                for loop in loops:
                    loop.join(0.2)
        finally:
            self.stop_event.set()
            self.runner.close()

    def stop(self) -> None:
        """Finish the running task, release unstarted claims, settle, then return."""
        self.stop_event.set()

    def run_once(self) -> int:
        """Claim and run one batch per queue; returns the number of tasks started."""
        started = 0
        for queue in self._queues():
            if self.stop_event.is_set():
                break
            claimed = self._claim(queue)
            if claimed:
                self.ledger.hold(claimed)
                started += self.runner.run(claimed, ledger=self.ledger, should_stop=self.stop_event.is_set).started
        return started

    def _queues(self) -> Sequence[str]:
        if self.config.queues:
            return self.config.queues
        read_at, queues = self._known_queues
        if time.monotonic() - read_at > QUEUE_LIST_TTL_SECONDS:
            queues = self.storage.list_queues()
            self._known_queues = (time.monotonic(), queues)
        return queues

    def _claim(self, queue: str) -> list[ClaimedTask]:
        began = time.monotonic()
        claimed = self.storage.claim(queue, self.config.batch_size, self.config.lease_seconds)
        # Only a call that reached the store ends an outage (run_once also returns normally
        # when the runner gave up on a settle, which proves nothing).
        self.health.ok()
        self.telemetry.timing_ms("claim_latency_ms", (time.monotonic() - began) * 1000)
        self.telemetry.count("claimed", len(claimed))
        return claimed

    def _claim_loop(self) -> None:
        backoff = ReconnectBackoff()
        while not self.stop_event.is_set():
            try:
                started = self.run_once()
                backoff.reset()
            except StorageUnavailable as exc:
                # Each pass through here is one reconnect attempt after a backoff pause.
                self.telemetry.count("reconnect_attempts")
                self.health.failed("claim loop", exc)
                self.stop_event.wait(backoff.next())
                continue
            except Exception:  # noqa: BLE001 - a bug must not silently end this claim loop
                self.telemetry.count("claim_loop_errors")
                log.exception("unexpected error in the claim loop; backing off")
                self.stop_event.wait(backoff.next())
                continue
            if not started:
                self.stop_event.wait(self.config.idle_poll_seconds)

    def _heartbeat_loop(self) -> None:
        interval = max(self.config.lease_seconds / 3, 0.05)
        while not self.stop_event.wait(interval):
            self.ledger.beat()
