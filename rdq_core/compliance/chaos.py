"""The multi-process chaos tests: real hosts, ``kill -9`` at chosen points, then a full audit.

Every chaos process journals what it does (``chaos_worker``: each storage call's begin, answer
and return, each handler's start and finish). The killer watches the journals and sends
SIGKILL when a process is at the point a test aims at; once the queue drains, the history
checker (``chaos_history.audit``) holds every claim, execution and kill against the store.

* ``run_chaos`` -- long-running ``Worker`` processes killed inside a handler (the original test).
* ``run_runner_chaos`` -- ``Worker`` processes killed on the runner's own paths: inside a claim
  call (before the store answered, or after it answered but before the engine heard),
  with a finished handler's outcome still in the settle buffer, inside a settle call (both
  sides of the commit), inside the heartbeat's ``extend_leases``, inside a handler, and at
  random. Handlers vary: short ones, ones longer than the lease (the heartbeat must renew
  them), ones that call ``ctx.extend_lease`` (with a short, a default and a long extension),
  and ones that finish close to their ``timeout_seconds``.
* ``run_lambda_chaos`` -- warm Lambda worker containers (``chaos_lambda``) running
  ``run_worker_invocation`` back to back, killed at journal markers or exactly at an
  invocation's deadline (Lambda's timeout), including invocations whose handler overruns.

Only processes this module started are killed, by PID; everything runs on loopback.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Self, Sequence

from ..errors import StorageUnavailable
from ..model import Backoff, NewTask
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..storage import open_storage
from ..storage.spi import Storage
from .chaos_history import Audit, ChaosProcess, Clock, ProcessJournal, audit
from .chaos_lambda import EXTEND_HANDLER, HANDLER as LAMBDA_HANDLER, OVERRUN_HANDLER
from .chaos_worker import HANDLER, TIGHT_HANDLER
from .support import present

QUEUE = "chaos"
LEASE_SECONDS = 2.0
FAST_BACKOFF = Backoff(0.05, 2.0, 0.2, 0.0)
MAX_ATTEMPTS = 50

#: Kill aims for the long-running worker, and the family each lands in (a "-reply" kill hit a
#: call after the store answered, before the engine heard back).
RUNNER_INTENTS = ("claim", "claim-reply", "buffer", "settle", "settle-reply", "heartbeat", "handler", "random")
RUNNER_REQUIRED = ("claim", "buffer", "settle", "heartbeat", "handler")
LAMBDA_INTENTS = ("claim", "claim-reply", "buffer", "settle", "settle-reply", "handler", "random")
LAMBDA_REQUIRED = ("claim", "buffer", "settle", "handler")


#: Aims the victim cooperates with: armed, it holds at the point (see ``chaos_worker``).
ARMED_AIMS = ("claim", "claim-reply", "settle", "settle-reply", "heartbeat", "handler")


def family(kind: str) -> str:
    return kind.removesuffix("-reply")


def _arm(process: ChaosProcess, aim: str | None) -> None:
    path = Path(str(process.journal.path) + ".arm")
    if aim is None:
        path.unlink(missing_ok=True)
        return
    staged = Path(str(path) + "-new")
    staged.write_text(aim)
    os.replace(staged, path)  # a reader sees the old aim or the new one, never half of it


class ChaosFailure(AssertionError):
    pass


# A chaos process needs its own module only, but ``python -m rdq_core.compliance.X`` first runs
# the package's __init__, which imports the whole kit (pytest, hypothesis): half a second of CPU
# per process start, and starts are on the kill path. So children register a light package
# (``StorageCompliance`` still importable from it, lazily) and run the module's ``main``.
_BOOT = """
import os, sys, types
import rdq_core
package = types.ModuleType("rdq_core.compliance")
package.__path__ = [os.path.join(os.path.dirname(rdq_core.__file__), "compliance")]
def _lazy(name):
    if name == "StorageCompliance":
        from rdq_core.compliance.suite import StorageCompliance
        return StorageCompliance
    raise AttributeError(name)
