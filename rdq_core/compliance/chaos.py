"""The multi-process chaos test: real workers, ``kill -9`` mid-task, then a full audit.

Each worker is a real ``rdq_core.worker.Worker`` in its own process, journaling what it did (see
``chaos_worker``). The test kills a worker only while it is inside a handler, so the journal is
complete up to the kill: the tasks that worker *held* are exactly those it claimed and never
settled or released. After the queue drains, the audit demands:

* every task SUCCEEDED, with exactly one SUCCESS attempt, nothing lost;
* each task got exactly one LEASE_EXPIRED attempt per kill that held it, and no other
  (a live worker is never overtaken by its own lease);
* attempt numbers are 1..n, unique and gap-free;
* no two executions of one task overlapped in time (a killed execution ends at the kill).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..model import Backoff, NewTask, Outcome, TaskStatus
from ..reaper import reap_expired_leases
from ..retry import PolicyBook, RetryPolicy
from ..storage import open_storage
from ..storage.spi import Storage
from .chaos_worker import HANDLER

QUEUE = "chaos"
LEASE_SECONDS = 2.0


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    journal: Path
    killed_at: float | None = None


@dataclass
class Journal:
    claims: list[tuple[str, str]] = field(default_factory=list)
    done: set[tuple[str, str]] = field(default_factory=set)
    runs: list[tuple[str, float, float | None]] = field(default_factory=list)  # (task, start, end)

    @classmethod
    def read(cls, path: Path) -> "Journal":
        journal, open_runs = cls(), {}
        for line in path.read_text().splitlines():
            kind, task_id, value = line.split(" ")
            if kind == "claim":
                journal.claims.append((task_id, value))
            elif kind == "done":
                journal.done.add((task_id, value))
            elif kind == "start":
                open_runs[task_id] = float(value)
            elif kind == "end":
                journal.runs.append((task_id, open_runs.pop(task_id), float(value)))
        journal.runs += [(task_id, start, None) for task_id, start in open_runs.items()]
        return journal

    def held(self) -> set[tuple[str, str]]:
        return {claim for claim in self.claims if claim not in self.done}


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
) -> dict[str, float]:
    assert workers >= 1 and kills >= 1
    rng = random.Random(20261202)
    fast = Backoff(0.05, 2.0, 0.2, 0.0)
    items = [
        NewTask(id=f"chaos-{n:05d}", queue=QUEUE, handler=HANDLER, payload={"ms": rng.randint(40, 100)},
                max_attempts=50, backoff=fast)
        for n in range(tasks)
    ]
    for start in range(0, tasks, 500):
        storage.enqueue(items[start:start + 500])

    began = time.monotonic()
    spawned: list[WorkerProcess] = []

    def spawn() -> WorkerProcess:
        journal = workdir / f"journal-{len(spawned):03d}.log"
        journal.touch()
        command = [sys.executable, "-m", "rdq_core.compliance.chaos_worker", url, QUEUE, str(journal),
                   "--lease", str(LEASE_SECONDS)]
        for module in plugin_modules:
            command += ["--plugin", module]
        log = open(workdir / f"worker-{len(spawned):03d}.out", "wb")
        worker = WorkerProcess(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), journal)
        spawned.append(worker)
        return worker

    live = [spawn() for _ in range(workers)]
    stop_reaper = threading.Event()
    reaper_errors: list[BaseException] = []

    def reaper_loop() -> None:
        reaper_storage = open_storage(url)
        try:
            policies = PolicyBook(RetryPolicy(50, fast))
            while not stop_reaper.wait(0.05):
                reap_expired_leases(reaper_storage, policies, queue=QUEUE)
        except BaseException as exc:  # surfaced after the run
            reaper_errors.append(exc)
        finally:
            reaper_storage.close()

    reaper = threading.Thread(target=reaper_loop, name="chaos-reaper")
    reaper.start()
    kills_done = 0
    try:
        while kills_done < kills:
            if time.monotonic() - began > timeout:
                raise AssertionError(f"only {kills_done} kills before the deadline")
            time.sleep(rng.uniform(0.1, 0.3))
            victim = rng.choice(live)
            if _kill_mid_task(victim):
                kills_done += 1
                live.remove(victim)
                live.append(spawn())
            if storage.stats(QUEUE).succeeded == tasks and kills_done < kills:
                raise AssertionError(f"the queue drained after only {kills_done} kills; make tasks longer")
        deadline = time.monotonic() + timeout
        while storage.stats(QUEUE).succeeded < tasks:
            for worker in live:
                if worker.proc.poll() is not None:
                    raise AssertionError(f"worker {worker.proc.pid} exited by itself; see {worker.journal.parent}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not drained in {timeout}s: {storage.stats(QUEUE)}")
            time.sleep(0.05)
        elapsed = time.monotonic() - began
    finally:
        stop_reaper.set()
        reaper.join(30)
        for worker in spawned:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait(30)
    assert not reaper_errors, reaper_errors

    expected_lease_expired: Counter[str] = Counter()
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for worker in spawned:
        journal = Journal.read(worker.journal)
        if worker.killed_at is not None:
            for task_id, _token in journal.held():
                expected_lease_expired[task_id] += 1
        for task_id, start, end in journal.runs:
            if end is None:
                assert worker.killed_at is not None, f"unfinished run of {task_id} in a worker that was not killed"
                end = worker.killed_at
            runs[task_id].append((start, end))

    lease_expired_total = 0
    for item in items:
        task = storage.get(item.id)
        assert task is not None, f"{item.id} was lost"
        assert task.status is TaskStatus.SUCCEEDED, f"{item.id} ended {task.status}"
        outcomes = Counter(a.outcome for a in task.attempts)
        assert outcomes[Outcome.SUCCESS] == 1, f"{item.id}: {outcomes[Outcome.SUCCESS]} SUCCESS attempts"
        assert outcomes[Outcome.LEASE_EXPIRED] == expected_lease_expired[item.id], (
            f"{item.id}: {outcomes[Outcome.LEASE_EXPIRED]} LEASE_EXPIRED attempts for "
            f"{expected_lease_expired[item.id]} kill(s) that held it"
        )
        assert set(outcomes) <= {Outcome.SUCCESS, Outcome.LEASE_EXPIRED}, f"{item.id}: {outcomes}"
        assert [a.attempt_no for a in task.attempts] == list(range(1, len(task.attempts) + 1))
        lease_expired_total += outcomes[Outcome.LEASE_EXPIRED]
        spans = sorted(runs[item.id])
        assert spans, f"{item.id} never ran"
        for (_, end), (next_start, _) in zip(spans, spans[1:]):
            assert next_start >= end, f"{item.id}: two executions overlapped ({next_start} < {end})"
    assert lease_expired_total >= kills, "each kill held at least the task it was running"
    return {
        "workers": workers,
        "tasks": tasks,
        "kills": kills_done,
        "processes_spawned": len(spawned),
        "executions": sum(len(v) for v in runs.values()),
        "lease_expired_attempts": lease_expired_total,
        "elapsed_seconds": round(elapsed, 2),
    }


def _kill_mid_task(worker: WorkerProcess, patience: float = 3.0) -> bool:
    """SIGKILL ``worker`` while a handler runs (its journal's last line is a fresh ``start``)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        lines = worker.journal.read_bytes().splitlines()
        if lines and lines[-1].startswith(b"start "):
            started = float(lines[-1].split(b" ")[2])
            if time.time() - started < 0.02:  # handlers sleep >= 40 ms: still well inside it
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.killed_at = time.time()
                worker.proc.wait(10)
                return True
        time.sleep(0.002)
    return False
