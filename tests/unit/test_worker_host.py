"""The long-running worker host: heartbeat, abandoned leases, graceful stop (on SQLite)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time


from rdq_core.engine.claiming import ClaimLoop
from rdq_core.compliance.support import wait_until
from rdq_core.flow import NO_FLOW
from rdq_core.errors import StorageUnavailable
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Backoff, Outcome, TaskStatus
from rdq_core.engine.outage import StorageHealth
from rdq_core.engine.reaper import reap_expired_leases
from rdq_core.engine.retry import PolicyBook, RetryPolicy
from rdq_core.storage import open_storage
from rdq_core.client import Client
from rdq_core.engine.runner import BatchRunner
from rdq_core.hosts.process.worker import HANDLER_OVERRAN, Worker, WorkerConfig


def start(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    return thread


def reap_in_background(storage, stop: threading.Event, policies=None) -> threading.Thread:
    def loop():
        while not stop.wait(0.05):
            reap_expired_leases(storage, policies)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_heartbeat_keeps_a_task_longer_than_its_lease(storage):
    registry = HandlerRegistry()
    registry.register("long", lambda payload, ctx: time.sleep(1.2) or "done", timeout_seconds=10)
    task = Client(storage).enqueue("hb", "long")
    worker = Worker(storage, WorkerConfig(queues=["hb"], lease_seconds=0.4, idle_poll_seconds=0.05), registry=registry)
    stop = threading.Event()
    reaper = reap_in_background(storage, stop)
    thread = start(worker)
    try:
        wait_until(lambda: storage.get(task.id).status is TaskStatus.SUCCEEDED, timeout=20, what="the long task to succeed")
    finally:
        worker.stop(), stop.set()
        thread.join(10), reaper.join(10)
    assert [a.outcome for a in storage.get(task.id).attempts] == [Outcome.SUCCESS]


def test_an_overrunning_handler_keeps_its_task_until_it_returns_and_the_worker_stops_itself(storage):
    release = threading.Event()
    runs: list[float] = []
    registry = HandlerRegistry()

    def hang(payload, ctx):
        runs.append(time.monotonic())
        return release.wait(20) and "late"

    registry.register("hang", hang, timeout_seconds=0.3)
    task = Client(storage).enqueue("hung", "hang", max_attempts=1)
    config = WorkerConfig(queues=["hung"], lease_seconds=0.3, idle_poll_seconds=0.05, overrun_grace_seconds=1.0)
    worker = Worker(storage, config, registry=registry)
    stop = threading.Event()
    reaper = reap_in_background(storage, stop)  # a second reaper, as hostile as it gets: every 50 ms
    thread = start(worker)
    try:
        # Past timeout + grace the worker stops itself (rdq worker then restarts its process);
        # all that time, a dozen leases long, the task stayed held: nobody reaped it.
        wait_until(lambda: not thread.is_alive(), timeout=20, what="the worker to stop itself")
        assert worker.exit_reason == HANDLER_OVERRAN
        held = storage.get(task.id)
        assert held.status is TaskStatus.IN_FLIGHT and held.attempts == ()
        release.set()  # the handler returns: its real outcome is recorded, once
        wait_until(lambda: storage.get(task.id).status is TaskStatus.SUCCEEDED, timeout=10, what="the late outcome")
    finally:
        release.set(), worker.stop(), stop.set()
        thread.join(10), reaper.join(10)
    final = storage.get(task.id)
    assert [(a.attempt_no, a.outcome) for a in final.attempts] == [(1, Outcome.SUCCESS)]
    assert final.result == "late" and len(runs) == 1


def test_stop_finishes_the_running_task_and_releases_the_rest(storage):
    started = threading.Event()
    registry = HandlerRegistry()

    def slow(payload, ctx):
        started.set()
        time.sleep(0.3)

    registry.register("slow", slow)
    client = Client(storage)
    client.enqueue_many("stop", [{"handler": "slow"} for _ in range(5)])
    worker = Worker(storage, WorkerConfig(queues=["stop"], batch_size=5, lease_seconds=30), registry=registry)
    thread = start(worker)
    assert started.wait(10)
    worker.stop()
    thread.join(10)
    assert not thread.is_alive()
    stats = storage.stats("stop")
    assert (stats.succeeded, stats.pending, stats.in_flight) == (1, 4, 0)


def test_worker_without_queues_serves_every_queue(storage):
    registry = HandlerRegistry()
    registry.register("ok", lambda payload, ctx: None)
    client = Client(storage)
    for queue in ("alpha", "beta"):
        client.enqueue(queue, "ok")
    worker = Worker(storage, WorkerConfig(idle_poll_seconds=0.05), registry=registry,
                    policies=PolicyBook(RetryPolicy(3, Backoff(1, 2, 10, 0))))
    thread = start(worker)
    try:
        wait_until(lambda: all(storage.stats(q).succeeded == 1 for q in ("alpha", "beta")), timeout=20, what="both queues")
    finally:
        worker.stop()
        thread.join(10)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SlowClaims:
    """The store, with every claim taking ``seconds`` of the fake clock (or raising, first)."""

    def __init__(self, storage, clock: FakeClock, seconds: float, failures: int = 0) -> None:
        self._storage, self._clock, self._seconds, self._failures = storage, clock, seconds, failures

    def claim(self, queue, limit, lease_seconds, flow=NO_FLOW):
        self._clock.now += self._seconds
        if self._failures:
            self._failures -= 1
            raise StorageUnavailable("connection refused")
        return self._storage.claim(queue, limit, lease_seconds, flow)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def test_the_claim_loop_reads_its_deadline_on_the_clock_it_is_given(storage):
    # The Lambda shape: a deadline, no idle pause. Time moves only when a claim takes it.
    clock = FakeClock()
    registry = HandlerRegistry()
    registry.register("quick", lambda payload, ctx: "ok", timeout_seconds=0.5)
    Client(storage).enqueue_many("clocked", [{"handler": "quick"} for _ in range(3)])
    store = SlowClaims(storage, clock, seconds=1.0)
    runner = BatchRunner(store, registry=registry, settle_margin=0.1, clock=clock)
    report = ClaimLoop(store, runner, queues=lambda: ["clocked"], batch_size=1, lease_seconds=lambda: 30,
                       deadline=clock.now + 2.5, clock=clock).run()
    # The first claim leaves 1.5 s (enough for 0.6 s), the second 0.5 s: released, and a round
    # without progress ends the invocation.
    assert (report.claimed, report.started, report.released) == (2, 1, 1)
    stats = storage.stats("clocked")
    assert (stats.succeeded, stats.pending, stats.in_flight) == (1, 2, 0)


def test_the_claim_loop_rides_out_an_outage_with_backoff_and_idles_on_the_wait_it_is_given(storage):
    # The long-running shape: no deadline, a health tracker, an idle pause; nothing really sleeps.
    clock = FakeClock()
    pauses: list[float] = []
    store = SlowClaims(storage, clock, seconds=0.0, failures=3)
    health = StorageHealth(logging.getLogger("rdq.worker"), clock=clock)
    loop = ClaimLoop(store, BatchRunner(store, clock=clock), queues=lambda: ["quiet"], batch_size=5,
                     lease_seconds=lambda: 30, should_stop=lambda: len(pauses) >= 5, idle_pause=1.0,
                     health=health, clock=clock, wait=pauses.append)
    assert loop.run().claimed == 0
    assert pauses == [0.5, 1.0, 2.0, 1.0, 1.0]  # reconnect backoff, then the idle pause
    assert health.outages == 1 and health.failures_in_outage == 0  # ended by the first good claim


def test_a_running_task_names_the_worker_process_that_holds_it(storage):
    seen: list[str | None] = []
    registry = HandlerRegistry()
    registry.register("look", lambda payload, ctx: seen.append(storage.get(ctx.task_id).claimed_by), timeout_seconds=5)
    task = Client(storage).enqueue("named", "look")
    worker = Worker(storage, WorkerConfig(queues=["named"], name="billing-7"), registry=registry)
    assert worker.run_once() == 1
    assert seen == [f"{socket.gethostname()}:{os.getpid()} billing-7"]
    assert storage.get(task.id).claimed_by is None, "settled: no longer shown"


def test_a_claim_loop_over_a_store_whose_claim_takes_no_worker_name_still_claims(storage):
    # SlowClaims.claim has the signature the SPI had before ``worker=``: a backend written then.
    registry = HandlerRegistry()
    registry.register("quick", lambda payload, ctx: "ok", timeout_seconds=5)
    Client(storage).enqueue_many("older", [{"handler": "quick"} for _ in range(2)])
    store = SlowClaims(storage, FakeClock(), seconds=0.0)
    loop = ClaimLoop(store, BatchRunner(store, registry=registry), queues=lambda: ["older"], batch_size=5,
                     lease_seconds=lambda: 30, worker="host:1")
    assert loop.run_round().started == 2
    assert storage.stats("older").succeeded == 2


def test_drain_settles_every_batch_with_or_without_settling_behind(tmp_path):
    """``Worker.drain`` runs the claim loop until the queue is empty; whether each batch's last
    settle overlaps the next claim or not, every task is SUCCEEDED with one attempt when it
    returns, and nothing is left held."""
    from rdq_core.client import Client
    from rdq_core.engine.handlers import HandlerRegistry
    from rdq_core.hosts.process.worker import Worker, WorkerConfig

    for behind in (True, False):
        storage = open_storage(f"sqlite:///{tmp_path}/drain-{behind}.db")
        storage.migrate()
        Client(storage).enqueue_many("q", [{"handler": "noop", "payload": {"n": i}} for i in range(250)])
        registry = HandlerRegistry()
        registry.register("noop", lambda payload, ctx: None, timeout_seconds=5)
        worker = Worker(storage, WorkerConfig(queues=["q"], batch_size=20, settle_behind=behind), registry=registry)
        assert worker.drain() == 250
        stats = storage.stats("q")
        assert (stats.succeeded, stats.pending, stats.in_flight) == (250, 0, 0), (behind, stats)
        assert worker.ledger.held() == []
        storage.close()