package.__getattr__ = _lazy
sys.modules["rdq_core.compliance"] = package
module = sys.argv.pop(1)
sys.argv[0] = module
__import__(module, fromlist=["main"]).main()
"""


def _python_module(module: str) -> list[str]:
    return [sys.executable, "-c", _BOOT, module]


# -- processes -----------------------------------------------------------------------------------
class Fleet:
    """The processes a chaos test started; killed only by their own PID.

    A replacement must not cost a cold start on the critical path (seconds on a busy machine,
    with nothing claiming meanwhile), so ``spares`` processes are kept started -- imported and
    waiting on a go-file; ``spawn`` puts a ready one to work, ``maintain`` starts the next.
    """

    def __init__(self, workdir: Path, command: Callable[[Path, int], list[str]], prefix: str, spares: int = 2) -> None:
        self.workdir = workdir
        self.command = command
        self.prefix = prefix
        self.spare_count = spares
        self.spawned: list[ChaosProcess] = []
        self.live: list[ChaosProcess] = []
        self.spares: list[ChaosProcess] = []

    def _launch(self) -> ChaosProcess:
        number = len(self.spawned)
        name = f"{self.prefix}{number:03d}"
        path = self.workdir / f"{name}.journal"
        path.touch()
        command = self.command(path, number) + ["--go-file", str(path) + ".go"]
        with open(self.workdir / f"{name}.out", "wb") as log:
            popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        process = ChaosProcess(name, popen.pid, ProcessJournal(name, path), popen)
        self.spawned.append(process)
        return process

    def spawn(self) -> ChaosProcess:
        """Put a process to work: a ready spare if there is one, else a cold start."""
        ready = [p for p in self.spares if self._ready(p)]
        process = ready[0] if ready else self._launch()
        if ready:
            self.spares.remove(process)
        Path(str(process.journal.path) + ".go").touch()
        self.live.append(process)
        return process

    @staticmethod
    def _ready(process: ChaosProcess) -> bool:
        return os.path.exists(str(process.journal.path) + ".go.ready")

    def starting(self) -> int:
        """Working processes not yet started (nothing journaled)."""
        return sum(1 for p in self.live if not p.journal.lines)

    def maintain(self) -> None:
        # Only once the working processes are up: starting many Python processes at once on a
        # small machine slows them all down, the ones that should be working first.
        if not self.starting() and len(self.spares) < self.spare_count:
            self.spares.append(self._launch())

    def ready_for_a_kill(self) -> bool:
        """At most one working process still starting: kills keep coming while a replacement
        boots, but the fleet never dwindles to a few live processes on a slow machine."""
        return self.starting() <= 1

    def kill(self, process: ChaosProcess, intent: str) -> None:
        os.kill(process.pid, signal.SIGKILL)  # our own child, not yet waited for: the PID is still ours
        process.killed_at = time.time()
        process.intent = intent
        process.popen.wait(30)
        process.journal.poll()
        process.landed = process.journal.state()
        self.live.remove(process)
        with open(self.workdir / "kills.log", "a") as log:
            log.write(f"{process.killed_at:.6f} {process.name} pid={process.pid} aim={intent} "
                      f"landed={'/'.join(sorted(process.landed))}\n")

    def poll(self) -> None:
        for process in self.live + self.spares:
            process.journal.poll()
            code = process.popen.poll()
            if code is not None:
                tail = (self.workdir / f"{process.name}.out").read_text(errors="replace")[-3000:]
                raise ChaosFailure(f"{process.name} (pid {process.pid}) exited by itself with status {code}:\n{tail}")

    def teardown(self) -> None:
        self.live += self.spares
        self.spares = []
        for process in list(self.live):
            if process.popen.poll() is None:
                self.kill(process, "teardown")
            else:
                self.live.remove(process)
        for process in self.spawned:
            process.journal.poll()
            process.journal.close()


class _StoreLoop:
    """A thread with its own store connection that runs ``step`` every ``interval`` seconds
    until the ``with`` block ends; what it raises is kept in ``errors`` for the run to surface.
    Like ``rdq reaper``, it rides out ``StorageUnavailable`` (a failover, a restart) by trying
    again at the next step, for ``outage_grace`` seconds at most."""

    outage_grace = 20.0

    def __init__(self, url: str, interval: float, name: str) -> None:
        self.url = url
        self.interval = interval
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def step(self, storage: Storage) -> None:
        raise NotImplementedError

    def failed(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def _loop(self) -> None:
        storage = open_storage(self.url)
        outage_since: float | None = None
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.step(storage)
                    outage_since = None
                except StorageUnavailable:
                    outage_since = outage_since or time.monotonic()
                    if time.monotonic() - outage_since > self.outage_grace:
                        raise
        except BaseException as exc:  # noqa: BLE001 - surfaced after the run
            self.failed(exc)
        finally:
            storage.close()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class Reaper(_StoreLoop):
    """The ``rdq reaper`` of these tests: a fenced pass every ``interval`` seconds."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(url, interval, "chaos-reaper")
        self._policies = PolicyBook(RetryPolicy(MAX_ATTEMPTS, FAST_BACKOFF))

    def step(self, storage: Storage) -> None:
        reap_expired_leases(storage, self._policies, queue=QUEUE)


