"""Handlers the HandlerConcurrency tests enqueue: each records when it ran, on the real clock."""

from __future__ import annotations

import asyncio
import threading
import time

from rdq_core import handler

#: (task id, thread name, start, end) of every finished run, in monotonic seconds.
RUNS: list[tuple[str, str, float, float]] = []
_LOCK = threading.Lock()


def _record(task_id: str, began: float) -> None:
    with _LOCK:
        RUNS.append((task_id, threading.current_thread().name, began, time.monotonic()))


@handler("naps", timeout_seconds=2)
def naps(payload, ctx):
    began = time.monotonic()
    time.sleep(0.3)
    _record(ctx.task_id, began)
    return {"slept": 0.3}


@handler("naps-async", timeout_seconds=2)
async def naps_async(payload, ctx):
    began = time.monotonic()
    await asyncio.sleep(0.3)
    _record(ctx.task_id, began)
    return {"slept": 0.3, "remaining_below": ctx.remaining_seconds() <= 2}


@handler("async-past-its-timeout", timeout_seconds=0.5)
async def async_past_its_timeout(payload, ctx):
    await asyncio.sleep(5)
    return {"late": True}
