"""Waiting on a condition with a deadline, and insisting on an optional value: what the servers,
the chaos drivers and the kit's tests all need."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def present(value: T | None, what: str) -> T:
    """``value``, or a test failure naming ``what`` when it is None (an optional field expected set)."""
    if value is None:
        raise AssertionError(f"expected {what}, found None")
    return value


def wait_until(condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``condition`` until it returns something truthy; fail loudly at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