# -- the killer --------------------------------------------------------------------------------
class Killer:
    """Works through a plan of kill aims: waits (up to ``patience``) for any live process to
    reach the aimed-at point, SIGKILLs it, starts a replacement, pauses, aims again. When the
    plan is done it adds aims (up to ``extra``) for required families no kill has landed in yet."""

    def __init__(
        self, fleet: Fleet, plan: Sequence[str], rng: random.Random, *, required: Sequence[str] = (),
        extra: int = 0, patience: float = 3.0, pause: tuple[float, float] = (0.02, 0.1),
    ) -> None:
        self.fleet = fleet
        self.plan = list(plan)
        self.rng = rng
        self.required = tuple(required)
        self.extra = extra
        self.patience = patience
        self.pause = pause
        self.kills: list[ChaosProcess] = []
        self.missed: Counter[str] = Counter()
        self.waited: defaultdict[str, float] = defaultdict(float)  # seconds spent waiting, per aim
        self._aim: str | None = None
        self._aimed_at = 0.0
        self._next_at = time.monotonic() + rng.uniform(*pause)
        self._random_at = 0.0
        self._armed: list[ChaosProcess] = []
        self._began = time.monotonic()
        self.plan_done_after: float | None = None

    @property
    def done(self) -> bool:
        return self._aim is None and not self.plan

    @property
    def hunting(self) -> bool:
        """Waiting for a marker: poll the journals often, the windows are milliseconds wide."""
        return self._aim is not None and self._aim != "random"

    def landed_families(self) -> set[str]:
        return {family(kind) for p in self.kills for kind in p.landed}

    def _arm_all(self) -> None:
        # Every process that is up (has journaled something), also replacements started since:
        # the first to reach the point is the victim.
        for process in self.fleet.live:
            if process.journal.lines and process not in self._armed:
                _arm(process, self._aim)
                self._armed.append(process)
                with open(self.fleet.workdir / "kills.log", "a") as log:
                    log.write(f"{time.time():.6f} armed {process.name} for {self._aim}\n")

    def _disarm(self) -> None:
        for process in self._armed:
            if process in self.fleet.live:
                _arm(process, None)
        self._armed = []

    def tick(self) -> None:
        now = time.monotonic()
        if self._aim is None:
            if not self.plan and self.extra > 0:
                missing = [f for f in self.required if f not in self.landed_families()]
                if missing:
                    self.extra -= 1
                    self.plan.append(self.rng.choice(missing))
            if not self.plan or now < self._next_at or not self.fleet.live:
                return
            if not self.fleet.ready_for_a_kill():
                return  # replacements are still starting
            self._aim, self._aimed_at = self.plan.pop(0), now
            self._random_at = now + self.rng.uniform(0.0, 0.4)
        aim = self._aim
        victim = None
        if aim == "random":
            if now >= self._random_at and self.fleet.live:
                victim = self.rng.choice(self.fleet.live)
        elif aim in ARMED_AIMS:
            self._arm_all()
            holding = [p for p in self._armed if p in self.fleet.live and p.journal.holding(aim)]
            victim = self.rng.choice(holding) if holding else None
        else:
            wall = time.time()
            candidates = list(self.fleet.live)
            self.rng.shuffle(candidates)
            victim = next((p for p in candidates if p.journal.ready(aim, wall)), None)
        if victim is not None:
            self.fleet.kill(victim, aim)
            self._disarm()
            self.kills.append(victim)
            self.waited[aim] += now - self._aimed_at
            self.fleet.spawn()
        elif now - self._aimed_at > self.patience:
            self.missed[aim] += 1
            self._disarm()
            if self.missed[aim] <= 3:  # a quiet spell, not a missing window: aim again later
                self.plan.append(aim)
        else:
            return
        self._aim = None
        self._next_at = now + self.rng.uniform(*self.pause)
        if self.done:
            self.plan_done_after = now - self._began

    def figures(self) -> dict[str, object]:
        landed: Counter[str] = Counter()
        for p in self.kills:
            for kind in p.landed:
                landed[kind] += 1
        return {
            "kills": len(self.kills),
            "kills_by_aim": dict(Counter(p.intent for p in self.kills)),
            "kills_landed_in": dict(sorted(landed.items())),
            "aims_missed": dict(self.missed),
            "aim_wait_s": {aim: round(t, 2) for aim, t in self.waited.items()},
            "kill_plan_done_after_s": round(self.plan_done_after, 2) if self.plan_done_after is not None else None,
        }


