"""Riding out a storage outage: one log line when it starts, one when it ends, and a backoff
between reconnect attempts. Shared by the long-running worker and the long-running reaper."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class StorageHealth:
    """Whether the store answered last time, shared by every loop of one host (claim loop and
    heartbeat, or reaper passes), so one outage is one ERROR line (plus one INFO line when it
    ends) on the host's own logger, not one line per retry."""

    def __init__(self, log: logging.Logger, *, clock: Callable[[], float] = time.monotonic) -> None:
        #: The host's logger: its outage lines, and its claim loop's unexpected errors.
        self.log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self.failures_in_outage = 0
        #: Outages seen since start (for operators and tests).
        self.outages = 0
        #: Set once a call has reached the store: a host's side loops may wait for it so that
        #: its first claim has the process to itself (``rdq worker``'s start-up).
        self.answered = threading.Event()

    def failed(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.failures_in_outage += 1
            if self._down_since is not None:
                self.log.debug("%s: storage still unavailable (%s)", where, exc)
                return
            self._down_since = self._clock()
            self.outages += 1
        self.log.error("storage unavailable (%s, seen by %s); backing off and reconnecting", exc, where)

    def ok(self) -> None:
        if self._down_since is None:  # the common case: no lock, no log
            if not self.answered.is_set():
                self.answered.set()
            return
        with self._lock:
            if self._down_since is None:
                return
            down_for = self._clock() - self._down_since
            failures, self._down_since, self.failures_in_outage = self.failures_in_outage, None, 0
        self.answered.set()
        self.log.info("storage reachable again after %.1fs (%d failed call(s) meanwhile)", down_for, failures)


class ReconnectBackoff:
    """0.5 s doubling to ``max_seconds``, so an outage is neither hammered nor ignored."""

    FIRST_DELAY = 0.5

    def __init__(self, max_seconds: float = 30.0) -> None:
        self.max_seconds = max_seconds
        self.delay = self.FIRST_DELAY

    def reset(self) -> None:
        self.delay = self.FIRST_DELAY

    def next(self) -> float:
        current = self.delay
        self.delay = min(self.delay * 2, self.max_seconds)
        return current
