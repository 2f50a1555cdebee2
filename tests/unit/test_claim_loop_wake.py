"""The claim loop's idle waits with a wake-up: short re-checks right after work, then longer ones
up to the idle pause; a wake-up noted before a claim ends the wait that follows it."""

from __future__ import annotations

import threading
from typing import Any

from rdq_core.engine.claiming import RECHECK_AFTER_WORK_SECONDS, ClaimLoop
from rdq_core.compliance.support import wait_until
from rdq_core.flow import FlowPolicy
from rdq_core.engine.retry import PolicyBook
from rdq_core.engine.settling import BatchReport
from rdq_core.engine.wakeup import StopEvent, WakeSignal


class ScriptedStore:
    """Claims return the next count from ``script`` (then nothing), as placeholder tasks."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.claims = 0

    def claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> list[Any]:
        self.claims += 1
        return [object()] * (self.script.pop(0) if self.script else 0)


class CountingRunner:
    lease_seconds = 0.0
    policies = PolicyBook()

    def run(self, claimed: list[Any], **_: Any) -> BatchReport:
        return BatchReport(started=len(claimed))


class RecordingWake(WakeSignal):
    def __init__(self, stop: StopEvent, stop_after: int) -> None:
        super().__init__(None, [], stop)  # type: ignore[arg-type]  # never started: no store needed
        self.pauses: list[float] = []
        self.stop_after = stop_after

    def wait(self, mark: int, timeout: float) -> bool:
        self.pauses.append(timeout)
        if len(self.pauses) >= self.stop_after:
            self.stop.set()
        return False


def loop(store: ScriptedStore, wake: WakeSignal, stop: StopEvent, idle_pause: float) -> ClaimLoop:
    return ClaimLoop(store, CountingRunner(), queues=lambda: ["q"], batch_size=10,  # type: ignore[arg-type]
                     lease_seconds=lambda: 30.0, should_stop=stop.is_set, idle_pause=idle_pause, wake=wake)


def test_after_work_the_pauses_start_short_and_double_up_to_the_idle_pause() -> None:
    stop = StopEvent()
    wake = RecordingWake(stop, stop_after=9)
    loop(ScriptedStore([3]), wake, stop, idle_pause=1.0).run()
    first = RECHECK_AFTER_WORK_SECONDS
    assert wake.pauses == [min(1.0, first * 2 ** n) for n in range(9)]
    assert wake.pauses[-1] == 1.0


def test_a_loop_that_never_worked_waits_its_whole_idle_pause() -> None:
    stop = StopEvent()
    wake = RecordingWake(stop, stop_after=3)
    loop(ScriptedStore([]), wake, stop, idle_pause=1.0).run()
    assert wake.pauses == [1.0, 1.0, 1.0]


def test_a_wake_up_during_the_claim_ends_the_wait_after_it() -> None:
    stop = StopEvent()
    wake = WakeSignal(None, [], stop)  # type: ignore[arg-type]  # never started: no store needed
    store = ScriptedStore([])
    claim = store.claim

    def claim_then_enqueue(queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> list[Any]:
        found = claim(queue, limit, lease_seconds, flow)
        if store.claims == 1:
            wake.notify()  # an enqueue committed while the first claim ran
        if store.claims == 2:
            stop.set()
        return found

    store.claim = claim_then_enqueue  # type: ignore[method-assign]
    worker = threading.Thread(target=loop(store, wake, stop, idle_pause=30.0).run, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the wake-up noted during the claim did not end the 30 s pause"
    assert store.claims == 2


def test_stopping_ends_a_wait() -> None:
    stop = StopEvent()
    wake = WakeSignal(None, [], stop)  # type: ignore[arg-type]
    store = ScriptedStore([])
    worker = threading.Thread(target=loop(store, wake, stop, idle_pause=30.0).run, daemon=True)
    worker.start()
    wait_until(lambda: store.claims >= 1, timeout=5, what="the first claim")
    stop.set()
    worker.join(5)
    assert not worker.is_alive()