# -- shared run loop -----------------------------------------------------------------------------
def _enqueue(storage: Storage, items: Sequence[NewTask]) -> None:
    for start in range(0, len(items), 500):
        storage.enqueue(items[start:start + 500])


class Feed:
    """The tasks of a run: an initial batch, then top-ups while the kill plan is not done, so
    the queue never drains before the last kill and its tail after the last kill stays short
    whatever the machine's speed. Bounded: at most ``most`` tasks."""

    def __init__(self, storage: Storage, make: Callable[[int, int], list[NewTask]], first: int, most: int,
                 low_water: int) -> None:
        self.make = make
        self.most = most
        self.low_water = low_water
        self.items: list[NewTask] = []
        self.top_ups = 0
        self.add(storage, first)

    def add(self, storage: Storage, n: int) -> None:
        batch = self.make(len(self.items), min(n, self.most - len(self.items)))
        _enqueue(storage, batch)
        self.items += batch  # only once enqueued: a drain check never counts what is not there yet

    def feed(self, storage: Storage, pending: int, hungry: bool) -> None:
        if hungry and pending < self.low_water and len(self.items) < self.most:
            self.top_ups += 1
            self.add(storage, self.low_water)


class Watcher(_StoreLoop):
    """Watches the queue (drained yet?) and tops it up, from its own thread and connection:
    a slow store round trip must never delay a kill or a deadline."""

    def __init__(self, url: str, feed: Feed) -> None:
        super().__init__(url, 0.1, "chaos-watcher")
        self.feed = feed
        self.hungry = True
        self.drained = threading.Event()
        self.last: object = None

    def step(self, storage: Storage) -> None:
        stats = self.last = storage.stats(QUEUE)
        self.feed.feed(storage, stats.pending, self.hungry)
        if stats.pending == stats.in_flight == 0 and (
            stats.succeeded + stats.dead + stats.cancelled >= len(self.feed.items)
        ):
            self.drained.set()  # a dead task is the audit's to explain, with its history

    def failed(self, exc: BaseException) -> None:
        super().failed(exc)  # surfaced by _drive
        self.drained.set()


def _drive(
    url: str, fleet: Fleet, killer: Killer, feed: Feed, timeout: float,
    on_tick: Callable[[], float] = lambda: math.inf,
) -> None:
    """Poll journals and let the killer work until the queue has drained (topped up until the
    kill plan is done). ``on_tick`` returns how soon it next needs to run (seconds)."""
    began = time.monotonic()
    with Watcher(url, feed) as watcher:
        while not watcher.drained.is_set():
            fleet.poll()
            fleet.maintain()
            soon = on_tick()
            killer.tick()
            watcher.hungry = not killer.done
            if time.monotonic() - began > timeout:
                raise ChaosFailure(f"not done in {timeout}s: {watcher.last}, {killer.figures()}")
            # Polling is the parent's whole CPU cost, and the machine is shared with the processes
            # under test: poll fast only while hunting for a marker or near a deadline.
            time.sleep(max(0.0, min(0.001 if killer.hunting else 0.005, soon)))
    if watcher.errors:
        raise watcher.errors[0]


