"""Handlers the trace-context tests enqueue: they report the trace context they ran under."""

from __future__ import annotations

import sys
from typing import Any

from rdq_core import handler

#: (task id, attempt, ctx.traceparent, the current OpenTelemetry span's traceparent or None), per run.
RUNS: list[tuple[str, int, str | None, str | None]] = []
#: Set by a test: the Client a handler enqueues a child task with.
CHILD_CLIENT: list[Any] = []


def _current_span() -> str | None:
    trace_api = sys.modules.get("opentelemetry.trace")
    if trace_api is None:
        return None
    context = trace_api.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@handler("trace-probe", timeout_seconds=2)
def trace_probe(payload: Any, ctx: Any) -> dict[str, Any]:
    RUNS.append((ctx.task_id, ctx.attempt, ctx.traceparent, _current_span()))
    if payload and payload.get("child") and CHILD_CLIENT:
        CHILD_CLIENT[0].enqueue(ctx.queue, "trace-probe", id=f"{ctx.task_id}-child")
    return {"traceparent": ctx.traceparent}


@handler("trace-flaky", timeout_seconds=2)
def trace_flaky(payload: Any, ctx: Any) -> dict[str, Any]:
    """Fails until its ``succeed_on`` attempt."""
    RUNS.append((ctx.task_id, ctx.attempt, ctx.traceparent, _current_span()))
    if ctx.attempt < payload["succeed_on"]:
        raise RuntimeError(f"attempt {ctx.attempt} fails on purpose")
    return {"attempt": ctx.attempt}
