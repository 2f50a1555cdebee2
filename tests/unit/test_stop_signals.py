"""Stop signals run their action off the main thread (rdq_core/hosts/signals.py)."""

import signal
import threading

from rdq_core.hosts.signals import STOP_SIGNALS, StopSignals, stop_on_signals
from rdq_testing.conditions import wait_until


def _restoring_handlers(test):
    def run() -> None:
        saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        try:
            test()
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    run.__name__ = test.__name__
    return run


@_restoring_handlers
def test_a_signal_that_lands_while_the_main_thread_holds_the_lock_its_action_needs_still_acts():
    # rdq worker's main thread reads the runner's record of running handlers under a plain Lock
    # ten times a second, and the first SIGTERM's action reads the same record: run inline, the
    # action would wait for a lock its own thread holds, and the worker would never stop.
    record = threading.Lock()
    acted: list[int] = []
    signals = StopSignals()

    def on_signal(count: int) -> None:
        with record:
            acted.append(count)

    signals.install(on_signal)
    with record:
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, on this thread, lock held
        assert signals.count == 1 and acted == []
    wait_until(lambda: acted == [1], timeout=10, what="the action to run once the lock is free")
    signal.raise_signal(signal.SIGINT)
    wait_until(lambda: acted == [1, 2], timeout=10, what="the second signal's action, counted as the second")


@_restoring_handlers
def test_stop_on_signals_stops_through_an_event_the_main_thread_is_waiting_on():
    stop = threading.Event()
    stop_on_signals(stop.set)
    # Sent to the main thread while it waits on the event (as a SIGTERM from outside lands).
    threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM)).start()
    assert stop.wait(10), "SIGTERM did not set the stop event"


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    outcome: list[StopSignals] = []
    thread = threading.Thread(target=lambda: outcome.append(stop_on_signals(lambda: None)))
    thread.start()
    thread.join(10)
    assert outcome and signal.getsignal(signal.SIGTERM) is before