def _run_fleet(
    url: str, fleet: Fleet, killer: Killer, feed: Feed, processes: int, timeout: float, reaper_every: float,
    on_tick: Callable[[], float] = lambda: math.inf,
) -> tuple[float, Reaper]:
    """Start ``processes``, drive them until the kill plan is done and the queue drained, with a
    reaper beside them, and tear everything down. Returns (elapsed seconds, the reaper)."""
    began = time.monotonic()
    with Reaper(url, reaper_every) as reaper:
        try:
            for _ in range(processes):
                fleet.spawn()
            _drive(url, fleet, killer, feed, timeout, on_tick=on_tick)
            elapsed = time.monotonic() - began
        finally:
            fleet.teardown()
    return elapsed, reaper


def _finish(
    storage: Storage, items: Sequence[NewTask], fleet: Fleet, killer: Killer, clock: Clock, t0: float,
    workdir: Path, reaper: Reaper, figures: dict[str, object], harness_doubts: Sequence[str] = (),
) -> Audit:
    """The audit first (a violation says more than anything else), then the run's own adequacy.
    ``harness_doubts``: ways this run's harness fell short that could explain a violation."""
    assert not reaper.errors, reaper.errors
    result = audit(storage, [i.id for i in items], fleet.spawned, clock, t0=t0)
    (workdir / "history-report.txt").write_text(result.report)
    figures.update(result.figures)
    if result.violations:
        doubts = "".join(f"HARNESS DOUBT (weigh before blaming the engine): {d}\n" for d in harness_doubts)
        raise ChaosFailure(
            f"{len(result.violations)} history violation(s); full report in {workdir / 'history-report.txt'}\n"
            f"{doubts}figures: {figures}\n" + "\n".join(result.report.splitlines()[:60])
        )
    if harness_doubts:
        raise ChaosFailure("the harness fell short (the machine is too busy?): " + "; ".join(harness_doubts))
    if not killer.done:
        raise ChaosFailure(f"the queue drained before the kill plan was done; raise the task count: {figures}")
    return result


def _worker_command(url: str, plugin_modules: Sequence[str], *, dwell_ms: float, seed: int,
                    lease_seconds: float = LEASE_SECONDS) -> Callable[[Path, int], list[str]]:
    def command(journal: Path, number: int) -> list[str]:
        line = [*_python_module("rdq_core.compliance.chaos_worker"), url, QUEUE, str(journal),
                "--lease", str(lease_seconds), "--dwell-ms", str(dwell_ms), "--seed", str(seed + number)]
        for module in plugin_modules:
            line += ["--plugin", module]
        return line

    return command


def _task(n: int, handler: str, rng_ms: int, **payload: object) -> NewTask:
    return NewTask(id=f"chaos-{n:05d}", queue=QUEUE, handler=handler, payload={"ms": rng_ms, **payload},
                   max_attempts=MAX_ATTEMPTS, backoff=FAST_BACKOFF)


# -- the tests ---------------------------------------------------------------------------------
def run_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    workers: int = 4,
    tasks: int = 300,
    kills: int = 10,
    plugin_modules: Sequence[str] = (),
    timeout: float = 240.0,
    lease_seconds: float = LEASE_SECONDS,
) -> dict[str, object]:
    """Worker processes killed inside a handler, then the full audit. A store outage (a
    failover) longer than ``lease_seconds`` lets live holders' leases lapse: a run that causes
    one gives a lease longer than the outage."""
    assert workers >= 1 and kills >= 1
    rng = random.Random(20261202)
    # The product promise is >= 300 tasks and >= 10 kills: ``tasks`` first, topped up (to 3x at
    # most) until the last kill, so a fast store cannot drain before the kills are done.
    feed = Feed(storage, lambda start, n: [_task(start + i, HANDLER, rng.randint(40, 100)) for i in range(n)],
                tasks, 3 * tasks, 8 * workers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()
    fleet = Fleet(workdir, _worker_command(url, plugin_modules, dwell_ms=0.0, seed=1000, lease_seconds=lease_seconds),
                  "worker-")
    killer = Killer(fleet, ["handler"] * kills, rng, pause=(0.1, 0.3))
    elapsed, reaper = _run_fleet(url, fleet, killer, feed, workers, timeout, reaper_every=0.05)
    figures: dict[str, object] = {"workers": workers, "top_ups": feed.top_ups, **killer.figures(),
                                  "processes_spawned": len(fleet.spawned)}
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures)
    expired = figures["lease_expired_attempts"]
    assert isinstance(expired, int) and expired >= len(killer.kills), "each kill held at least the task it was running"
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


