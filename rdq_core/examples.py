"""Example handlers for ``rdq dev``: enqueue these to watch succeed, retry, dead-letter and redrive.

```
greet                {"name": "Ada"}            succeeds at once with a greeting
flaky                {"failures": 2}            fails its first N attempts (retried with backoff), then succeeds
reject               {"reason": "bad address"}  raises PermanentError: dead-lettered at once, no retries
fail_until_redrive   {}                         fails every attempt until the task is redriven, then succeeds
sleep                {"seconds": 2}             sleeps (at most 25 s), then succeeds
```
"""

from __future__ import annotations

import time
from typing import Any

from .errors import PermanentError
from .engine.handlers import TaskContext, handler


def _field(payload: Any, name: str, default: Any) -> Any:
    return payload.get(name, default) if isinstance(payload, dict) else default


@handler("greet")
def greet(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    return {"greeting": f"hello, {_field(payload, 'name', 'world')}", "attempt": ctx.attempt}


@handler("flaky")
def flaky(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    failures = int(_field(payload, "failures", 2))
    if ctx.attempt <= failures:
        raise ConnectionError(f"simulated outage on attempt {ctx.attempt} (fails {failures} times)")
    return {"succeeded_on_attempt": ctx.attempt}


@handler("reject")
def reject(payload: Any, ctx: TaskContext) -> None:
    raise PermanentError(str(_field(payload, "reason", "rejected on purpose")))


@handler("fail_until_redrive")
def fail_until_redrive(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    if ctx.redrive_count == 0:
        raise RuntimeError(f"downstream still broken (attempt {ctx.attempt}); redrive me once it is fixed")
    return {"fixed_after_redrives": ctx.redrive_count}


# 25 s of sleep plus headroom: fits the 30 s dev worker (and any worker timeout over 28 s).
@handler("sleep", timeout_seconds=26)
def sleep(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    seconds = min(float(_field(payload, "seconds", 1.0)), 25.0, ctx.remaining_seconds())
    time.sleep(max(seconds, 0.0))
    return {"slept_seconds": seconds}
