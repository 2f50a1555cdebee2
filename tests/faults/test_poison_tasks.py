"""Poison tasks against a real ``rdq worker`` process (the test is its supervisor) and the
reaper: each poison ends in clean failure or LEASE_EXPIRED attempts, is retried and goes DEAD
when its budget is spent, while the neighbours claimed in the same batch still succeed.

Storage is a SQLite file (the poisons test the engine, not a backend). The worker runs under
``RLIMIT_AS`` = 1 GiB, so the memory poison meets MemoryError, never the machine's OOM killer.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.model import Outcome, TaskStatus
from rdq_core.engine.reaper import reap_forever
from rdq_core.engine.retry import policy_book_from_config
from rdq_core.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
QUEUE = "poison"
POISON_ATTEMPTS = 3
NEIGHBOURS = 4
# Two seconds: with one, a busy two-core machine could delay a heartbeat past the expiry while the
# memory poison allocates, and an attempt read LEASE_EXPIRED instead of the handler's MemoryError.
LEASE = 2.0
WORKER_ADDRESS_SPACE = 1024 ** 3
POLICIES = {QUEUE: {"max_attempts": POISON_ATTEMPTS, "backoff": {"initial_seconds": 0.05, "max_seconds": 0.2, "jitter": 0}}}


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))


class SupervisedWorker:
    """``rdq worker`` as a child process, restarted (boundedly) whenever it dies."""

    def __init__(self, url: str, workdir: Path, max_restarts: int) -> None:
        self.url = url
        self.workdir = workdir
        self.max_restarts = max_restarts
        self.exit_codes: list[int] = []
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, "RDQ_QUEUE_POLICIES": json.dumps(POLICIES), "PYTHONPATH": str(REPO),
               "RDQ_LOG_LEVEL": "INFO"}
        log = open(self.workdir / f"worker-{len(self.exit_codes)}.log", "wb")
        with log:
            return subprocess.Popen(
                [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", self.url, "worker",
                 "--handlers", "tests.faults.poison_handlers", "--queues", QUEUE,
                 "--batch", str(NEIGHBOURS + 1), "--lease", str(LEASE)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_limit_address_space,
            )

    def supervise(self) -> None:
        """Called while waiting: restart the worker if it died (as a process supervisor would)."""
        code = self.process.poll()
        if code is not None:
            self.exit_codes.append(code)
            assert len(self.exit_codes) <= self.max_restarts, f"worker died {len(self.exit_codes)} times: {self.exit_codes}"
            self.process = self._spawn()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # our child, by PID
        try:
            return self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError("the worker ignored SIGTERM for 10 s") from None

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("worker-*.log")))


POISONS = {
    # name: (handler, payload, outcome of each attempt, error type, worker deaths)
    "os._exit": ("poison.exit", None, Outcome.LEASE_EXPIRED, "rdq.LeaseExpired", POISON_ATTEMPTS),
    "memory": ("poison.memory", None, Outcome.RETRYABLE_FAILURE, "MemoryError", 0),
    "recursion": ("poison.recursion", None, Outcome.RETRYABLE_FAILURE, "RecursionError", 0),
    "hang": ("poison.hang", None, Outcome.LEASE_EXPIRED, "rdq.LeaseExpired", 0),
    "unserialisable-object": ("poison.unserialisable", {"kind": "object"}, Outcome.RETRYABLE_FAILURE, "rdq.InvalidResult", 0),
    "unserialisable-circular": ("poison.unserialisable", {"kind": "circular"}, Outcome.RETRYABLE_FAILURE, "rdq.InvalidResult", 0),
    "unserialisable-nan": ("poison.unserialisable", {"kind": "nan"}, Outcome.RETRYABLE_FAILURE, "rdq.InvalidResult", 0),
    "unserialisable-deep": ("poison.unserialisable", {"kind": "deep"}, Outcome.RETRYABLE_FAILURE, "rdq.InvalidResult", 0),
    "undescribable-exception": ("poison.undescribable", None, Outcome.RETRYABLE_FAILURE,
                                "tests.faults.poison_handlers._Undescribable", 0),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_poison_task_is_retried_then_dead_and_its_batch_neighbours_succeed(poison, tmp_path):
    handler, payload, outcome, error_type, deaths = POISONS[poison]
    url = f"sqlite:///{tmp_path}/rdq.db"
    store = open_storage(url)
    store.migrate()
    client = Client(store)
    # The poison first, so it runs first in the batch its neighbours share.
    poison_id = client.enqueue(QUEUE, handler, payload).id
    neighbour_ids = [r.task.id for r in client.enqueue_many(
        QUEUE, [{"handler": "fault.ok", "payload": {"n": n}, "max_attempts": 10} for n in range(NEIGHBOURS)])]
    reaper_stop = threading.Event()
    reaper = threading.Thread(target=reap_forever, args=(store, policy_book_from_config(POLICIES)),
                              kwargs={"interval": 0.1, "should_stop": reaper_stop.is_set}, daemon=True)
    worker = SupervisedWorker(url, tmp_path, max_restarts=deaths)
    reaper.start()
    try:
        def settled() -> bool:
            worker.supervise()
            ids = [poison_id, *neighbour_ids]
            return all(store.get(i).status in (TaskStatus.DEAD, TaskStatus.SUCCEEDED) for i in ids)

        wait_until(settled, timeout=60, interval=0.05, what=f"the {poison} poison to go DEAD and its neighbours to succeed")
        still_running = worker.process.poll() is None
        exit_code = worker.stop()
    finally:
        reaper_stop.set()
        reaper.join(10)
        if worker.process.poll() is None:
            worker.process.kill()
    logs = worker.logs()

    dead = store.get(poison_id)
    assert dead.status is TaskStatus.DEAD, logs
    assert [a.attempt_no for a in dead.attempts] == list(range(1, POISON_ATTEMPTS + 1)), dead.attempts
    assert all(a.outcome is outcome for a in dead.attempts), [a.outcome for a in dead.attempts]
    assert all(a.error.type == error_type for a in dead.attempts), [a.error for a in dead.attempts]
    assert dead.last_error.type == error_type

    for task_id in neighbour_ids:
        task = store.get(task_id)
        assert task.status is TaskStatus.SUCCEEDED, (task, logs)
        assert [a.outcome for a in task.attempts].count(Outcome.SUCCESS) == 1
        assert [a.attempt_no for a in task.attempts] == list(range(1, len(task.attempts) + 1))
        if deaths == 0:
            # The worker survived the poison, so it served (or released) the rest of the batch:
            # no neighbour may have waited out a lease.
            assert [a.outcome for a in task.attempts] == [Outcome.SUCCESS], task.attempts

    assert worker.exit_codes == [17] * deaths, worker.exit_codes
    if deaths == 0:
        assert still_running, f"the worker exited on the {poison} poison:\n{logs}"
        assert exit_code == 0, logs  # it still stops cleanly on SIGTERM
    store.close()
