"""The claim loop of both hosts: claim a batch per queue, run it, and go round again.

The long-running worker (``rdq_core.hosts.process.worker``) and the Lambda worker
(``rdq_core.hosts.aws_lambda.worker``) run this same loop and pass only what differs:

=================  =================================  ====================================
                   ``rdq worker``                     Lambda worker
=================  =================================  ====================================
lease              ``--lease``, renewed by heartbeat  the invocation's remaining time + grace
deadline           none                               the invocation's end - settle reserve
stop condition     ``stop()`` / an overrun            the deadline
after a round      idles when nothing started         ends when nothing made progress
errors, outages    ridden out with backoff            end the invocation (Lambda retries)
threads            ``--concurrency``                  ``HandlerConcurrency``
claim size         ``--batch``                        sized to the time left (``ClaimPace``)
=================  =================================  ====================================

Both run their loop on several threads with ``run_concurrently``: each thread claims and runs
batches of its own, so up to that many handlers run at once, each under its own timeout.
"""

from __future__ import annotations

import copy
import inspect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import SchemaMissing, StorageUnavailable
from .handlers import DEFAULT_TIMEOUT_SECONDS
from .outage import ReconnectBackoff, StorageHealth
from .runner import BatchRunner
from .settling import BatchReport, ClaimLedger, SettleBehind
from ..model import ClaimedTask
from ..storage.spi import Storage
from ..validation import Limits
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .wakeup import WakeSignal


#: With a wake-up: how soon a loop that just ran tasks and then found none claims again; the
#: pause doubles with each empty claim up to the idle pause (a wake-up ends any of them).
RECHECK_AFTER_WORK_SECONDS = 0.01

#: The least time per task a ``ClaimPace`` assumes, so that handlers that return at once do not
#: make "how many fit" infinite (the batch size bounds it anyway).
_LEAST_SECONDS_PER_TASK = 0.001


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


class ClaimPace:
    """How many tasks one claim loop (one thread) should claim with ``time_left`` before its
    deadline: no more than it can plausibly start, since a task that cannot start is only held
    from other workers and then released (``BatchRunner`` starts a task only while its handler's
    ``timeout_seconds`` + the settle margin still fits).

    Which handlers a claim brings back is known only after it, so the rule plans with the
    registered handler timeouts:

    * ``shortest``: below the shortest registered timeout + margin no claimed task could start;
      the loop claims nothing more.
    * ``planned``: the longest registered timeout this host can ever give (or the default 10 s
      with none registered). Tasks can start while ``time_left`` >= ``planned`` + margin; one
      thread starts them one after another, each taking ``per_task`` seconds: the mean of what
      this loop's tasks took so far. So a claim takes
      ``floor((time_left - planned - margin) / per_task) + 1`` tasks, at most the batch size.
    * Before the loop has measured anything it claims one task: that measures it, and the loops
      of one invocation then share a small backlog instead of the first one holding all of it.
    * Once that window has closed, one task per claim: only a handler quicker than ``planned``
      could still start, and holding one at a time wastes nothing.

    One per thread: its measure is its own tasks'.
    """

    def __init__(self, shortest: float, planned: float, margin: float) -> None:
        self.shortest = shortest
        self.planned = planned
        self.margin = margin
        self._done = 0
        self._busy_seconds = 0.0

    @classmethod
    def for_runner(cls, runner: BatchRunner) -> ClaimPace:
        """Planned on the timeouts registered with ``runner``'s registry that fit its host."""
        margin = runner.settle_margin
        timeouts = [spec.timeout_seconds for spec in map(runner.registry.get, runner.registry.names())
                    if spec is not None and spec.timeout_seconds + margin <= runner.longest_run_seconds]
        if not timeouts:
            timeouts = [DEFAULT_TIMEOUT_SECONDS]
        return cls(min(timeouts), max(timeouts), margin)

    def record(self, done: int, seconds: float) -> None:
        """A batch of this loop started (or dead-lettered) ``done`` tasks in ``seconds``."""
        if done:
            self._done += done
            self._busy_seconds += max(seconds, 0.0)

    def claim_size(self, batch_size: int, time_left: float) -> int:
        """Tasks to claim now (0: too little time for any handler to start)."""
        if time_left < self.shortest + self.margin:
            return 0
        window = time_left - (self.planned + self.margin)
        if window < 0 or not self._done:
            return 1
        per_task = max(self._busy_seconds / self._done, _LEAST_SECONDS_PER_TASK)
        # The epsilon keeps an exact fit (1.5 s of window, 0.1 s a task) from rounding down.
        return max(1, min(batch_size, int(window / per_task + 1e-9) + 1))


