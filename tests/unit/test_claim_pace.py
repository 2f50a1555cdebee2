"""Claims sized to the time left (``claiming.ClaimPace``) and claim loops on several threads
(``claiming.run_concurrently``), on SQLite with a fake clock where time is what the handlers take."""

from __future__ import annotations

import threading
import time

import pytest

from rdq_core.engine.claiming import ClaimLoop, ClaimPace, per_thread_batch, run_concurrently
from rdq_core.client import Client
from rdq_core.engine.handlers import DEFAULT_TIMEOUT_SECONDS, HandlerRegistry
from rdq_core.engine.runner import BatchRunner


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def test_the_claim_takes_what_can_start_in_the_window_measured_by_the_loops_own_tasks():
    pace = ClaimPace(shortest=10, planned=10, margin=1)
    # The case: a 20 s function, 2 s settle reserve, 10 s handler timeouts.
    assert pace.claim_size(50, 18) == 1, "nothing measured yet: one task, to measure"
    pace.record(1, 0.25)
    assert pace.claim_size(20, 17.9) == 20  # 6.9 s of window at 0.25 s a task: 28, bounded by the batch
    assert pace.claim_size(20, 12.5) == 7  # 1.5 s of window: 6 more starts after the first
    assert pace.claim_size(20, 10.9) == 0, "no 10 s handler can start with 10.9 s left"
    pace.record(2, 9.75)  # slower tasks lower the estimate: (0.25 + 9.75) / 3 s a task
    assert pace.claim_size(50, 17.9) == 3


def test_only_a_quicker_handler_can_start_once_the_planned_window_has_closed():
    pace = ClaimPace(shortest=2, planned=10, margin=1)
    pace.record(5, 1.0)
    assert pace.claim_size(50, 10.5) == 1
    assert pace.claim_size(50, 2.9) == 0


def test_the_plan_uses_the_registered_timeouts_that_fit_the_host():
    registry = HandlerRegistry()
    for name, timeout in (("two", 2), ("twelve", 12), ("ninety", 90)):
        registry.register(name, lambda payload, ctx: None, timeout_seconds=timeout)
    runner = BatchRunner(None, registry=registry, longest_run_seconds=58)  # type: ignore[arg-type]
    pace = ClaimPace.for_runner(runner)
    assert (pace.shortest, pace.planned, pace.margin) == (2, 12, 1.0), "90 s never fits: dead-lettered, not planned"
    nothing = ClaimPace.for_runner(BatchRunner(None, registry=HandlerRegistry()))  # type: ignore[arg-type]
    assert nothing.shortest == nothing.planned == DEFAULT_TIMEOUT_SECONDS


@pytest.mark.parametrize("threads, expected", [(1, 10), (3, 4), (4, 3), (10, 1), (64, 1)])
def test_each_loop_claims_its_share_of_the_batch(threads, expected):
    assert per_thread_batch(10, threads) == expected


def _twenty_second_function(storage, clock: FakeClock, *, fit: bool) -> tuple[int, int, int]:
    """One invocation of a 20 s function (deadline 18 s away: 2 s settle reserve) over 200 tasks
    whose handler has the default 10 s timeout and takes 0.1 s. Returns (claimed, started, released)."""
    registry = HandlerRegistry()
    registry.register("tenth", lambda payload, ctx: clock.advance(0.1), timeout_seconds=10)
    runner = BatchRunner(storage, registry=registry, longest_run_seconds=18, clock=clock)
    loop = ClaimLoop(storage, runner, queues=lambda: ["short"], batch_size=50, lease_seconds=lambda: 60,
                     deadline=clock.now + 18, clock=clock, fit_to_deadline=fit)
    report = loop.run()
    return report.claimed, report.started, report.released


def test_a_short_function_claims_what_it_can_start_instead_of_releasing_it(storage):
    Client(storage).enqueue_many("short", [{"handler": "tenth"} for _ in range(200)])
    claimed, started, released = _twenty_second_function(storage, FakeClock(), fit=False)
    # Claimed a batch at a time: what could no longer start (under 11 s left) went back, plus a
    # whole batch claimed only to be released.
    assert started == 70 and released >= 50, (claimed, started, released)

    claimed, started, released = _twenty_second_function(storage, FakeClock(), fit=True)
    assert started >= 70 and released <= 1 and claimed == started + released, (claimed, started, released)
    stats = storage.stats("short")
    assert stats.in_flight == 0


def test_run_concurrently_runs_handlers_at_once_and_merges_the_reports(storage):
    Client(storage).enqueue_many("many", [{"handler": "nap"} for _ in range(8)])
    registry = HandlerRegistry()
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def nap(payload, ctx):
        began = time.monotonic()
        time.sleep(0.2)
        with lock:
            spans.append((began, time.monotonic()))

    registry.register("nap", nap, timeout_seconds=5)
    runner = BatchRunner(storage, registry=registry)
    loop = ClaimLoop(storage, runner, queues=lambda: ["many"], batch_size=1, lease_seconds=lambda: 30)
    report = run_concurrently(loop, 4)
    assert (report.claimed, report.started, report.outcomes) == (8, 8, {"SUCCESS": 8})
    # At some instant four handlers ran at once.
    assert max(sum(1 for b, e in spans if b <= at < e) for at, _ in spans) == 4


def test_a_loop_that_fails_stops_its_siblings_and_the_error_is_raised(storage):
    Client(storage).enqueue_many("many", [{"handler": "nap"} for _ in range(50)])
    registry = HandlerRegistry()
    registry.register("nap", lambda payload, ctx: time.sleep(0.01), timeout_seconds=5)
    calls = {"n": 0}

    class Failing:
        def __getattr__(self, name):
            return getattr(storage, name)

        def claim(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("claim failed")
            return storage.claim(*args, **kwargs)

    store = Failing()
    loop = ClaimLoop(store, BatchRunner(store, registry=registry), queues=lambda: ["many"], batch_size=2,
                     lease_seconds=lambda: 30)
    with pytest.raises(RuntimeError, match="claim failed"):
        run_concurrently(loop, 3)
    stats = storage.stats("many")
    assert stats.in_flight == 0 and stats.pending > 0, "the siblings stopped and released what they held"
