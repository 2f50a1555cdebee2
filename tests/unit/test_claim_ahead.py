"""Claiming the next batch while this one runs (``ClaimAhead``, on SQLite): each task still runs
once, the claims waiting ahead are held (renewed) and a stopping loop releases them."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from rdq_core.client import Client
from rdq_core.engine import claiming
from rdq_core.engine.claiming import CLAIM_AHEAD_MAX_RUN_SECONDS, ClaimLoop, run_concurrently
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.engine.runner import BatchRunner
from rdq_core.hosts.process.worker import HeartbeatLedger
from rdq_core.model import TaskStatus
from rdq_testing.conditions import wait_until

QUEUE = "ahead"


def _ledger(storage) -> HeartbeatLedger:
    """The ledger ``rdq worker`` keeps (its heartbeat is not started here)."""
    return HeartbeatLedger(storage, 30.0)


def _loop(storage, registry, ledger, batch, should_stop=lambda: False, settle_behind=True,
          queues=lambda: [QUEUE]) -> ClaimLoop:
    return ClaimLoop(storage, BatchRunner(storage, registry=registry), queues=queues, batch_size=batch,
                     lease_seconds=lambda: 30, ledger=ledger, claim_ahead=True, should_stop=should_stop,
                     settle_behind=settle_behind)


def _enqueue(storage, n: int) -> None:
    client = Client(storage)
    for start in range(0, n, 100):
        client.enqueue_many(QUEUE, [{"handler": "quick", "id": f"t{i:04d}"} for i in range(start, min(n, start + 100))])


def test_every_task_runs_once_when_two_loops_claim_ahead(storage):
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def quick(payload, ctx):
        with lock:
            runs[ctx.task_id] += 1

    registry = HandlerRegistry()
    registry.register("quick", quick, timeout_seconds=5)
    _enqueue(storage, 600)
    ledger = _ledger(storage)
    report = run_concurrently(_loop(storage, registry, ledger, batch=20), 2)
    assert report.started == 600 and set(runs.values()) == {1} and len(runs) == 600
    assert storage.stats(QUEUE).succeeded == 600 and not ledger.held()


def _most_held_while_draining(storage, tasks: int, batch: int, expect_ahead: bool = False) -> int:
    """Drain ``tasks`` quick tasks, each batch settled before the next is claimed (no settle
    behind), and return the most claims the ledger held while a handler ran.

    ``expect_ahead``: until a batch claimed ahead has been seen, the first task of each batch
    after the first gives the claim ahead (on its own thread) up to a second to land; a loaded
    machine may otherwise run a whole batch of trivial handlers before it comes back. A wait that
    runs out makes that batch slow, so the next one is not claimed ahead, the one after is."""
    ledger = _ledger(storage)
    held_counts: list[int] = []

    def quick(payload, ctx):
        held = len(ledger.held())
        first_of_a_later_batch = len(held_counts) >= batch and len(held_counts) % batch == 0
        if expect_ahead and first_of_a_later_batch and max(held_counts) <= batch:
            deadline = time.monotonic() + 1.0
            while held <= batch and time.monotonic() < deadline:
                time.sleep(0.005)
                held = len(ledger.held())
        held_counts.append(held)

    registry = HandlerRegistry()
    registry.register("quick", quick, timeout_seconds=5)
    _enqueue(storage, tasks)
    _loop(storage, registry, ledger, batch=batch, settle_behind=False).run()
    assert storage.stats(QUEUE).succeeded == tasks and not ledger.held() and held_counts
    return max(held_counts)


def test_the_batch_claimed_ahead_is_held_while_it_waits(storage):
    # Without claiming ahead at most one batch is ever held. Seen from the handlers, a second
    # batch is held too -- claimed ahead, its leases renewed with the rest -- and never a third.
    most = _most_held_while_draining(storage, 200, batch=10, expect_ahead=True)
    assert most > 10, "no batch was ever claimed ahead"
    assert most <= 20, "more than one batch was claimed ahead"


def test_a_stopping_loop_releases_the_batch_it_claimed_ahead(storage):
    stop = threading.Event()
    started: list[str] = []

    def quick(payload, ctx):
        started.append(ctx.task_id)
        if len(started) == 25:
            stop.set()  # mid-batch: the rest of this batch is set aside, the next one was claimed ahead

    registry = HandlerRegistry()
    registry.register("quick", quick, timeout_seconds=5)
    _enqueue(storage, 100)
    ledger = _ledger(storage)
    report = _loop(storage, registry, ledger, batch=10, should_stop=stop.is_set).run()
    stats = storage.stats(QUEUE)
    assert report.started == len(started) == stats.succeeded == 25
    assert stats.in_flight == 0 and stats.pending == 75 and not ledger.held()
    unstarted = [storage.get(f"t{i:04d}") for i in range(100) if f"t{i:04d}" not in started]
    assert all(t.status is TaskStatus.PENDING and t.attempt_count == 0 and not t.attempts for t in unstarted)


def test_slow_batches_are_not_claimed_ahead(storage):
    ledger = _ledger(storage)
    most_held: list[int] = []
    gate = threading.Event()

    def slow(payload, ctx):
        most_held.append(len(ledger.held()))
        gate.wait(CLAIM_AHEAD_MAX_RUN_SECONDS / 5)  # five a batch: each batch outlasts the bound

    registry = HandlerRegistry()
    registry.register("quick", slow, timeout_seconds=5)
    _enqueue(storage, 15)
    _loop(storage, registry, ledger, batch=5, settle_behind=False).run()
    assert storage.stats(QUEUE).succeeded == 15
    assert max(most_held) <= 5, "a batch of slow tasks was claimed ahead"


def test_a_batch_claimed_ahead_behind_a_task_turned_slow_is_released_for_other_workers(storage, monkeypatch):
    # Batch 1 runs quickly, so batch 3 is claimed ahead when batch 2 starts; batch 2's last task
    # then blocks. The tasks waiting ahead go back to PENDING (no attempt spent) within
    # CLAIM_AHEAD_HOLD_SECONDS, and the loop claims afresh once the slow task is done.
    # ("Quickly" however loaded the machine: batch 1 must count as quick.)
    monkeypatch.setattr(claiming, "CLAIM_AHEAD_MAX_RUN_SECONDS", 5.0)
    blocked = threading.Event()
    unblock = threading.Event()
    runs: Counter[str] = Counter()

    def quick(payload, ctx):
        runs[ctx.task_id] += 1
        if ctx.task_id == "t0009":
            blocked.set()
            unblock.wait(20)

    registry = HandlerRegistry()
    registry.register("quick", quick, timeout_seconds=30)
    _enqueue(storage, 15)
    ledger = _ledger(storage)
    loop = threading.Thread(target=_loop(storage, registry, ledger, batch=5, settle_behind=False).run)
    loop.start()
    try:
        assert blocked.wait(10), "the slow task never started"
        ahead = [f"t{i:04d}" for i in range(10, 15)]
        wait_until(lambda: all(storage.get(i).status is TaskStatus.IN_FLIGHT for i in ahead), timeout=10,
                   what="the batch claimed ahead")
        # Then, t0009 still running, the batch ahead goes back as it was.
        wait_until(lambda: storage.stats(QUEUE).pending == 5, timeout=10, what="the batch claimed ahead to be released")
        waiting = [storage.get(i) for i in ahead]
        assert all(t.status is TaskStatus.PENDING and t.attempt_count == 0 and not t.attempts for t in waiting)
        assert storage.get("t0009").status is TaskStatus.IN_FLIGHT and not set(ahead) & {ref.task_id for ref in ledger.held()}
    finally:
        unblock.set()
        loop.join(20)
    assert not loop.is_alive()
    assert storage.stats(QUEUE).succeeded == 15 and set(runs.values()) == {1} and len(runs) == 15
    assert not ledger.held()


@pytest.mark.parametrize("first_round_queues", [[QUEUE], [QUEUE, "other"]])
def test_stopping_at_once_releases_the_batch_claimed_ahead_and_never_runs_it(storage, first_round_queues, monkeypatch):
    # A second Ctrl-C: the host sets its stop flag and calls settle_and_release_now from another
    # thread, then exits. Here the loop goes on instead, so a batch released while waiting ahead
    # would show up run twice-held if the loop could still take it.
    # (The batch ahead must still be waiting when the stop comes, however loaded the machine.)
    monkeypatch.setattr(claiming, "CLAIM_AHEAD_HOLD_SECONDS", 60.0)
    stop = threading.Event()
    started: list[str] = []
    released: list[int] = []
    registry = HandlerRegistry()
    ledger = _ledger(storage)
    # The first round serves the queues given (with two, nothing is claimed ahead that round);
    # every later round serves one queue and claims ahead.
    rounds: list[int] = []

    def queues() -> list[str]:
        rounds.append(1)
        return first_round_queues if len(rounds) == 1 else [QUEUE]

    loop = _loop(storage, registry, ledger, batch=10, should_stop=stop.is_set, settle_behind=False, queues=queues)

    def quick(payload, ctx):
        started.append(ctx.task_id)
        if len(started) == 25:
            # This batch (10) and the next one, once its claim ahead has come back (10), held.
            wait_until(lambda: len(ledger.held()) == 20, timeout=10, what="the batch claimed ahead")
            stop.set()
            done = threading.Thread(target=lambda: released.append(loop.runner.settle_and_release_now()))
            done.start()
            done.join()

    registry.register("quick", quick, timeout_seconds=5)
    _enqueue(storage, 100)
    loop.run()
    stats = storage.stats(QUEUE)
    assert stats.in_flight == 0 and stats.succeeded == len(started) == 25 and stats.pending == 75
    # The rest of the running batch (5) and the batch waiting ahead (10) were released at once.
    assert released == [15]
    unstarted = [storage.get(f"t{i:04d}") for i in range(100) if f"t{i:04d}" not in started]
    assert all(t.status is TaskStatus.PENDING and t.attempt_count == 0 and not t.attempts for t in unstarted)


def test_a_loop_claiming_one_task_at_a_time_never_claims_ahead(storage):
    # --batch 1 asks for one task held at a time: a process that dies then costs that one task.
    assert _most_held_while_draining(storage, 30, batch=1) == 1
