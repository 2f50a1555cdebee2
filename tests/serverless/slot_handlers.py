"""Handlers for the worker-slot tests: one that counts how many run at once across invocations."""

from __future__ import annotations

import threading
import time
from typing import Any

from rdq_core.engine.handlers import handler

from . import sample_handlers  # noqa: F401 - the worker tests' handlers ("quick") are registered too

RUNNING = {"now": 0, "peak": 0}
_LOCK = threading.Lock()


@handler("held-for-a-while", timeout_seconds=2)
def held_for_a_while(payload: Any, ctx: Any) -> None:
    with _LOCK:
        RUNNING["now"] += 1
        RUNNING["peak"] = max(RUNNING["peak"], RUNNING["now"])
    try:
        time.sleep(float(payload or 0.2))
    finally:
        with _LOCK:
            RUNNING["now"] -= 1
