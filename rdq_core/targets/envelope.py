"""What a target receives: one JSON document per attempt, the same for HTTPS and Lambda.

::

    {"version": 1, "task_id": "...", "queue": "...", "handler": "notify", "attempt": 1,
     "redrive_count": 0, "payload": {...}, "headers": {...},
     "trace": {"traceparent": "00-...-01", "tracestate": null}, "timeout_seconds": 19.9}

``attempt`` is 1-based within the current retry budget (a redrive starts a new one and adds 1
to ``redrive_count``); ``headers`` are the producer's own (rdq's reserved ``rdq.*`` ones are
left out); ``timeout_seconds`` is the budget of this call. Everything here is data: no field is
ever used by the worker to choose where the request goes.
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.handlers import TaskContext

ENVELOPE_VERSION = 1


def envelope(handler: str, payload: Any, ctx: TaskContext, budget_seconds: float) -> dict[str, Any]:
    return {
        "version": ENVELOPE_VERSION,
        "task_id": ctx.task_id,
        "queue": ctx.queue,
        "handler": handler,
        "attempt": ctx.attempt,
        "redrive_count": ctx.redrive_count,
        "payload": payload,
        "headers": {key: value for key, value in ctx.headers.items() if not key.startswith("rdq.")},
        "trace": {"traceparent": ctx.traceparent, "tracestate": ctx.tracestate},
        "timeout_seconds": round(budget_seconds, 3),
    }


def envelope_bytes(handler: str, payload: Any, ctx: TaskContext, budget_seconds: float) -> bytes:
    # The payload was validated as JSON at enqueue; compact, UTF-8, exactly the bytes that are signed.
    return json.dumps(envelope(handler, payload, ctx, budget_seconds), separators=(",", ":"),
                      ensure_ascii=False).encode()


def idempotency_key(ctx: TaskContext) -> str:
    """``<task id>:<redrive count>:<attempt>``: one value per attempt of one task, also across a
    redrive (whose attempts count from 1 again). A snoozed run (a 429/503 with ``Retry-After``)
    spends no attempt, so the run after it carries the same key: the same delivery, again."""
    return f"{ctx.task_id}:{ctx.redrive_count}:{ctx.attempt}"
