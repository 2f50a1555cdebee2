"""Keyset cursors and the epoch-microsecond instants they carry.

A leaf (vocabulary only): the core encodes and checks cursors, backends convert instants with
``to_micros`` / ``from_micros``, and the SPI re-exports all of it under its old names.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime, timedelta, timezone
from typing import Any

from ..errors import InvalidCursor
from ..model import TaskStatus
from ..validation import TASK_ID

# -- cursors ------------------------------------------------------------------------------------
# A cursor is the keyset position of the last item on a page, bound to what was listed (the
# queue, and for task listings the status). It is opaque to clients and validated on the way back.

def _encode_cursor(fields: dict[str, Any]) -> str:
    raw = json.dumps(fields, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> dict[str, Any]:
    """The cursor's fields with a valid ``t`` (int) and ``id`` (str); ``InvalidCursor`` otherwise."""
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 1024:
        raise InvalidCursor()
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidCursor() from None
    if not isinstance(data, dict) or type(data.get("t")) is not int or not isinstance(data.get("id"), str):
        raise InvalidCursor()
    # A forged instant outside what every store can hold, or an id no task can have, is refused
    # here rather than overflowing in a backend.
    if not _CURSOR_MICROS[0] <= data["t"] <= _CURSOR_MICROS[1] or not TASK_ID.fullmatch(data["id"]):
        raise InvalidCursor()
    return data


def encode_dead_cursor(queue: str, dead_at: datetime, task_id: str) -> str:
    return _encode_cursor({"q": queue, "t": to_micros(dead_at), "id": task_id})


def decode_dead_cursor(queue: str, cursor: str) -> tuple[int, str]:
    """Returns ``(dead_at_micros, task_id)``; raises ``InvalidCursor`` on anything else."""
    data = _decode_cursor(cursor)
    if data.get("q") != queue or "s" in data:
        raise InvalidCursor()
    return data["t"], data["id"]


def encode_task_cursor(queue: str, status: TaskStatus, at: datetime, task_id: str) -> str:
    return _encode_cursor({"q": queue, "s": status.value, "t": to_micros(at), "id": task_id})


def decode_task_cursor(queue: str, cursor: str) -> tuple[TaskStatus, int, str]:
    """Returns ``(status, instant_micros, task_id)``; raises ``InvalidCursor`` on anything else."""
    data = _decode_cursor(cursor)
    # A forged cursor may carry any JSON in "s" (an object is unhashable): check the type first.
    status = data.get("s")
    if data.get("q") != queue or not isinstance(status, str) or status not in TaskStatus._value2member_map_:
        raise InvalidCursor()
    return TaskStatus(data["s"]), data["t"], data["id"]


def encode_audit_cursor(queue: str | None, at: datetime, entry_id: str) -> str:
    return _encode_cursor({"a": queue or "", "t": to_micros(at), "id": entry_id})


def decode_audit_cursor(queue: str | None, cursor: str) -> tuple[int, str]:
    """Returns ``(at_micros, entry_id)``; raises ``InvalidCursor`` on anything else."""
    data = _decode_cursor(cursor)
    if data.get("a") != (queue or ""):
        raise InvalidCursor()
    return data["t"], data["id"]


def to_micros(value: datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    delta = value - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: The keyset instants a cursor may carry: datetime's own range.
_CURSOR_MICROS = (to_micros(datetime(1, 1, 1, tzinfo=timezone.utc)),
                  to_micros(datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)))
