"""The one rule on the runner's own paths: buffers, heartbeats, extensions, deadlines, odd
errors and overrunning handlers, driven through the real engine on each backend.

Every test here is a defect that once ran a task twice, lost an outcome or held a task forever
on every backend while the storage-level tests stayed green. A hostile reaper runs beside the
worker in most of them (a pass every 50 ms): any lapse in holding a lease shows up at once as a
LEASE_EXPIRED attempt and a second execution.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Callable, Iterator, Sequence, cast

from ..client import Client
from ..engine.handlers import HandlerFunc, HandlerRegistry
from ..model import Outcome, TaskStatus
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..engine.outcomes import TIMEOUT_EXCEEDS_WORKER
from ..engine.runner import BatchRunner
from ..storage.spi import Storage
from ..hosts.process.worker import HANDLER_OVERRAN, HeartbeatLedger, Worker, WorkerConfig
from .support import FAST_BACKOFF, due_at, error_of, must_get, wait_until

#: Retry budget large enough that a defect shows as extra attempts, not as an early DEAD.
POLICIES = PolicyBook(RetryPolicy(max_attempts=10, backoff=FAST_BACKOFF))


class Executions:
    """Counts every execution of every task and can hold a handler inside until released."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.inside: dict[str, threading.Event] = {}
        self.release = threading.Event()
        self._lock = threading.Lock()

    def record(self, ctx: Any) -> None:
        with self._lock:
            self.runs[ctx.task_id] += 1
            self.inside.setdefault(ctx.task_id, threading.Event()).set()

    def entered(self, task_id: str) -> threading.Event:
        with self._lock:
            return self.inside.setdefault(task_id, threading.Event())

    def returning(self, result: object, *, sleep: float = 0.0) -> HandlerFunc:
        """A handler that records its execution, sleeps ``sleep`` seconds, then returns ``result``."""

        def handler(payload: Any, ctx: Any) -> object:
            self.record(ctx)
            if sleep:
                time.sleep(sleep)
            return result

        return handler

    def holding(self, released: object = True) -> HandlerFunc:
        """A handler that records its execution and waits (30 s at most) for ``release``: it then
        returns ``released``, or False when never released."""

        def handler(payload: Any, ctx: Any) -> object:
            self.record(ctx)
            return self.release.wait(30) and released

        return handler


