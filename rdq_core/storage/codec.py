"""One codec for every backend: a stored record becomes a ``Task``, ``ClaimedTask`` or ``Attempt``.

A *record* is a mapping whose keys are the model's field names (``id``, ``queue``, ``payload``,
``next_attempt_at``, ``claim_token``, ``attempts`` …). A store that names a field differently
declares the difference in ``keys`` (MongoDB: ``id`` is ``_id``, ``payload`` is ``payload_json``);
a store that keeps instants or JSON in its own form declares how to read them in ``time`` and
``document``. Everything else -- defaults, integer fields a store returns as text, the attempt
history's order -- is decided here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, Mapping

from ..model import Attempt, Backoff, ClaimedTask, ErrorInfo, Outcome, Task, TaskStatus

Record = Mapping[str, Any]

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# -- how stores keep instants -------------------------------------------------------------------

def instant(value: datetime | str | None) -> datetime | None:
    """A driver datetime (aware or naive-as-UTC) or ISO 8601 text, as an aware UTC datetime."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def epoch_micros(value: int | str | None) -> datetime | None:
    """Integer microseconds since the epoch (or their decimal text)."""
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(microseconds=int(value))


def epoch_millis(value: int | str | None) -> datetime | None:
    """Integer milliseconds since the epoch (or their decimal text)."""
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(milliseconds=int(value))


# -- how stores keep JSON values ----------------------------------------------------------------

def json_text(value: Any) -> Any:
    """A JSON value kept as text; anything already decoded (a sub-document) is taken as is."""
    if isinstance(value, (str, bytes, bytearray)):
        return json.loads(value)
    return value


def decoded(value: Any) -> Any:
    """A JSON value the driver already decoded (PostgreSQL ``jsonb``)."""
    return value


@dataclass(frozen=True)
class RecordCodec:
    """Reads one store's records. ``time`` and ``document`` say how the store keeps instants and
    JSON values; ``keys`` maps a model field name to the store's key where they differ."""

    time: Callable[[Any], datetime | None]
    document: Callable[[Any], Any] = json_text
    keys: Mapping[str, str] = field(default_factory=dict)

    def _get(self, record: Record, name: str, default: Any = None) -> Any:
        value = record.get(self.keys.get(name, name), default)
        return default if value is None else value

    def _count(self, record: Record, name: str) -> int:
        return int(self._get(record, name, 0))

    def _json(self, record: Record, name: str) -> Any:
        value = self._get(record, name)
        return None if value is None else self.document(value)

    def attempt(self, record: Record) -> Attempt:
        return Attempt(
            attempt_no=int(self._get(record, "attempt_no")),
            outcome=Outcome(self._get(record, "outcome")),
            started_at=self.time(self._get(record, "started_at")),
            finished_at=self.time(self._get(record, "finished_at")),
            error=ErrorInfo.from_dict(self._json(record, "error")),
        )

    def attempts(self, records: Iterable[Record] | None) -> tuple[Attempt, ...]:
        """The history in attempt order, whatever order the store returned it in."""
        return tuple(sorted((self.attempt(r) for r in records or ()), key=lambda a: a.attempt_no))

    def task(self, record: Record, attempts: Iterable[Record] | None = None) -> Task:
        """``attempts`` defaults to the record's own ``attempts`` (empty on claim paths)."""
        max_attempts = self._get(record, "max_attempts")
        return Task(
            id=self._get(record, "id"),
            queue=self._get(record, "queue"),
            handler=self._get(record, "handler"),
            payload=self._json(record, "payload"),
            status=TaskStatus(self._get(record, "status")),
            headers=dict(self._json(record, "headers") or {}),
            attempt_count=self._count(record, "attempt_count"),
            redrive_count=self._count(record, "redrive_count"),
            max_attempts=None if max_attempts in (None, "") else int(max_attempts),
            backoff=Backoff.from_dict(self._json(record, "backoff")),
            next_attempt_at=self.time(self._get(record, "next_attempt_at")),
            lease_expires_at=self.time(self._get(record, "lease_expires_at")),
            created_at=self.time(self._get(record, "created_at")),
            updated_at=self.time(self._get(record, "updated_at")),
            dead_at=self.time(self._get(record, "dead_at")),
            result=self._json(record, "result"),
            last_error=ErrorInfo.from_dict(self._json(record, "last_error")),
            attempts=self.attempts(self._get(record, "attempts") if attempts is None else attempts),
        )

    def claimed(self, record: Record) -> ClaimedTask:
        """A task as a claim (or the expired-lease scan) hands it out: with its claim, no history."""
        lease = self.time(self._get(record, "lease_expires_at"))
        claimed_at = self.time(self._get(record, "claimed_at"))
        assert lease is not None and claimed_at is not None, "a claimed record carries its lease"
        return ClaimedTask(
            task=self.task(record, attempts=()),
            claim_token=self._get(record, "claim_token"),
            claimed_at=claimed_at,
            lease_expires_at=lease,
        )