def fitted_worker_name(*parts: str) -> str:
    """The non-empty ``parts``, joined by spaces, as ``Storage.claim(worker=...)`` takes them:
    characters that are not printable dropped and the text cut to ``Limits.worker_chars``, so an
    odd host or function name costs a running task its label, never a claim."""
    text = " ".join(part for part in parts if part)
    return "".join(ch for ch in text if ch.isprintable())[:Limits.worker_chars]


def _claim_takes_worker(storage: Storage) -> bool:
    """Whether ``storage.claim`` accepts ``worker=``: a backend written before the SPI had it
    keeps working, its claims unnamed."""
    try:
        parameters = inspect.signature(storage.claim).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the current SPI
        return True
    return any(p.name == "worker" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


#: A loop claims its next batch while it runs this one only when this one came back full (and
#: is bigger than one task) and the queue's previous batch ran within this long: a backlog of
#: quick tasks, where the claim's round trip is a large part of each batch. Claimed ahead,
#: slower tasks would wait held while another worker could have run them.
CLAIM_AHEAD_MAX_RUN_SECONDS = 0.25
#: A batch claimed ahead waits at most this long for the loop to take it. The batch running now
#: came from a quick queue, but any task in it may turn slow: past this, the tasks waiting
#: ahead are released (no attempt spent) so that another worker runs them, and the loop claims
#: afresh when it is done.
CLAIM_AHEAD_HOLD_SECONDS = 1.0


class ClaimAhead:
    """One claim loop's next batch, claimed on a thread of its own while the loop runs the
    current one (``ClaimLoop(claim_ahead=True)``, the loop serving one queue, no deadline).

    Its claims are held in the ledger (their leases renewed) from the moment they come back, and
    the loop takes them for its next claim of the same queue; a batch the loop does not take
    (it stops, fails, or its next claim is of another queue or size), or does not take within
    ``CLAIM_AHEAD_HOLD_SECONDS`` (the batch running turned slow), is released. At most one
    batch is claimed ahead. ``release_now`` (a host about to exit at once, from another thread)
    releases it and makes sure the loop never runs it."""

    def __init__(self, loop: ClaimLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._key: tuple[str, int, float] | None = None
        self._claimed: list[ClaimedTask] = []
        self._error: BaseException | None = None
        self._released = False
        #: Set when the loop comes for the batch (or the host releases it): the claim thread
        #: stops holding it for the loop then.
        self._wanted = threading.Event()
        #: The batch waited longer than CLAIM_AHEAD_HOLD_SECONDS and was released.
        self._expired = False
        #: How long the loop's last batch of each queue took to run.
        self.last_run: dict[str, float] = {}
        loop.runner.track_claimed_ahead(self)

    def worth_it(self, queue: str, claimed: int, size: int) -> bool:
        # Never with a batch of one: a worker asked to hold one task at a time (slow or
        # crash-prone handlers) must lose only that task's lease when its process dies.
        return 1 < size <= claimed and self.last_run.get(queue, math.inf) <= CLAIM_AHEAD_MAX_RUN_SECONDS

    def start(self, queue: str, size: int, lease: float) -> None:
        loop = self._loop

        def claim(wanted: threading.Event) -> None:
            try:
                claimed = loop.claim(queue, size, lease)
            except BaseException as exc:  # noqa: BLE001 - raised on the loop's thread by take()
                self._error = exc
                return
            with self._lock:
                if not self._released:
                    if loop.ledger is not None:
                        loop.ledger.hold(claimed)
                    self._claimed, claimed = claimed, []
            self._release(claimed)  # the host released everything while this claim was on its way
            if wanted.wait(CLAIM_AHEAD_HOLD_SECONDS):
                return
            with self._lock:  # the batch running now turned slow: let another worker have these
                waiting, self._claimed = self._claimed, []
                self._expired = True
            self._release(waiting)

        with self._lock:
            if self._released:
                return
            self._key, self._claimed, self._error = (queue, size, lease), [], None
            self._wanted, self._expired = threading.Event(), False
        self._thread = threading.Thread(target=claim, args=(self._wanted,), name="rdq-claim-ahead", daemon=True)
        self._thread.start()

    def take(self, queue: str, size: int, lease: float) -> list[ClaimedTask] | None:
        """The batch claimed ahead for this claim (None: none; claim now). A store error of
        the claim ahead is raised here, where the loop's outage handling sees it."""
        if self._thread is None:
            return None
        key = self._key
        claimed, error, expired = self._collect()
        if error is not None:
            raise error
        if self._released:
            return []  # released by release_now: the host is exiting
        if expired:
            return None  # released while it waited: claim afresh
        if key != (queue, size, lease):
            self._release(claimed)
            return None
        return claimed

    def release_now(self) -> int:
        """Release the batch waiting here (and one still on its way, once it arrives); the loop
        gets nothing from here afterwards. Returns how many claims were released now."""
        with self._lock:
            self._released = True
            claimed, self._claimed = self._claimed, []
        self._wanted.set()
        self._release(claimed)
        return len(claimed)

    def give_back(self) -> None:
        """Release what was claimed ahead and not taken (a round of several queues: nothing is
        claimed ahead then)."""
        claimed, _, _ = self._collect()
        self._release(claimed)

    def close(self) -> None:
        """Give back what waits here; the loop is done with it."""
        self.give_back()
        self._loop.runner.track_claimed_ahead(self, tracked=False)

    def _collect(self) -> tuple[list[ClaimedTask], BaseException | None, bool]:
        """What the claim ahead left here: (its batch, its error, whether it was released for
        waiting too long); joins its thread, which stops holding the batch now."""
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            found = (self._claimed, self._error, self._expired)
            self._thread, self._key, self._claimed, self._error, self._expired = None, None, [], None, False
        return found

    def _release(self, claimed: list[ClaimedTask]) -> None:
        if claimed:
            self._loop.runner.settler.release(claimed, BatchReport(), self._loop.ledger or ClaimLedger())


class ClaimLoop:
    """Claims from ``queues()`` with ``lease_seconds()`` and runs what it claims on ``runner``
    until ``should_stop()`` or ``deadline`` (on ``clock``).

    ``worker``: the name every claim of this loop is stored under (``Task.claimed_by`` of a
    running task, shown by the console and ``rdq task show``); see ``fitted_worker_name``.

    ``idle_pause``: seconds to wait (with ``wait``) after a round that made no progress;
    None ends the loop then instead. ``wake``: given, that wait ends early when a task is
    enqueued into a served queue after the round began (``rdq_core.engine.wakeup``), and right
    after work it is shorter (``RECHECK_AFTER_WORK_SECONDS``, doubling). ``settle_behind``:
    each batch's last settle runs on a thread of its own while the next batch is claimed and
    run (``SettleBehind``). ``claim_ahead``: serving one queue with no deadline, the next batch
    is claimed while a full batch of quick tasks runs (``ClaimAhead``). ``health``: given,
    storage outages and unexpected errors are ridden out with backoff (logged once per outage
    on its logger); None, they end the loop.
    ``fit_to_deadline``: with a finite ``deadline``, each claim takes only as many tasks as can
    plausibly start before it (``ClaimPace``), and the loop ends when no handler could start.
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
        claim_ahead: bool = False,
        fit_to_deadline: bool = False,
        worker: str = "",
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
        self.claim_ahead = claim_ahead
        self.fit_to_deadline = fit_to_deadline
        self.worker = worker
        # Given once here, not per claim; left out for a backend whose claim does not take it.
        self._claim_options = {"worker": worker} if worker and _claim_takes_worker(storage) else {}

    def claim(self, queue: str, size: int, lease: float) -> list[ClaimedTask]:
        """One claim of ``queue`` under its flow policy, named as this loop's."""
        return self.storage.claim(queue, size, lease, self.runner.policies.flow_for(queue), **self._claim_options)

    def stopped(self) -> bool:
        return self.should_stop() or self.clock() >= self.deadline

    def run(self) -> ClaimReport:
        """Rounds until stopped (or, without ``idle_pause``, until a round makes no progress);
        every batch is settled when this returns."""
        # Each batch's last settle is written while the next batch is claimed and run.
        behind = SettleBehind() if self.settle_behind else None
        pace = ClaimPace.for_runner(self.runner) if self.fit_to_deadline and math.isfinite(self.deadline) else None
        ahead = ClaimAhead(self) if self.claim_ahead and not math.isfinite(self.deadline) else None
        try:
            return self._rounds(behind, pace, ahead)
        finally:
            try:
                if ahead is not None:
                    ahead.close()
            finally:
                if behind is not None:
                    behind.close()

    def _rounds(self, behind: SettleBehind | None, pace: ClaimPace | None, ahead: ClaimAhead | None) -> ClaimReport:
        total = ClaimReport()
        backoff = ReconnectBackoff()
        recheck = math.inf  # the next pause with a wake-up; short right after work
        while not self.stopped():
            # Noted before the claim: an enqueue that commits while it runs still ends the pause.
            mark = self.wake.mark() if self.wake is not None else 0
            try:
                round_ = self.run_round(behind, pace, ahead)
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

    def run_round(self, settle_behind: SettleBehind | None = None, pace: ClaimPace | None = None,
                  ahead: ClaimAhead | None = None) -> ClaimReport:
        """Claim one batch per queue and run each; returns what the round did. Every batch is
        settled when this returns, unless ``settle_behind`` is given: then the last one may still
        be on its way (``settle_behind.wait()``). ``pace``: claims sized to the time left.
        ``ahead``: with one queue, the next batch may be claimed while this one runs."""
        report = ClaimReport()
        queues = self.queues()
        if ahead is not None and len(queues) != 1:
            ahead.give_back()
            ahead = None
        for queue in queues:
            if self.stopped():
                break
            size = self.batch_size
            if pace is not None:
                size = pace.claim_size(self.batch_size, self.deadline - self.clock())
                if not size:
                    break  # no registered handler could start any more: the round made no progress
            lease = self.lease_seconds()
            began = self.clock()
            claimed = ahead.take(queue, size, lease) if ahead is not None else None
            if claimed is None:
                claimed = self.claim(queue, size, lease)
            if self.health is not None:
                # Only a call that reached the store ends an outage (a round also returns
                # normally when the runner gave up on a settle, which proves nothing).
                self.health.ok()
            self.telemetry.timing_ms("claim_latency_ms", (self.clock() - began) * 1000)
            self.telemetry.count("claimed", len(claimed))
            if not claimed:
                continue
            if ahead is not None and ahead.worth_it(queue, len(claimed), size) and not self.stopped():
                ahead.start(queue, size, lease)
            ran_from = self.clock()
            batch = self.runner.run(claimed, deadline=self.deadline, ledger=self.ledger, should_stop=self.should_stop,
                                    settle_behind=settle_behind, lease_seconds=lease)
            if ahead is not None:
                ahead.last_run[queue] = self.clock() - ran_from
            if pace is not None:
                pace.record(batch.started + batch.too_long, self.clock() - ran_from)
            report.add_batch(len(claimed), batch)
        return report


def per_thread_batch(batch_size: int, threads: int) -> int:
    """Each of ``threads`` loops claims this many, so that together they hold about one batch."""
    return max(1, -(-batch_size // max(threads, 1)))


def run_concurrently(
    loop: ClaimLoop,
    threads: int,
    *,
    name: str = "rdq-claim-loop",
    watch: Callable[[], object] | None = None,
    watch_every: float = 0.1,
) -> ClaimReport:
    """Run ``loop`` on ``threads`` threads at once and return their merged report: up to that
    many handlers run at the same time, each in a batch of its own thread, under its own
    timeout and the loop's deadline. ``rdq worker --concurrency`` and the Lambda worker's
    ``HandlerConcurrency`` both run here.

    One thread and no ``watch``: the loop runs on the calling thread. Otherwise the calling
    thread waits, calling ``watch`` every ``watch_every`` seconds (``rdq worker`` checks for
    overrunning handlers). A loop that raises stops its siblings (they finish their running
    handlers and release what they have not started) and the first error is raised here once
    all have ended."""
    if threads <= 1 and watch is None:
        return loop.run()
    failed = threading.Event()
    # A copy that also stops when a sibling failed; it shares the runner, store and deadline.
    shared = copy.copy(loop)
    shared.should_stop = lambda: failed.is_set() or loop.should_stop()
    reports: list[ClaimReport] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run_one() -> None:
        try:
            report = shared.run()
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread once all have ended
            with lock:
                errors.append(exc)
            failed.set()
            return
        with lock:
            reports.append(report)

    workers = [threading.Thread(target=run_one, name=f"{name}-{n}", daemon=True) for n in range(max(threads, 1))]
    for worker in workers:
        worker.start()
    for worker in workers:
        while worker.is_alive():
            if watch is not None:
                watch()
            worker.join(watch_every if watch is not None else None)
    if errors:
        raise errors[0]
    total = ClaimReport()
    for report in reports:
        total.add(report)
    return total