@contextmanager
def hostile_reaper(storage: Storage, every: float = 0.05) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            reap_expired_leases(storage, POLICIES)

    thread = threading.Thread(target=loop, name="hostile-reaper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@contextmanager
def running_worker(storage: Storage, registry: HandlerRegistry, queue: str, **config: Any) -> Iterator[Worker]:
    settings = {"queues": [queue], "idle_poll_seconds": 0.05, **config}
    worker = Worker(storage, WorkerConfig(**settings), policies=POLICIES, registry=registry)
    thread = threading.Thread(target=worker.run_forever, name="kit-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(20)


def enqueue_in_order(storage: Storage, queue: str, handlers: Sequence[str]) -> list[str]:
    """One task per handler, each due strictly after the previous one by the store's clock, so
    a claim returns them in this order on every backend."""
    client = Client(storage)
    ids: list[str] = []
    for handler in handlers:
        if ids:
            previous = due_at(storage, ids[-1])
            wait_until(_clock_passes(storage, previous + timedelta(milliseconds=2)), timeout=5, interval=0.001,
                       what="the store clock to move on")
        ids.append(client.enqueue(queue, handler).id)
    return ids


def _clock_passes(storage: Storage, instant: datetime) -> Callable[[], bool]:
    return lambda: storage.now() > instant


def in_order(claimed: Sequence[Any], ids: Sequence[str]) -> list[Any]:
    assert sorted(c.task.id for c in claimed) == sorted(ids), "the claim returned other tasks"
    return sorted(claimed, key=lambda c: ids.index(c.task.id))


def history(storage: Storage, task_id: str) -> list[tuple[int, Outcome]]:
    task = storage.get(task_id)
    assert task is not None, f"{task_id} was lost"
    return [(a.attempt_no, a.outcome) for a in task.attempts]


class RaisingOnce:
    """A store whose first ``settle`` (or ``release``) raises an error no one classified, the
    way a read-only transaction during a failover or a driver bug would."""

    def __init__(self, inner: Storage, method: str) -> None:
        self._inner = inner
        self._method = method
        self.raised = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name != self._method:
            return attribute

        def once(*args: Any, **kwargs: Any) -> Any:
            if not self.raised:
                self.raised += 1
                raise RuntimeError("cannot execute UPDATE in a read-only transaction")
            return attribute(*args, **kwargs)

        return once


class RunnerPathsCompliance:
    """Mixed into ``StorageCompliance``; uses its ``storage`` fixture."""

    #: The lease the worker tests hold tasks with; a heartbeat renews it every third of it.
    runner_lease = 0.6

    def test_a_finished_task_waiting_to_be_settled_is_never_reaped(self, storage: Storage) -> None:
        # A fast task (timeout 1 s) followed in its batch by a 4x-lease task: the fast one's
        # outcome must be written (or its lease held) while the slow one runs.
        runs = Executions()
        registry = HandlerRegistry()
        registry.register("fast", runs.returning("fast"), timeout_seconds=1)
        registry.register("slow", runs.returning("slow", sleep=4 * self.runner_lease), timeout_seconds=10)
        fast, slow = enqueue_in_order(storage, "buffered", ["fast", "slow"])
        with hostile_reaper(storage), running_worker(storage, registry, "buffered", batch_size=2,
                                                     lease_seconds=self.runner_lease):
            wait_until(lambda: must_get(storage, fast).status is TaskStatus.SUCCEEDED and
                       must_get(storage, slow).status is TaskStatus.SUCCEEDED, timeout=30, what="both tasks")
            # Written while the slow handler still ran, not at the end of the batch.
        assert history(storage, fast) == [(1, Outcome.SUCCESS)]
        assert history(storage, slow) == [(1, Outcome.SUCCESS)]
        assert runs.runs == {fast: 1, slow: 1}

    def test_an_outcome_is_durable_while_the_next_handler_still_runs(self, storage: Storage) -> None:
        runs = Executions()
        registry = HandlerRegistry()
        registry.register("quick", runs.returning("ok"), timeout_seconds=1)
        registry.register("blocking", runs.holding(), timeout_seconds=20)
        quick, blocking = enqueue_in_order(storage, "durable", ["quick", "blocking"])
        claimed = in_order(storage.claim("durable", 2, 60), [quick, blocking])
        runner = BatchRunner(storage, POLICIES, registry, lease_seconds=60, settle_interval=0.1)
        thread = threading.Thread(target=runner.run, args=(claimed,), daemon=True)
        thread.start()
        try:
            assert runs.entered(blocking).wait(10)
            # The process could die now (a Lambda timeout, OOM): the quick task's outcome is
            # already in the store, not in a buffer.
            wait_until(lambda: must_get(storage, quick).status is TaskStatus.SUCCEEDED, timeout=5,
                       what="the first outcome to be settled while the next handler runs")
        finally:
            runs.release.set()
            thread.join(20)

    def test_a_handler_overrunning_the_deadline_costs_only_its_own_task(self, storage: Storage) -> None:
        # The Lambda shape: a deadline, no heartbeat. At the deadline everything buffered is
        # settled and everything unstarted released while the overrunning handler still runs.
        runs = Executions()
        registry = HandlerRegistry()
        registry.register("quick", runs.returning("ok"), timeout_seconds=0.2)
        registry.register("overrun", runs.holding(), timeout_seconds=0.5)
        client = Client(storage)
        done = client.enqueue("deadline", "quick").id
        stuck = client.enqueue("deadline", "overrun").id
        behind = [client.enqueue("deadline", "quick").id for _ in range(3)]
        claimed = in_order(storage.claim("deadline", 5, 60), [done, stuck, *behind])
        runner = BatchRunner(storage, POLICIES, registry, lease_seconds=60, settle_margin=0.1, settle_interval=5.0)
        thread = threading.Thread(target=runner.run, args=(claimed,), kwargs={"deadline": time.monotonic() + 1.0},
                                  daemon=True)
        thread.start()
        try:
            wait_until(lambda: must_get(storage, done).status is TaskStatus.SUCCEEDED
                       and all(must_get(storage, t).status is TaskStatus.PENDING for t in behind),
                       timeout=10, what="the deadline to settle the buffer and release the rest")
            assert thread.is_alive(), "the overrunning handler is still running"
            assert must_get(storage, stuck).status is TaskStatus.IN_FLIGHT
            assert all(must_get(storage, t).attempts == () for t in behind), "a release spends no attempt"
        finally:
            runs.release.set()
            thread.join(20)

    def test_extend_lease_never_shortens_the_lease_a_task_is_held_with(self, storage: Storage) -> None:
        runs = Executions()
        registry = HandlerRegistry()

        def extend_short_then_work(payload: Any, ctx: Any) -> str:
            runs.record(ctx)
            ctx.extend_lease(0.1)  # far less than the lease the task is held with
            time.sleep(1.5)
            return "done"

        registry.register("extends", extend_short_then_work, timeout_seconds=10)
        client = Client(storage)
        on_worker = client.enqueue("extend", "extends").id
        with hostile_reaper(storage), running_worker(storage, registry, "extend", lease_seconds=4.0):
            wait_until(lambda: must_get(storage, on_worker).status is TaskStatus.SUCCEEDED, timeout=30, what="the task")
        # The Lambda shape: the claim's lease outlives the invocation; a short extension keeps it.
        on_lambda = client.enqueue("extend", "extends").id
        claimed = storage.claim("extend", 1, 30)
        with hostile_reaper(storage):
            BatchRunner(storage, POLICIES, registry, lease_seconds=30).run(claimed, deadline=time.monotonic() + 20)
        for task_id in (on_worker, on_lambda):
            assert history(storage, task_id) == [(1, Outcome.SUCCESS)]
            assert runs.runs[task_id] == 1

    def test_a_task_that_can_never_fit_the_worker_is_dead_lettered_and_the_rest_run(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("too-long", lambda payload, ctx: "never", timeout_seconds=30)
        registry.register("quick", lambda payload, ctx: "ok", timeout_seconds=1)
        client = Client(storage)
        too_long = [client.enqueue("fit", "too-long").id for _ in range(3)]
        quick = client.enqueue("fit", "quick").id
        runner = BatchRunner(storage, POLICIES, registry, lease_seconds=60, longest_run_seconds=28,
                             longest_run_reason="a 30s function timeout minus a 2s settle reserve")
        report = runner.run(storage.claim("fit", 10, 60), deadline=time.monotonic() + 28)
        assert (report.too_long, report.started) == (3, 1)
        assert must_get(storage, quick).status is TaskStatus.SUCCEEDED
        for task_id in too_long:
            task = must_get(storage, task_id)
            assert task.status is TaskStatus.DEAD
            (attempt,) = task.attempts
            assert attempt.outcome is Outcome.PERMANENT_FAILURE and error_of(attempt).type == TIMEOUT_EXCEEDS_WORKER
            assert "timeout_seconds=30" in error_of(attempt).message and "28s" in error_of(attempt).message

    def test_an_error_message_that_is_not_valid_unicode_loses_nothing(self, storage: Storage) -> None:
        name = os.fsdecode(b"report-\xff.csv")  # a lone surrogate, as an OSError on that file carries

        def cannot_parse(payload: Any, ctx: Any) -> None:
            raise RuntimeError("cannot parse " + name + " \x00")

        registry = HandlerRegistry()
        registry.register("ok", lambda payload, ctx: "ok")
        registry.register("odd", cannot_parse)
        client = Client(storage)
        ids = [client.enqueue("unicode", handler).id for handler in ("ok", "odd", "ok")]
        ledger = HeartbeatLedger(storage, 60)
        report = BatchRunner(storage, POLICIES, registry, lease_seconds=60).run(storage.claim("unicode", 3, 60), ledger=ledger)
        assert report.failed_writes == 0 and ledger.held() == []
        assert [must_get(storage, i).status for i in ids] == [TaskStatus.SUCCEEDED, TaskStatus.PENDING, TaskStatus.SUCCEEDED]
        (attempt,) = must_get(storage, ids[1]).attempts
        assert error_of(attempt).type == "RuntimeError"
        assert error_of(attempt).message == "cannot parse report-\ufffd.csv \ufffd"

    def test_a_store_raising_the_unexpected_leaves_no_claim_held_or_unfinished(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("ok", lambda payload, ctx: "ok")
        registry.register("never-fits", lambda payload, ctx: "x", timeout_seconds=100)
        client = Client(storage)
        ok = [client.enqueue("odd-store", "ok").id for _ in range(3)]
        unstarted = client.enqueue("odd-store", "never-fits").id
        for method in ("settle", "release"):
            odd = RaisingOnce(storage, method)
            # Duck-typed: every SPI call is forwarded to the real store by ``__getattr__``.
            odd_store = cast(Storage, odd)
            ledger = HeartbeatLedger(odd_store, 60)
            claimed = odd_store.claim("odd-store", 4, 60)
            BatchRunner(odd_store, POLICIES, registry, lease_seconds=60, settle_batch=1).run(
                claimed, deadline=time.monotonic() + 30, ledger=ledger)
            assert odd.raised == 1
            assert ledger.held() == [], f"{method}: claims left renewed by the heartbeat"
        # settle: the batch was retried item by item, nothing lost; release: the unstarted task
        # is no longer renewed, so its lease lapses and it comes back.
        assert [must_get(storage, i).status for i in ok] == [TaskStatus.SUCCEEDED] * 3
        assert must_get(storage, unstarted).status in (TaskStatus.PENDING, TaskStatus.IN_FLIGHT)

    def test_a_worker_alone_recovers_a_dead_workers_tasks(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("ok", lambda payload, ctx: "ok")
        task_id = Client(storage).enqueue("orphans", "ok").id
        (orphan,) = storage.claim("orphans", 1, 0.3)  # a worker that claimed, then died
        with running_worker(storage, registry, "orphans", lease_seconds=1.0):  # and no reaper anywhere
            wait_until(lambda: must_get(storage, task_id).status is TaskStatus.SUCCEEDED, timeout=20,
                       what="the worker to reap the dead worker's lease and run the task")
        assert history(storage, task_id) == [(1, Outcome.LEASE_EXPIRED), (2, Outcome.SUCCESS)]
        assert orphan.task.id == task_id

    def test_an_overrunning_handler_keeps_its_task_until_it_really_stops(self, storage: Storage) -> None:
        runs = Executions()
        registry = HandlerRegistry()
        registry.register("hangs", runs.holding("late"), timeout_seconds=0.3)
        task_id = Client(storage).enqueue("overrun", "hangs").id
        with hostile_reaper(storage):
            worker_cm = running_worker(storage, registry, "overrun", lease_seconds=self.runner_lease,
                                       overrun_grace_seconds=1.5)
            with worker_cm as worker:
                assert runs.entered(task_id).wait(10)
                # Timeout + grace, several leases long: nobody may take the task meanwhile.
                wait_until(lambda: worker.exit_reason == HANDLER_OVERRAN, timeout=20,
                           what="the worker to give up on the overrunning handler")
                assert must_get(storage, task_id).status is TaskStatus.IN_FLIGHT
                assert runs.runs[task_id] == 1
                runs.release.set()
                wait_until(lambda: must_get(storage, task_id).status is TaskStatus.SUCCEEDED, timeout=10,
                           what="the late outcome to be settled")
        assert history(storage, task_id) == [(1, Outcome.SUCCESS)]
        assert runs.runs[task_id] == 1

