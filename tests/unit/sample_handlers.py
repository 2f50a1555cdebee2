"""Handlers used by the CLI and worker tests (imported by name, like RDQ_HANDLERS)."""

import time
from pathlib import Path

from rdq_core import PermanentError, handler


@handler("sample.ok")
def ok(payload, ctx):
    return {"echo": payload, "attempt": ctx.attempt}


@handler("sample.fatal")
def fatal(payload, ctx):
    raise PermanentError("refusing on purpose")


@handler("sample.hold")
def hold(payload, ctx):
    """Runs until the file its payload names exists (or 30 s): a task a test can see running."""
    release = Path(payload["until"])
    deadline = time.monotonic() + 30
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"held": True}
