"""The processes of a chaos run and the threads beside them.

``Fleet`` starts chaos processes (``python -m rdq_testing.chaos.worker`` and the like), keeps
ready spares so a replacement costs no cold start, and kills only by the PID it started.
Beside the fleet, each on its own thread and store connection: a ``Reaper`` (the ``rdq reaper``
of these tests) and a ``Watcher`` that tops the queue up from a ``Feed`` and says when it drained.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Self, Sequence

from rdq_core.engine.reaper import reap_expired_leases
from rdq_core.engine.retry import PolicyBook, RetryPolicy
from rdq_core.errors import StorageUnavailable
from rdq_core.model import Backoff, NewTask
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage

from .journal import ChaosProcess, ProcessJournal

QUEUE = "chaos"
LEASE_SECONDS = 2.0
FAST_BACKOFF = Backoff(0.05, 2.0, 0.2, 0.0)
MAX_ATTEMPTS = 50


class ChaosFailure(AssertionError):
    pass



def python_module(module: str) -> list[str]:
    """The command that runs ``module``'s ``main`` in a new interpreter. This package imports
    nothing on its own, so a chaos process pays for its own module's imports only."""
    return [sys.executable, "-m", module]


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