def runner_workload(tasks: int, rng: random.Random, start: int = 0) -> list[NewTask]:
    """Mostly short handlers, plus: longer than the lease (the heartbeat must renew them), close
    to their timeout, and calling ``ctx.extend_lease`` (short, default and long extensions).

    Each long task is enqueued right behind a close-to-timeout one, so they tend to share a
    batch; when the close-to-timeout task leads its batch, its outcome waits in the settle
    buffer while the long one runs, well past the handler's timeout -- a runner that renews a
    claim only while its handler may run loses that finished task to the reaper.
    """
    first = start == 0  # the first batch has each kind at least a few times; top-ups in proportion
    n_long = max(5 if first else 0, round(tasks / 24))
    n_tight = max(6 if first else 0, round(tasks / 20), n_long)
    n_extend = max(6 if first else 0, round(tasks / 20))
    kinds = ["tight+long"] * n_long + ["tight"] * (n_tight - n_long) + ["extend"] * n_extend
    kinds += ["short"] * (tasks - len(kinds) - n_long)
    rng.shuffle(kinds)
    # Shorter than the lease (twice), the default, and longer: every variant in every batch.
    extensions = ([[100, 0.2]], [[100, None], [500, 0.3]], [[150, 6.0]])
    lease_ms = int(LEASE_SECONDS * 1000)
    items: list[NewTask] = []
    extending = 0
    for kind in kinds:
        n = start + len(items)
        if kind == "short":
            items.append(_task(n, HANDLER, rng.randint(30, 90)))
        elif kind == "extend":
            items.append(_task(n, HANDLER, rng.randint(700, 1000), extend=extensions[extending % len(extensions)]))
            extending += 1
        else:
            items.append(_task(n, TIGHT_HANDLER, rng.randint(750, 900)))
            if kind == "tight+long":
                items.append(_task(n + 1, HANDLER, rng.randint(lease_ms + 300, lease_ms + 700)))
    return items


def run_runner_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    workers: int = 4,
    tasks: int = 120,
    kills: int = 12,
    plugin_modules: Sequence[str] = (),
    timeout: float = 120.0,
    seed: int = 20261203,
) -> dict[str, object]:
    """Worker processes killed on the runner's own paths (see the module doc), then the audit."""
    assert workers >= 1 and kills >= len(RUNNER_REQUIRED)
    rng = random.Random(seed)
    feed = Feed(storage, lambda start, n: runner_workload(n, rng, start), tasks, 3 * tasks, 8 * workers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()
    plan = [RUNNER_INTENTS[i % len(RUNNER_INTENTS)] for i in range(kills)]
    rng.shuffle(plan)
    fleet = Fleet(workdir, _worker_command(url, plugin_modules, dwell_ms=3.0, seed=seed), "worker-")
    killer = Killer(fleet, plan, rng, required=RUNNER_REQUIRED, extra=2 * len(RUNNER_REQUIRED), patience=3.0)
    # Slower than the workers' own reapers, so both take part.
    elapsed, reaper = _run_fleet(url, fleet, killer, feed, workers, timeout, reaper_every=0.25)
    figures: dict[str, object] = {"workers": workers, "top_ups": feed.top_ups, **killer.figures(),
                                  "processes_spawned": len(fleet.spawned)}
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures)
    missing = [f for f in RUNNER_REQUIRED if f not in killer.landed_families()]
    assert not missing, f"no kill landed in {missing} (the harness could not find that window): {figures}"
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


def lambda_workload(tasks: int, rng: random.Random, start: int = 0) -> list[NewTask]:
    """Short handlers, a few that call ``ctx.extend_lease`` (a short one included), and a few
    whose first attempt overruns any invocation (it ends only when the invocation is killed)."""
    first = start == 0
    n_overrun = max(2 if first else 0, round(tasks / 40))
    n_extend = max(3 if first else 0, round(tasks / 25))
    kinds = ["overrun"] * n_overrun + ["extend"] * n_extend + ["short"] * (tasks - n_overrun - n_extend)
    rng.shuffle(kinds)
    extensions = ([[100, 0.2]], [[100, None]], [[100, 0.3], [350, 8.0]])
    items: list[NewTask] = []
    extending = 0
    for n, kind in enumerate(kinds, start):
        if kind == "short":
            items.append(_task(n, LAMBDA_HANDLER, rng.randint(30, 90)))
        elif kind == "extend":
            items.append(_task(n, EXTEND_HANDLER, rng.randint(500, 750), extend=extensions[extending % len(extensions)]))
            extending += 1
        else:
            items.append(_task(n, OVERRUN_HANDLER, 40, overrun_attempts=1, overrun_ms=120_000))
    return items


