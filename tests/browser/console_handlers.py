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
