"""The claim loop of both hosts: claim a batch per queue, run it, and go round again.

The long-running worker (``rdq_core.worker``) and the Lambda worker
(``rdq_core.lambda_host.worker``) run this same loop and pass only what differs:

=================  =================================  ====================================
                   ``rdq worker``                     Lambda worker
=================  =================================  ====================================
lease              ``--lease``, renewed by heartbeat  the invocation's remaining time + grace
deadline           none                               the invocation's end - settle reserve
stop condition     ``stop()`` / an overrun            the deadline
after a round      idles when nothing started         ends when nothing made progress
errors, outages    ridden out with backoff            end the invocation (Lambda retries)
=================  =================================  ====================================
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from .errors import SchemaMissing, StorageUnavailable
from .outage import ReconnectBackoff, StorageHealth
from .runner import BatchRunner
from .settling import BatchReport, ClaimLedger, SettleBehind
from .storage.spi import Storage
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .wakeup import WakeSignal


#: With a wake-up: how soon a loop that just ran tasks and then found none claims again; the
#: pause doubles with each empty claim up to the idle pause (a wake-up ends any of them).
RECHECK_AFTER_WORK_SECONDS = 0.01


@dataclass
class ClaimReport:
    """What one round, or a whole loop, claimed and what became of it."""

    claimed: int = 0
    started: int = 0
    released: int = 0
    too_long: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def progress(self) -> int:
        # Dead-lettering a task that can never fit is progress too: the tasks behind it run.
        return self.started + self.too_long

    def add(self, other: ClaimReport) -> None:
        self.claimed += other.claimed
        self.started += other.started
        self.released += other.released
        self.too_long += other.too_long
        for outcome, n in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n

    def add_batch(self, claimed: int, batch: BatchReport) -> None:
        self.add(ClaimReport(claimed, batch.started, batch.released, batch.too_long, batch.outcomes))


class ClaimLoop:
    """Claims from ``queues()`` with ``lease_seconds()`` and runs what it claims on ``runner``
    until ``should_stop()`` or ``deadline`` (on ``clock``).

    ``idle_pause``: seconds to wait (with ``wait``) after a round that made no progress;
    None ends the loop then instead. ``wake``: given, that wait ends early when a task is
    enqueued into a served queue after the round began (``rdq_core.wakeup``), and right
    after work it is shorter (``RECHECK_AFTER_WORK_SECONDS``, doubling). ``settle_behind``:
    each batch's last settle runs on a thread of its own while the next batch is claimed and
    run (``SettleBehind``). ``health``: given, storage outages and unexpected errors are
    ridden out with backoff (logged once per outage on its logger); None, they end the loop.
    """

    def __init__(
        self,
        storage: Storage,
        runner: BatchRunner,
        *,
        queues: Callable[[], Sequence[str]],
        batch_size: int,
        lease_seconds: Callable[[], float],
        deadline: float = math.inf,
        should_stop: Callable[[], bool] = lambda: False,
        ledger: ClaimLedger | None = None,
        telemetry: Telemetry | None = None,
        idle_pause: float | None = None,
        health: StorageHealth | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] = time.sleep,
        wake: WakeSignal | None = None,
        settle_behind: bool = True,
    ) -> None:
        self.storage = storage
        self.runner = runner
        self.queues = queues
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.deadline = deadline
        self.should_stop = should_stop
        self.ledger = ledger
        self.telemetry = telemetry or Telemetry()
        self.idle_pause = idle_pause
        self.health = health
        self.clock = clock
        self.wait = wait
        self.wake = wake
        self.settle_behind = settle_behind

    def stopped(self) -> bool:
        return self.should_stop() or self.clock() >= self.deadline

    def run(self) -> ClaimReport:
        """Rounds until stopped (or, without ``idle_pause``, until a round makes no progress);
        every batch is settled when this returns."""
        # Each batch's last settle is written while the next batch is claimed and run.
        behind = SettleBehind() if self.settle_behind else None
        try:
            return self._rounds(behind)
        finally:
            if behind is not None:
                behind.close()

    def _rounds(self, behind: SettleBehind | None) -> ClaimReport:
        total = ClaimReport()
        backoff = ReconnectBackoff()
        recheck = math.inf  # the next pause with a wake-up; short right after work
        while not self.stopped():
            # Noted before the claim: an enqueue that commits while it runs still ends the pause.
            mark = self.wake.mark() if self.wake is not None else 0
            try:
                round_ = self.run_round(behind)
            except (StorageUnavailable, SchemaMissing) as exc:
                if self.health is None:
                    raise
                # Each pass through here is one reconnect attempt after a backoff pause. A store
                # not migrated yet is waited out the same way (one line saying to run migrate):
                # workers may well start before the deploy step that migrates.
                self.telemetry.count("reconnect_attempts")
                self.health.failed("claim loop", exc)
                self.wait(backoff.next())
                continue
            except Exception:  # a bug must not silently end a long-running claim loop
                if self.health is None:
                    raise
                self.telemetry.count("claim_loop_errors")
                self.health.log.exception("unexpected error in the claim loop; backing off")
                self.wait(backoff.next())
                continue
            backoff.reset()
            total.add(round_)
            if not round_.progress:
                # Drained, or nothing claimed could start (too little time left for its handler):
                # claiming again at once would only release it again.
                if self.idle_pause is None:
                    break
                if self.wake is not None:
                    # Right after work, re-check soon, then less and less often: a store may skip
                    # the wake-up of an enqueue that saw a due task this loop had just claimed
                    # (PostgreSQL does), and an empty claim is cheap (it writes nothing).
                    self.wake.wait(mark, min(self.idle_pause, recheck))
                    recheck *= 2
                else:
                    self.wait(self.idle_pause)
            else:
                recheck = RECHECK_AFTER_WORK_SECONDS
        return total

    def run_round(self, settle_behind: SettleBehind | None = None) -> ClaimReport:
        """Claim one batch per queue and run each; returns what the round did. Every batch is
        settled when this returns, unless ``settle_behind`` is given: then the last one may still
        be on its way (``settle_behind.wait()``)."""
        report = ClaimReport()
        for queue in self.queues():
            if self.stopped():
                break
            lease = self.lease_seconds()
            self.runner.lease_seconds = lease
            began = self.clock()
            claimed = self.storage.claim(queue, self.batch_size, lease, self.runner.policies.flow_for(queue))
            if self.health is not None:
                # Only a call that reached the store ends an outage (a round also returns
                # normally when the runner gave up on a settle, which proves nothing).
                self.health.ok()
            self.telemetry.timing_ms("claim_latency_ms", (self.clock() - began) * 1000)
            self.telemetry.count("claimed", len(claimed))
            if not claimed:
                continue
            batch = self.runner.run(claimed, deadline=self.deadline, ledger=self.ledger, should_stop=self.should_stop,
                                    settle_behind=settle_behind)
            report.add_batch(len(claimed), batch)
        return report
