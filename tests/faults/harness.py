"""What every storage-fault test shares: a real ``Worker`` and reaper running in threads, a
handler that records its executions, and the audit run after each fault."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rdq_core.compliance.support import FAST_BACKOFF, wait_until
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Outcome, TaskStatus
from rdq_core.engine.reaper import reap_forever
from rdq_core.engine.retry import PolicyBook, RetryPolicy
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig

#: Storage faults must never dead-letter a task: a generous budget with fast backoff.
FAULT_POLICIES = PolicyBook(RetryPolicy(max_attempts=20, backoff=FAST_BACKOFF))


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query)))


class Executions:
    """The ``fault.work`` handler: sleeps ``payload["sleep"]``, waits on ``gate`` when the
    payload says ``gated``, and records every execution's (start, end) per task."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered_gate = threading.Event()
        self.by_task: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.registry = HandlerRegistry()
        self.registry.register("fault.work", self.work, timeout_seconds=10)

    def work(self, payload, ctx):
        began = time.monotonic()
        if payload.get("gated"):
            self.entered_gate.set()
            assert self.gate.wait(30), "the test never opened the gate"
        time.sleep(payload.get("sleep", 0))
        with self._lock:
            self.by_task[ctx.task_id].append((began, time.monotonic()))
        return {"n": payload["n"]}


class RunningHost:
    """A ``Worker`` (its own storage connection, tagged) and a reaper (another one), in threads."""

    def __init__(self, worker_url: str, reaper_url: str, queue: str, executions: Executions, *,
                 lease_seconds: float = 2.0, batch_size: int = 4) -> None:
        self.worker_storage = open_storage(worker_url)
        self.reaper_storage = open_storage(reaper_url)
        self.worker = Worker(
            self.worker_storage,
            WorkerConfig(queues=[queue], batch_size=batch_size, lease_seconds=lease_seconds, idle_poll_seconds=0.05),
            registry=executions.registry,
            policies=FAULT_POLICIES,
        )
        self._reaper_stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.worker.run_forever, name="fault-worker", daemon=True),
            threading.Thread(
                target=reap_forever, name="fault-reaper", daemon=True,
                args=(self.reaper_storage, FAULT_POLICIES),
                kwargs={"interval": 0.1, "should_stop": self._reaper_stop.is_set},
            ),
        ]

    def __enter__(self) -> "RunningHost":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.worker.stop()
        self._reaper_stop.set()
        for thread in self._threads:
            thread.join(35)
        alive = [t.name for t in self._threads if t.is_alive()]
        self.worker_storage.close()
        self.reaper_storage.close()
        assert not alive, f"threads did not stop: {alive}"

    @property
    def reconnect_attempts(self) -> int:
        return self.worker.telemetry.counts["reconnect_attempts"]


def enqueue_work(storage, queue: str, count: int, *, sleep: float = 0.0, gated: int = 0) -> list[str]:
    from rdq_core.client import Client

    items = [{"handler": "fault.work", "payload": {"n": n, "sleep": sleep, "gated": n < gated}} for n in range(count)]
    ids = [r.task.id for r in Client(storage).enqueue_many(queue, items)]
    _ENQUEUED[queue] = ids
    return ids


def wait_for_drain(storage, queue: str, count: int, timeout: float, what: str) -> None:
    def drained():
        stats = storage.stats(queue)
        return stats.succeeded == count and stats.in_flight == 0 and stats.pending == 0

    try:
        wait_until(drained, timeout=timeout, interval=0.05, what=what)
    except AssertionError as exc:
        stuck = [t for t in (storage.get(i) for i in _ids_of(storage, queue)) if t.status is not TaskStatus.SUCCEEDED]
        shown = [(t.id, t.status.value, t.next_attempt_at, t.lease_expires_at, [a.outcome.value for a in t.attempts])
                 for t in stuck[:5]]
        raise AssertionError(f"{exc}; stats {storage.stats(queue)}; not succeeded: {shown}") from None


_ENQUEUED: dict[str, list[str]] = {}


def _ids_of(storage, queue: str) -> list[str]:
    return _ENQUEUED.get(queue, [])


def audit(storage, task_ids: list[str], executions: Executions) -> dict[str, int]:
    """No task lost, none settled twice, every attempt row accounted for, no overlap.

    Returns how many attempts of each outcome the history holds (for the test to bound)."""
    outcomes: dict[str, int] = defaultdict(int)
    for task_id in task_ids:
        task = storage.get(task_id)
        assert task is not None, f"task {task_id} was lost"
        assert task.status is TaskStatus.SUCCEEDED, f"task {task_id} ended {task.status.value}"
        numbers = [a.attempt_no for a in task.attempts]
        assert numbers == list(range(1, len(numbers) + 1)), f"task {task_id}: attempt numbers {numbers} have gaps"
        successes = [a for a in task.attempts if a.outcome is Outcome.SUCCESS]
        assert len(successes) == 1, f"task {task_id} settled SUCCESS {len(successes)} times"
        assert task.attempts[-1].outcome is Outcome.SUCCESS, f"task {task_id}: SUCCESS is not the last attempt"
        for attempt in task.attempts[:-1]:
            # A storage fault may cost a lease (the reaper's LEASE_EXPIRED), never a handler failure.
            assert attempt.outcome is Outcome.LEASE_EXPIRED, f"task {task_id}: unexpected {attempt}"
        assert task.attempt_count == len(task.attempts), f"task {task_id}: budget and history disagree"
        assert task.result is not None, f"task {task_id} lost its result"
        runs = sorted(executions.by_task[task_id])
        assert runs, f"task {task_id} SUCCEEDED without its handler running"
        # Every LEASE_EXPIRED row stands for a run whose outcome could not be settled (or a claim
        # never started), so the rows never outnumber the runs by more than the lost claims.
        assert len(task.attempts) >= 1 and len(runs) <= len(task.attempts), (
            f"task {task_id}: {len(runs)} runs but only {len(task.attempts)} attempt rows")
        for (_, end), (start, _) in itertools.pairwise(runs):
            assert start >= end, f"task {task_id}: two executions overlapped"
        for attempt in task.attempts:
            outcomes[attempt.outcome.value] += 1
    return dict(outcomes)


#: What the worker host says about storage trouble: outage start and end, dropped connections,
#: writes that were retried or given up.
INCIDENT_WORDS = ("storage unavailable", "reachable again", "dropped", "could not settle",
                  "could not release", "succeeded on attempt")


def incident_lines(records: list[logging.LogRecord]) -> list[str]:
    """The worker host's lines about storage trouble: only its own threads (the reaper, its
    own process in production, and the test's polling connection are left out)."""
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}" for r in records
        if r.levelno >= logging.INFO and r.threadName.startswith(("rdq-", "fault-worker"))
        and r.name.startswith(("rdq.", "rdq_core."))
        and any(word in r.getMessage() for word in INCIDENT_WORDS)
    ]
