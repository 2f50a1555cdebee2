"""How rdq's values travel to and from the Lua scripts: arguments as strings and integers
(instants and durations in microseconds, JSON as repaired text), replies as codec records.
Plain functions, shared by the backend's parts."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any


from ...model import NewTask, Settlement, TaskStatus
from ..primitives import Selection
from ..spi import storable_error, storable_json, to_micros

_QUEUE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,119}$")


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _json(value: Any) -> str:
    # UTF-8 JSON with lone surrogates repaired: the same text every backend stores, and JSON
    # that Redis' cjson can decode (it rejects a lone "\ud800" escape).
    return storable_json(value)


def _enqueue_args(task: NewTask) -> tuple[Any, ...]:
    return (
        task.id,
        task.handler,
        _json(task.payload),
        _json(dict(task.headers)),
        "" if task.max_attempts is None else int(task.max_attempts),
        "" if task.backoff is None else _json(task.backoff.to_dict()),
        _micros(task.delay_seconds or 0.0),
        "" if task.run_at is None else to_micros(task.run_at),
        int(task.priority or 0),
        task.concurrency_key or "",
        task.rate_key or "",
        task.group or "",
    )


def _settle_args(s: Settlement) -> tuple[Any, ...]:
    error = storable_error(s.error)
    return (
        s.task_id,
        s.claim_token,
        s.outcome.value,
        s.status.value,
        _micros(s.retry_delay_seconds),
        _json(error.to_dict()) if error else "",
        error.type if error else "",
        _json(s.result) if s.status is TaskStatus.SUCCEEDED else "",
        "" if s.started_after_seconds is None else _micros(s.started_after_seconds),
    )


def _after(selection: Selection) -> tuple[str, str]:
    """The keyset position as the scripts take it: ``("", "")`` for the start."""
    return ("", "") if selection.after is None else (str(selection.after[0]), selection.after[1])


def _selection_args(selection: Selection) -> tuple[str, str, str]:
    return (
        _json(list(selection.ids)) if selection.ids is not None else "",
        selection.error_type or "",
        selection.handler or "",
    )


def _group_by_token_queue(refs: Sequence[Any]) -> dict[str, list[Any]]:
    """Group fenced writes by the queue named in their claim token; a token that names no
    valid queue was not minted here and is left out: refused without a round trip."""
    by_queue: dict[str, list[Any]] = {}
    for ref in refs:
        queue, sep, _ = str(ref.claim_token).partition("|")
        if sep and _QUEUE_NAME.match(queue):
            by_queue.setdefault(queue, []).append(ref)
    return by_queue


def _document(stored: str) -> tuple[int, str]:
    """A document as the kind's hash holds it, ``<version>:<body>``, as ``(version, body)``."""
    version, _, body = stored.partition(":")
    return int(version), body


def _record(reply: Sequence[Any]) -> Mapping[str, Any]:
    """A script's task reply ``{task hash, attempts hash}`` (both flat) as a codec record."""
    fields, history = reply
    record: dict[str, Any] = dict(zip(fields[::2], fields[1::2], strict=True))
    record["attempts"] = [{"attempt_no": no, **json.loads(raw)} for no, raw in zip(history[::2], history[1::2], strict=True)]
    return record
