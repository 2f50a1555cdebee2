"""How many of a worker fleet's slots the store counts as held, sampled on a thread of its own
(with its own store connection, so the sampling never slows what it watches): the LocalStack
fleet test and the Lambda chaos run read the most held at once."""

from __future__ import annotations

import threading
import time
from typing import Any

from rdq_core import open_storage


class SlotWatch:
    """Samples, every ``every`` seconds on its own thread and store connection, how many of the
    fleet's slots the store counts as held (pending starts, and the slots of dead holders until
    their leases end, included). A slot held for less than a sample's period may be missed."""

    def __init__(self, store_url: str, fleet: str, every: float = 0.05) -> None:
        self._store_url, self._fleet, self._every = store_url, fleet, every
        self._samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slot-watch", daemon=True)

    def __enter__(self) -> "SlotWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        storage = open_storage(self._store_url)
        try:
            while not self._stop.is_set():
                held = storage.worker_slots_held(self._fleet)
                self._samples.append((time.monotonic(), held))
                self._stop.wait(self._every)
        except BaseException as exc:  # noqa: BLE001 - reported by peak(), on the test's thread
            self._failure = exc
        finally:
            storage.close()

    def peak(self, since: float = 0.0) -> int:
        """The most slots seen held at once since ``since`` (``time.monotonic()``)."""
        if self._failure is not None:
            raise AssertionError(f"the slot watch failed: {self._failure!r}") from self._failure
        seen = [held for at, held in list(self._samples) if at >= since]
        assert seen, "the slot watch took no sample"
        return max(seen)
