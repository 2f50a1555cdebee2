"""The driver of the exactly-once chaos test (the kit's ``ExactlyOnceChaosCompliance``): real
worker processes run a handler that inserts a row into an application table and completes its
task in one ``ctx.transaction()`` (``chaos.exactly_once_worker``); a reaper runs beside them.
Each fated task's first attempt is SIGKILLed inside the block before COMMIT, after its fenced
completion was written but before COMMIT, and after COMMIT before the worker heard; or frozen
(SIGSTOP) until the reaper took its lease, then killed before COMMIT or let go on to a COMMIT
the fence refuses. Then:

* every task SUCCEEDED with exactly one SUCCESS attempt, preceded by one LEASE_EXPIRED exactly when
  its first run was killed or fenced out before COMMIT (a kill after COMMIT leaves the single
  SUCCESS: the task never runs again);
* the application table holds exactly one row per task, written by the attempt that SUCCEEDED:
  none from a transaction that was killed or fenced out, none twice;
* the chaos history checker (``chaos.history.audit``) agrees with every process's journal.

Runs where a store ``joins_transactions`` (PostgreSQL, SQLite); elsewhere ``ctx.transaction()``
is refused (the kit's ``exactly_once``). Only processes this module started are killed, frozen and
thawed, by PID; everything runs on loopback.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rdq_core.model import NewTask, Outcome
from rdq_core.storage.spi import Storage

from ..app_database import AppDatabase
from .exactly_once_worker import FATES, FREEZE_FATES, HANDLER, thaw_path
from .fleet import FAST_BACKOFF, LEASE_SECONDS, MAX_ATTEMPTS, QUEUE, ChaosFailure, Feed, Fleet, Reaper, Watcher, python_module
from .history import audit
from .journal import ChaosProcess, Claim, Clock

#: Where a holding process is killed: its handler inside the block, or its transaction's COMMIT.
KILL_POINTS = ("handler", "tx-settled", "tx-committed")


@dataclass(eq=False)
class _Freeze:
    process: ChaosProcess
    claim: Claim
    #: SQLite: the frozen process is known to hold no write lock (a successful probe proves it).
    clear: bool
    locked_since: float | None = None
    next_check: float = 0.0


class Conductor:
    """Acts on what the journals show: kills a process holding at a kill point, freezes one
    holding at a freeze point, and thaws it once the store shows its lease reaped."""

    def __init__(self, storage: Storage, fleet: Fleet, app_db: AppDatabase, fates: dict[str, str | None]) -> None:
        self.storage = storage
        self.fleet = fleet
        self.app_db = app_db
        #: Fated tasks whose fate has not struck yet: the run is not over before it has.
        self.unmet = {task_id: fate for task_id, fate in fates.items() if fate is not None}
        self.frozen: dict[ChaosProcess, _Freeze] = {}
        self.seen: set[Claim] = set()
        self.thawed: list[tuple[ChaosProcess, Claim]] = []
        #: What each fated first attempt met: (task id, point) of every kill and freeze.
        self.kills: list[tuple[str, str]] = []
        self.freezes: list[str] = []
        self.refreezes = 0

    def tick(self) -> None:
        for process in list(self.fleet.live):
            if process not in self.frozen:
                self._act_on(process)
        for freeze in list(self.frozen.values()):
            self._watch(freeze)

    def _act_on(self, process: ChaosProcess) -> None:
        journal = process.journal
        for point in KILL_POINTS:
            if journal.holding(point):
                if point == "handler":
                    task_id = journal.held_claims(point)[0].task_id
                else:
                    call = next(c for c in journal.open.values() if c.held == point)
                    task_id = call.items[0][0]
                self.kills.append((task_id, point))
                self.unmet.pop(task_id, None)
                self.fleet.kill(process, point)
                self.fleet.spawn()
                return
        for claim in journal.held_claims("freeze"):
            if claim not in self.seen:
                self.seen.add(claim)
                self._freeze(process)
                self.frozen[process] = _Freeze(process, claim, clear=self.app_db.kind != "sqlite")
                self.freezes.append(claim.task_id)
                if self.unmet.get(claim.task_id) == "freeze-then-commit":
                    del self.unmet[claim.task_id]  # what remains is its thaw (see settled)

    @staticmethod
    def _freeze(process: ChaosProcess) -> None:
        os.kill(process.pid, signal.SIGSTOP)  # our own child, not yet waited for
        process.frozen.append((time.time(), None))

    @staticmethod
    def _thaw(process: ChaosProcess) -> None:
        os.kill(process.pid, signal.SIGCONT)
        start, _ = process.frozen[-1]
        process.frozen[-1] = (start, time.time())

    def _watch(self, freeze: _Freeze) -> None:
        now = time.monotonic()
        if now < freeze.next_check:
            return
        freeze.next_check = now + 0.02
        process = freeze.process
        if not freeze.clear:
            # A SQLite process frozen inside a write (its heartbeat's, its reaper's) would hold the
            # database's lock and stop every writer, the reaper included -- SQLite's nature, not
            # what this test is about: freeze it again at another moment.
            if self._write_lock_free():
                freeze.clear = True
            elif freeze.locked_since is None:
                freeze.locked_since = now
            elif now - freeze.locked_since > 0.5:
                self._thaw(process)
                time.sleep(0.02)
                self._freeze(process)
                freeze.locked_since = None
                self.refreezes += 1
            return
        freeze.next_check = now + 0.05
        task = self.storage.get(freeze.claim.task_id)
        reaped = task is not None and any(
            a.attempt_no == freeze.claim.attempt and a.outcome is Outcome.LEASE_EXPIRED for a in task.attempts)
        if reaped:
            Path(thaw_path(str(process.journal.path), freeze.claim.task_id)).touch()  # before it runs again
            self._thaw(process)
            del self.frozen[process]
            self.thawed.append((process, freeze.claim))

    def _write_lock_free(self) -> bool:
        probe = sqlite3.connect(self.app_db.path, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            probe.close()

    def settled(self) -> bool:
        """Every fate struck, nothing frozen, and every thawed handler heard from its COMMIT (or
        died): the queue can drain before a process killed after its COMMIT is."""
        return not self.unmet and not self.frozen and all(
            process.killed_at is not None or any(call.status is not None for call in claim.writes)
            for process, claim in self.thawed)


def workload(per_fate: int, plain: int, rng: random.Random) -> tuple[list[NewTask], dict[str, str | None]]:
    """``per_fate`` tasks of each fate and ``plain`` ones, shuffled; half of each kind on the
    application's own connection, half on the store's."""
    fates: list[str | None] = [fate for fate in FATES for _ in range(per_fate)] + [None] * plain
    rng.shuffle(fates)
    seen: Counter[str | None] = Counter()
    items: list[NewTask] = []
    fate_of: dict[str, str | None] = {}
    for n, fate in enumerate(fates):
        payload: dict[str, object] = {"ms": rng.randint(20, 60), "app_connection": seen[fate] % 2 == 1}
        seen[fate] += 1
        if fate is not None:
            payload["fate"] = fate
        task_id = f"xo-chaos-{n:04d}"
        fate_of[task_id] = fate
        items.append(NewTask(id=task_id, queue=QUEUE, handler=HANDLER, payload=payload,
                             max_attempts=MAX_ATTEMPTS, backoff=FAST_BACKOFF))
    return items, fate_of


def run_exactly_once_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    workers: int = 4,
    per_fate: int = 3,
    plain: int = 30,
    plugin_modules: Sequence[str] = (),
    timeout: float = 60.0,
    seed: int = 20261205,
) -> dict[str, object]:
    assert workers >= 2 and per_fate >= 1
    app_db = AppDatabase(url)
    rng = random.Random(seed)
    items, fates = workload(per_fate, plain, rng)
    feed = Feed(storage, lambda start, n: items[start:start + n], len(items), len(items), 0)
    clock = Clock.measure(storage)
    t0 = time.time()

    def command(journal: Path, number: int) -> list[str]:
        line = [*python_module("rdq_testing.chaos.exactly_once_worker"), url, QUEUE, str(journal),
                "--lease", str(LEASE_SECONDS), "--batch", "1", "--app-db", app_db.path if app_db.kind == "sqlite" else app_db.url,
                "--app-table", app_db.table]
        for module in plugin_modules:
            line += ["--plugin", module]
        return line

    # Batches of one: a process killed for one task's fate holds no other task.
    fleet = Fleet(workdir, command, "xo-worker-")
    conductor = Conductor(storage, fleet, app_db, fates)
    began = time.monotonic()
    with Reaper(url, 0.1) as reaper, Watcher(url, feed) as watcher:
        try:
            for _ in range(workers):
                fleet.spawn()
            while not (watcher.drained.is_set() and conductor.settled()):
                fleet.poll()
                fleet.maintain()
                conductor.tick()
                if time.monotonic() - began > timeout:
                    raise ChaosFailure(f"not done in {timeout}s: {watcher.last}, fates not met: {conductor.unmet}, "
                                       f"frozen: {[f.claim.task_id for f in conductor.frozen.values()]}, see {workdir}")
                time.sleep(0.002)
            elapsed = time.monotonic() - began
        finally:
            fleet.teardown()  # SIGKILL ends a frozen process too
    if watcher.errors:
        raise watcher.errors[0]
    assert not reaper.errors, reaper.errors

    figures: dict[str, object] = {
        "tasks": len(items), "workers": workers, "processes_spawned": len(fleet.spawned),
        "kills": dict(Counter(point for _, point in conductor.kills)), "freezes": len(conductor.freezes),
        "refreezes": conductor.refreezes,
        "frozen_seconds_max": round(max((e - s for p in fleet.spawned for s, e in p.frozen if e is not None),
                                        default=0.0), 2),
    }
    result = audit(storage, [item.id for item in items], fleet.spawned, clock, t0=t0)
    (workdir / "history-report.txt").write_text(result.report)
    figures.update(result.figures)
    problems = [f"history: {v}" for v in result.violations]
    problems += _check_effects(storage, app_db, fates, conductor)
    if problems:
        raise ChaosFailure(f"{len(problems)} problem(s); history report in {workdir / 'history-report.txt'}\n"
                           f"figures: {figures}\n" + "\n".join(problems[:60]))
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


def _check_effects(storage: Storage, app_db: AppDatabase, fates: dict[str, str | None],
                   conductor: Conductor) -> list[str]:
    """Every fate met, and each task's history and rows what its fate allows."""
    problems: list[str] = []
    met = {task_id: point for task_id, point in conductor.kills}
    expected_point = {"kill-in-block": "handler", "kill-before-commit": "tx-settled",
                      "kill-after-commit": "tx-committed", "freeze-then-kill": "handler"}
    for task_id, fate in fates.items():
        if fate in expected_point and met.get(task_id) != expected_point[fate]:
            problems.append(f"{task_id}: fate {fate} not met (killed at {met.get(task_id)})")
        if fate in FREEZE_FATES and task_id not in conductor.freezes:
            problems.append(f"{task_id}: fate {fate} not met (never frozen)")
    if stray := [t for t, _ in conductor.kills if fates.get(t) is None]:
        problems.append(f"kills hit tasks with no fate: {stray}")

    with app_db.session() as conn:
        rows = conn.execute(f"SELECT task_id, attempt FROM {app_db.table}").fetchall()
    rows_of: dict[str, list[int]] = {}
    for task_id, attempt in rows:
        rows_of.setdefault(str(task_id), []).append(int(attempt))
    if unknown := set(rows_of) - set(fates):
        problems.append(f"rows for tasks never enqueued: {sorted(unknown)}")
    for task_id, fate in fates.items():
        task = storage.get(task_id)
        if task is None:
            problems.append(f"{task_id}: missing")
            continue
        history = [a.outcome for a in task.attempts]
        # Only a run killed or fenced out before its COMMIT loses its lease; after COMMIT the
        # task is done, whatever became of the process.
        lost_before_commit = fate is not None and fate != "kill-after-commit"
        wanted = [Outcome.LEASE_EXPIRED] * lost_before_commit + [Outcome.SUCCESS]
        if history != wanted:
            problems.append(f"{task_id} ({fate}): attempts {[o.value for o in history]}, "
                            f"expected {[o.value for o in wanted]} ({task.status.value})")
        successes = [a.attempt_no for a in task.attempts if a.outcome is Outcome.SUCCESS]
        if rows_of.get(task_id, []) != successes[-1:] or len(successes) != 1:
            problems.append(f"{task_id} ({fate}): rows written by attempts {rows_of.get(task_id, [])}, "
                            f"SUCCESS by attempts {successes}: one row, by the attempt that succeeded, expected")
    return problems
