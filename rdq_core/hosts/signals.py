"""Stop signals (SIGTERM, SIGINT) for every long-running host: ``rdq worker``, ``rdq reaper``,
``rdq dev`` and ``rdq console``.

A Python signal handler runs on the main thread between two bytecodes, possibly while that
thread holds a lock that is not reentrant: an ``Event``'s condition, or the runner's record of
running handlers, which ``rdq worker``'s main thread reads ten times a second. A handler that
takes such a lock there waits for itself, and the process never stops. So the handler here only
counts; what a signal does runs on a thread of its own, which waits for the lock like any other.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class StopSignals:
    """Counts SIGTERM/SIGINT and calls ``on_signal(n)`` for the n-th, each on a new daemon
    thread: the second signal's call may run while the first's still does."""

    def __init__(self) -> None:
        self.count = 0

    def install(self, on_signal: Callable[[int], object]) -> None:
        """Install the handlers; only the main thread may (Python's rule): elsewhere this does
        nothing and the host stops by other means (a test calling its stop function)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handle(signum: int, _frame: Any) -> None:
            self.count += 1
            threading.Thread(target=on_signal, args=(self.count,), name=f"rdq-stop-signal-{self.count}",
                             daemon=True).start()

        for sig in STOP_SIGNALS:
            signal.signal(sig, handle)


def stop_on_signals(stop: Callable[[], object]) -> StopSignals:
    """Call ``stop()`` on every SIGTERM/SIGINT (off the main thread, as the module says)."""
    signals = StopSignals()
    signals.install(lambda _count: stop())
    return signals
