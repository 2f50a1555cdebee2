"""Waking an idle ``rdq worker`` when a task is enqueued, instead of waiting out its poll interval.

A store that can push (PostgreSQL LISTEN/NOTIFY, Redis pub/sub) offers an ``EnqueueListener``
(``Storage.enqueue_listener``); one thread per worker holds it and bumps a generation counter
whenever an enqueue into a served queue commits. A claim loop notes the generation *before* its
claim and, when the claim found nothing, waits until the generation moves (or its poll interval
runs out, or the worker stops): an enqueue that commits while the claim runs is not missed.

The wake-up is best-effort. Polling stays: a lost notification, a listener that cannot connect
(it reconnects with backoff, and wakes the loops once after each reconnect, so an enqueue made
during the gap is picked up at once) or a store that cannot push all fall back to the poll.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

from .outage import ReconnectBackoff
from ..storage.spi import Storage

log = logging.getLogger("rdq.wakeup")

#: The longest one ``receive`` blocks: how soon the listening thread notices the worker stopped.
LISTEN_SLICE_SECONDS = 0.5


class StopEvent(threading.Event):
    """A ``threading.Event`` that also wakes whoever waits on a ``WakeSignal`` when set."""

    def __init__(self) -> None:
        super().__init__()
        self.on_set: Callable[[], None] = lambda: None

    def set(self) -> None:
        super().set()
        self.on_set()


class WakeSignal:
    """Tells idle claim loops that a task was enqueued into one of ``queues`` (empty: any)."""

    def __init__(self, storage: Storage, queues: Sequence[str], stop: StopEvent) -> None:
        self.storage = storage
        self.queues = frozenset(queues)
        self.stop = stop
        self._cond = threading.Condition()
        self._generation = 0
        self._thread: threading.Thread | None = None
        #: Whether a listener is connected now (tests and logs read it).
        self.listening = threading.Event()
        stop.on_set = self.notify

    def mark(self) -> int:
        """The generation to pass to ``wait`` after a claim that started now finds nothing."""
        return self._generation

    def notify(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, mark: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for an enqueue since ``mark`` (or the stop); whether one came."""
        with self._cond:
            return self._cond.wait_for(lambda: self._generation != mark or self.stop.is_set(), timeout)

    def start(self) -> None:
        """Start listening, if the store can push; otherwise the loops simply poll."""
        self._thread = threading.Thread(target=self._listen, name="rdq-wakeup", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        backoff = ReconnectBackoff()
        failing = False
        while not self.stop.is_set():
            try:
                listener = self.storage.enqueue_listener(sorted(self.queues))
                if listener is None:  # this store (or its URL, e.g. behind a pooler) cannot push
                    return
                try:
                    self.listening.set()
                    if failing:
                        log.info("enqueue listener connected again")
                        failing = False
                    backoff.reset()
                    self.notify()  # an enqueue made while no listener was connected
                    while not self.stop.is_set():
                        woken = listener.receive(LISTEN_SLICE_SECONDS)
                        if woken and (not self.queues or not self.queues.isdisjoint(woken)):
                            self.notify()
                finally:
                    self.listening.clear()
                    listener.close()
            except Exception as exc:  # noqa: BLE001 - never fatal: the loops keep polling meanwhile
                if self.stop.is_set():
                    return
                if not failing:
                    log.warning("enqueue listener lost (%s); polling meanwhile, reconnecting", exc)
                    failing = True
                self.stop.wait(backoff.next())
