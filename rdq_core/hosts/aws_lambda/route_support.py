"""What the API's routes share: the client of a request, a page's limit, a payload's size, the
fields a body may carry, and waking a worker when work becomes due."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from typing import Any, Mapping

from ...client import Client
from ...errors import InvalidInput
from ...model import EnqueueResult, NewTask
from ...problems import ApiProblem
from ...validation import Limits
from .connection import shared_storage
from .invoker import FleetStarts, invoker
from .request import ApiRequest


def client_for(request: ApiRequest) -> Client:
    return Client(shared_storage(request.settings), actor=request.actor)


def page_limit(params: Mapping[str, str], default: int = 50) -> int:
    text = params.get("limit")
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,4}", text):
        raise InvalidInput(f"limit must be an integer in 1..{Limits.page_size}", "limit")
    return int(text)


def check_payload_size(item: Mapping[str, Any], field_name: str) -> None:
    # The engine would refuse an oversized payload as invalid (422); over HTTP the precise
    # answer is 413, so measure it here first, the same way the engine does.
    if "payload" not in item:
        return
    try:
        size = len(json.dumps(item["payload"], allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError):
        return  # not JSON-shaped, or a lone surrogate (UnicodeEncodeError): the engine reports it as a 422
    if size > Limits.payload_bytes:
        raise ApiProblem(413, f"{field_name} exceeds {Limits.payload_bytes} bytes once encoded as JSON", field_name)


def log_payloads() -> bool:
    """Payloads are logged only when the deployer opts in with ``RDQ_LOG_PAYLOADS=true``."""
    return os.environ.get("RDQ_LOG_PAYLOADS", "").strip().lower() in {"1", "true", "yes", "on"}


def due_now(task: NewTask) -> bool:
    if task.run_at is not None:
        return task.run_at <= datetime.now(timezone.utc)
    return task.delay_seconds <= 0


def wake_worker(request: ApiRequest, queue: str, new_tasks: list[NewTask], results: list[EnqueueResult]) -> None:
    if any(r.created and due_now(t) for t, r in zip(new_tasks, results, strict=True)):
        wake_worker_for(request, queue)


def wake_worker_for(request: ApiRequest, queue: str) -> None:
    """Every action that makes work due now (enqueue, redrive) wakes a worker, so its latency
    does not wait for the schedule's next tick."""
    settings = request.settings
    if settings.wake_worker and settings.worker_function:
        # Wake-ups count against the workers' cap: each reserves the slot its worker will take
        # (invoker.py), and there is none while every worker slot is held or pending.
        invoker.wake(settings.worker_function, [queue], settings.wake_debounce_seconds,
                     fleet=FleetStarts(shared_storage(settings), settings.worker_fleet, settings.max_worker_concurrency))


def reject_unknown_fields(body: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(body) - known
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
