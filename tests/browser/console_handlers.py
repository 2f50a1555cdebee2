"""Handlers the browser tests' rdq dev runs (``--handlers tests.browser.console_handlers``)."""

from __future__ import annotations

from typing import Any

from rdq_core import handler


class PipelineBroken(Exception):
    """The failing handler's error: its full type name is what the DLQ filter matches."""


@handler("console.ok")
def ok(payload: Any, ctx: Any) -> dict[str, Any]:
    return {"echo": payload, "attempt": ctx.attempt}


@handler("console.fail")
def fail(payload: Any, ctx: Any) -> None:
    # The message carries markup on purpose: the console must show it as text.
    raise PipelineBroken(f"stage <b>two</b> failed on attempt {ctx.attempt}")


@handler("console.flaky")
def flaky(payload: Any, ctx: Any) -> dict[str, Any]:
    """Fails its first attempt, succeeds on the next: a success with an earlier error."""
    if ctx.attempt == 1:
        raise PipelineBroken("the upstream timed out on the first attempt")
    return {"attempt": ctx.attempt}


@handler("console.wait")
def wait_for_release(payload: Any, ctx: Any) -> dict[str, Any]:
    """Runs until the file ``payload["release"]`` exists (at most ``payload["seconds"]``): a task
    the tests can see IN_FLIGHT for as long as they need."""
    import os
    import time

    deadline = time.monotonic() + float(payload.get("seconds", 60))
    while not os.path.exists(payload["release"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"released": os.path.exists(payload["release"])}