def run_lambda_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    containers: int = 4,
    tasks: int = 100,
    kills: int = 10,
    plugin_modules: Sequence[str] = (),
    grace: float = 1.0,
    budget: tuple[float, float] = (3.0, 5.0),
    timeout: float = 120.0,
    seed: int = 20261204,
) -> dict[str, object]:
    """Warm Lambda containers killed at journal markers and at invocation deadlines, then the audit."""
    assert containers >= 1 and kills >= len(LAMBDA_REQUIRED)
    rng = random.Random(seed)
    feed = Feed(storage, lambda start, n: lambda_workload(n, rng, start), tasks, 3 * tasks, 8 * containers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()

    def command(journal: Path, number: int) -> list[str]:
        line = [*_python_module("rdq_core.compliance.chaos_lambda"), url, QUEUE, str(journal),
                "--seed", str(seed + number), "--grace", str(grace), "--budget-min", str(budget[0]),
                "--budget-max", str(budget[1]), "--dwell-ms", "3"]
        for module in plugin_modules:
            line += ["--plugin", module]
        return line

    fleet = Fleet(workdir, command, "lambda-")
    plan = [LAMBDA_INTENTS[i % len(LAMBDA_INTENTS)] for i in range(kills)]
    rng.shuffle(plan)
    killer = Killer(fleet, plan, rng, required=LAMBDA_REQUIRED, extra=2 * len(LAMBDA_REQUIRED), patience=4.0)
    deadline_kills: list[ChaosProcess] = []

    def enforce_deadlines() -> float:
        # Lambda's timeout: the container dies the moment its invocation's time is up.
        wall = time.time()
        soonest = math.inf
        for process in list(fleet.live):
            invocation = process.journal.current_invocation()
            if invocation is None:
                continue
            if wall >= invocation.deadline:
                process.journal.poll()
                if process.journal.current_invocation() is invocation:
                    fleet.kill(process, "deadline")
                    deadline_kills.append(process)
                    fleet.spawn()
            else:
                soonest = min(soonest, invocation.deadline - wall)
        return soonest

    elapsed, reaper = _run_fleet(url, fleet, killer, feed, containers, timeout, reaper_every=0.1,
                                 on_tick=enforce_deadlines)
    invocations = [inv for p in fleet.spawned for inv in p.journal.invocations]
    late = round(max([(present(p.killed_at, f"when {p.name} was killed") - p.journal.invocations[-1].deadline) * 1000
                      for p in deadline_kills], default=0.0), 1)
    figures: dict[str, object] = {
        "containers": containers,
        "top_ups": feed.top_ups,
        **killer.figures(),
        "deadline_kills": len(deadline_kills),
        "deadline_kills_landed_in": dict(Counter(k for p in deadline_kills for k in p.landed)),
        "deadline_kill_lateness_ms_max": late,
        "invocations": len(invocations),
        "invocations_returned": sum(1 for inv in invocations if inv.returned is not None),
        "invocations_raised": sum(1 for inv in invocations if inv.result.startswith("error")),
        "processes_spawned": len(fleet.spawned),
    }
    doubts = [f"a deadline kill came {late} ms late, over half the {grace}s lease grace"] if late > grace * 500 else []
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures, doubts)
    missing = [f for f in LAMBDA_REQUIRED if f not in killer.landed_families()]
    assert not missing, f"no kill landed in {missing} (the harness could not find that window): {figures}"
    assert deadline_kills, f"no invocation was killed at its deadline: {figures}"
    assert not figures["invocations_raised"], f"run_worker_invocation raised; see {workdir}/lambda-*.out: {figures}"
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


__all__ = ["run_chaos", "run_runner_chaos", "run_lambda_chaos", "QUEUE", "LEASE_SECONDS"]
