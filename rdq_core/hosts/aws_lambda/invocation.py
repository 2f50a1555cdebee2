"""What an invocation may rely on, even on hosts that emulate Lambda loosely.

Two guards, each free on AWS:

* ``ModulePin``: the modules a function's entry point loaded stay the ones its later, lazy
  imports see. Some emulators (LocalStack's legacy local executor) remove from ``sys.modules``
  every module a handler's import brought in, right after importing it; a lazy import during the
  invocation (the ``RDQ_HANDLERS`` modules, the storage driver) would then load a second
  ``rdq_core`` whose handler registry is empty and whose exception classes are not the ones the
  running code catches. Restoring the entry point's modules before those imports keeps one copy.
* ``InvocationClock``: the invocation's end, from ``context.get_remaining_time_in_millis()``,
  never trusted beyond the function's configured timeout, and abandoned for "configured timeout
  from the start" when a later reading does not fall although time passed (the same emulator
  always answers 60000).
"""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType
from typing import Any, Callable

#: Readings closer together than this may legitimately be equal (milliseconds are whole).
_MIN_ELAPSED_FOR_A_VERDICT = 0.002


class ModulePin:
    """A snapshot of ``sys.modules`` taken when an entry point finished importing."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._modules: dict[str, ModuleType] = dict(sys.modules)
        self._own = self._modules.get(owner)

    def restore(self) -> int:
        """Put back what was removed since the snapshot; for ``rdq_core`` itself, also undo a
        second copy. Returns how many entries changed (0 on an ordinary host)."""
        if self._own is not None and sys.modules.get(self._owner) is self._own:
            return 0
        changed = 0
        for name, module in self._modules.items():
            current = sys.modules.get(name)
            if current is module:
                continue
            if current is None or name == "rdq_core" or name.startswith("rdq_core."):
                sys.modules[name] = module
                changed += 1
        # An rdq_core submodule loaded since, under a second copy of its package, would still be
        # found by the next import: drop it, so that import loads it again under ours.
        for name in [n for n in sys.modules if n.startswith("rdq_core.") and n not in self._modules]:
            parent, _, leaf = name.rpartition(".")
            if getattr(sys.modules.get(parent), leaf, None) is not sys.modules[name]:
                del sys.modules[name]
                changed += 1
        return changed


def configured_timeout(configured: float = 0.0) -> float:
    """The function's timeout in seconds when known: the template's setting, else what some
    hosts export (``AWS_LAMBDA_FUNCTION_TIMEOUT``: LocalStack, ``sam local``); 0 if unknown."""
    if configured > 0:
        return configured
    try:
        return max(float(os.environ.get("AWS_LAMBDA_FUNCTION_TIMEOUT", "") or 0), 0.0)
    except ValueError:
        return 0.0


class InvocationClock:
    """The invocation's end on this process's clock (``clock``, monotonic seconds)."""

    def __init__(self, context: Any, timeout_seconds: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._context = context
        self._clock = clock
        self.started = clock()
        self._first_ms = float(context.get_remaining_time_in_millis())
        self._first_at = self.started
        #: The function timeout: configured, else the first reading rounded up (Lambda timeouts
        #: are whole seconds, so that recovers it at the start of an invocation).
        self.timeout_seconds = timeout_seconds or float(-(-self._first_ms // 1000))
        # A remaining time beyond the function's timeout cannot be true.
        self._end = self.started + min(self._first_ms / 1000.0, self.timeout_seconds)
        self.trusted = True

    @property
    def end(self) -> float:
        return self._end

    def check(self) -> float:
        """Read the remaining time again; if it did not fall while time passed, the context's clock
        is not real: the end becomes the configured timeout measured from the start. Returns the end."""
        if not self.trusted:
            return self._end
        now = self._clock()
        reading = float(self._context.get_remaining_time_in_millis())
        if now - self._first_at >= _MIN_ELAPSED_FOR_A_VERDICT and reading >= self._first_ms:
            self.trusted = False
            self._end = self.started + self.timeout_seconds
        return self._end

    def remaining(self) -> float:
        return max(self._end - self._clock(), 0.0)
