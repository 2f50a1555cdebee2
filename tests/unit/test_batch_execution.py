"""The long-running worker's batch job: one helper-thread handoff per batch, and the watchdog
that abandons an overrunning handler and goes on with the rest of the batch (on SQLite)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from rdq_core.engine import execution
from rdq_core.compliance.runner_paths import enqueue_in_order
from rdq_core.compliance.support import must_get, wait_until
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Outcome, TaskStatus
from rdq_core.engine.runner import BatchRunner
from rdq_core.hosts.process.worker import HeartbeatLedger

LEASE = 30.0


@pytest.fixture
def submits(monkeypatch) -> Counter[str]:
    """Jobs handed to helper threads, by the thread that handed them over."""
    counts: Counter[str] = Counter()
    submit = execution._HandlerThread.submit

    def counting(self, job):
        counts[threading.current_thread().name] += 1
        submit(self, job)

    monkeypatch.setattr(execution._HandlerThread, "submit", counting)
    return counts


class Handlers:
    """Handlers that note the thread they ran on; ``hang`` ones wait for their own release."""

    def __init__(self) -> None:
        self.registry = HandlerRegistry()
        self.threads: dict[str, str] = {}
        self.calls: Counter[str] = Counter()
        self.release: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.registry.register("quick", self._quick, timeout_seconds=30)

    def _note(self, ctx) -> None:
        self.threads[ctx.task_id] = threading.current_thread().name + str(threading.get_ident())
        self.calls[ctx.task_id] += 1

    def _quick(self, payload, ctx):
        self._note(ctx)
        return "ok"

    def hang(self, name: str, *, then=None) -> str:
        """Register handler ``name``: times out after 0.3 s, returns "late" once released."""
        self.release[name] = threading.Event()
        self.entered[name] = threading.Event()

        def handler(payload, ctx):
            self._note(ctx)
            self.entered[name].set()
            if then is not None:
                then()
            return self.release[name].wait(20) and "late"

        self.registry.register(name, handler, timeout_seconds=0.3)
        return name


def run_batch(storage, handlers: Handlers, queue: str, n: int, *, should_stop=lambda: False):
    runner = BatchRunner(storage, registry=handlers.registry, lease_seconds=LEASE, abandon_overdue_handlers=True)
    ledger = HeartbeatLedger(storage, LEASE)
    claimed = storage.claim(queue, n, LEASE)
    assert len(claimed) == n
    began = time.monotonic()
    report = runner.run(claimed, ledger=ledger, should_stop=should_stop)
    return runner, ledger, report, time.monotonic() - began


def attempts(storage, task_id: str) -> list[tuple[int, Outcome]]:
    return [(a.attempt_no, a.outcome) for a in must_get(storage, task_id).attempts]


def test_a_batch_of_quick_handlers_is_one_job_on_one_helper_thread(storage, submits):
    handlers = Handlers()
    ids = enqueue_in_order(storage, "quick", ["quick"] * 20)
    runner, ledger, report, _ = run_batch(storage, handlers, "quick", 20)
    assert (report.started, report.abandoned, report.outcomes) == (20, 0, {"SUCCESS": 20})
    assert sum(submits.values()) == 1  # one handoff for the whole batch
    assert len(set(handlers.threads.values())) == 1
    assert threading.current_thread().name + str(threading.get_ident()) not in handlers.threads.values()
    assert [must_get(storage, i).status for i in ids] == [TaskStatus.SUCCEEDED] * 20
    assert ledger.held() == [] and runner.running() == {} and runner.overruns() == []
    runner.close()


def test_an_overrun_mid_batch_leaves_the_rest_to_a_fresh_helper_and_settles_its_outcome_once(storage, submits):
    handlers = Handlers()
    hang = handlers.hang("hang")
    ids = enqueue_in_order(storage, "mid", ["quick", "quick", hang, "quick", "quick"])
    before, stuck, after = ids[:2], ids[2], ids[3:]
    runner, ledger, report, took = run_batch(storage, handlers, "mid", 5)
    # The quick handlers' 30 s timeout armed the watchdog first: the 0.3 s one still woke it.
    assert took < 10
    assert (report.started, report.abandoned, report.outcomes) == (5, 1, {"SUCCESS": 4})
    assert sum(submits.values()) == 2
    assert {handlers.threads[i] for i in before} == {handlers.threads[stuck]}
    assert {handlers.threads[i] for i in after} != {handlers.threads[stuck]} and len({handlers.threads[i] for i in after}) == 1
    assert [must_get(storage, i).status for i in before + after] == [TaskStatus.SUCCEEDED] * 4
    # Still running and still held: renewed by the heartbeat, reported to the host.
    assert must_get(storage, stuck).status is TaskStatus.IN_FLIGHT
    assert [r.task_id for r in ledger.held()] == [stuck]
    assert [o.task_id for o in runner.overruns()] == [stuck] and runner.running() == {stuck: hang}
    handlers.release[hang].set()
    wait_until(lambda: must_get(storage, stuck).status is TaskStatus.SUCCEEDED, timeout=10, what="the late outcome")
    wait_until(lambda: runner.running() == {}, timeout=10, what="the stuck job to clean up")
    assert attempts(storage, stuck) == [(1, Outcome.SUCCESS)] and must_get(storage, stuck).result == "late"
    assert runner.overruns() == [] and ledger.held() == []
    assert set(handlers.calls.values()) == {1}  # every handler ran exactly once
    runner.close()


def test_two_overruns_in_one_batch(storage, submits):
    handlers = Handlers()
    first, second = handlers.hang("hang-1"), handlers.hang("hang-2")
    ids = enqueue_in_order(storage, "two", [first, "quick", second, "quick"])
    runner, ledger, report, _ = run_batch(storage, handlers, "two", 4)
    assert (report.started, report.abandoned, report.outcomes) == (4, 2, {"SUCCESS": 2})
    assert sum(submits.values()) == 3 and len(set(handlers.threads.values())) == 3
    assert sorted(o.task_id for o in runner.overruns()) == sorted([ids[0], ids[2]])
    assert [must_get(storage, i).status for i in (ids[1], ids[3])] == [TaskStatus.SUCCEEDED] * 2
    handlers.release[second].set()  # the later one returns first
    wait_until(lambda: must_get(storage, ids[2]).status is TaskStatus.SUCCEEDED, timeout=10, what="the second")
    assert must_get(storage, ids[0]).status is TaskStatus.IN_FLIGHT
    assert [o.task_id for o in runner.overruns()] == [ids[0]]
    handlers.release[first].set()
    wait_until(lambda: must_get(storage, ids[0]).status is TaskStatus.SUCCEEDED, timeout=10, what="the first")
    wait_until(lambda: runner.running() == {}, timeout=10, what="both stuck jobs to clean up")
    assert attempts(storage, ids[0]) == attempts(storage, ids[2]) == [(1, Outcome.SUCCESS)]
    assert ledger.held() == [] and set(handlers.calls.values()) == {1}
    runner.close()


def test_a_stop_requested_while_a_handler_overruns_releases_the_rest(storage, submits):
    handlers = Handlers()
    stop = threading.Event()
    hang = handlers.hang("hang", then=stop.set)
    ids = enqueue_in_order(storage, "stop", [hang, "quick", "quick"])
    runner, ledger, report, _ = run_batch(storage, handlers, "stop", 3, should_stop=stop.is_set)
    assert (report.started, report.abandoned, report.released) == (1, 1, 2)
    assert [must_get(storage, i).status for i in ids[1:]] == [TaskStatus.PENDING] * 2
    assert [r.task_id for r in ledger.held()] == [ids[0]]
    handlers.release[hang].set()
    wait_until(lambda: must_get(storage, ids[0]).status is TaskStatus.SUCCEEDED, timeout=10, what="the late outcome")
    wait_until(lambda: runner.running() == {}, timeout=10, what="the stuck job to clean up")
    assert ledger.held() == [] and runner.overruns() == [] and set(handlers.calls) == {ids[0]}
    runner.close()


def test_a_handler_raising_keyboard_interrupt_on_the_helper_is_a_failed_attempt(storage, submits):
    handlers = Handlers()

    def interrupt(payload, ctx):
        raise KeyboardInterrupt

    handlers.registry.register("interrupt", interrupt)
    ids = enqueue_in_order(storage, "kbd", ["interrupt", "quick"])
    runner, ledger, report, _ = run_batch(storage, handlers, "kbd", 2)
    assert (report.started, report.abandoned) == (2, 0) and sum(submits.values()) == 1
    assert must_get(storage, ids[0]).attempts[0].outcome is not Outcome.SUCCESS
    assert must_get(storage, ids[1]).status is TaskStatus.SUCCEEDED
    assert ledger.held() == [] and runner.running() == {}
    runner.close()


def test_an_engine_error_on_the_helper_is_raised_on_the_calling_thread(storage, submits, monkeypatch):
    handlers = Handlers()
    ids = enqueue_in_order(storage, "engine", ["quick", "quick", "quick"])
    get = handlers.registry.get
    seen: list[str] = []

    def failing_get(name):
        seen.append(name)
        if len(seen) == 2:
            raise RuntimeError("engine bug")
        return get(name)

    monkeypatch.setattr(handlers.registry, "get", failing_get)
    with pytest.raises(RuntimeError, match="engine bug"):
        run_batch(storage, handlers, "engine", 3)
    # What ran is settled, what never started is released (as when it ran on this thread).
    assert must_get(storage, ids[0]).status is TaskStatus.SUCCEEDED
    assert must_get(storage, ids[2]).status is TaskStatus.PENDING
