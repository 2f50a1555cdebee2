"""One codec for every backend: a stored record becomes a ``Task``, ``ClaimedTask`` or ``Attempt``.

A *record* is a mapping whose keys are the model's field names (``id``, ``queue``, ``payload``,
``next_attempt_at``, ``claim_token``, ``attempts`` …). A store that names a field differently
declares the difference in ``keys`` (MongoDB: ``id`` is ``_id``, ``payload`` is ``payload_json``);
a store that keeps instants or JSON in its own form declares how to read them in ``time`` and
``document``. Everything else -- defaults, integer fields a store returns as text, the attempt
history's order -- is decided here, once.
"""

from __future__ import annotations

import functools
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
    elif value.tzinfo is timezone.utc:
        return value  # the common case: a driver session in UTC
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


@functools.lru_cache(maxsize=4096)
def epoch_micros(value: int | str | None) -> datetime | None:
    """Integer microseconds since the epoch (or their decimal text). Cached: a claimed batch
    repeats the same few instants (one claim time and lease for the whole batch, one enqueue
    time per enqueued batch), and datetimes are immutable."""
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(microseconds=int(value))


def epoch_millis(value: int | str | None) -> datetime | None:
    """Integer milliseconds since the epoch (or their decimal text)."""
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(milliseconds=int(value))


# -- how stores keep JSON values ----------------------------------------------------------------

_decode_json = json.JSONDecoder().decode


def json_text(value: Any) -> Any:
    """A JSON value kept as text; anything already decoded (a sub-document) is taken as is.
    The empty object (the usual headers) is the most common value and needs no parsing."""
    if type(value) is str:
        return {} if value == "{}" else _decode_json(value)
    if isinstance(value, (str, bytes, bytearray)):
        return json.loads(value)
    return value


def decoded(value: Any) -> Any:
    """A JSON value the driver already decoded (PostgreSQL ``jsonb``)."""
    return value


_FIELDS = (
    "id", "queue", "handler", "payload", "status", "headers", "attempt_count", "redrive_count",
    "max_attempts", "backoff", "next_attempt_at", "lease_expires_at", "created_at", "updated_at",
    "dead_at", "result", "last_error", "attempts", "claim_token", "claimed_at", "claimed_by",
    "attempt_no", "outcome", "started_at", "finished_at", "error",
    "priority", "concurrency_key", "rate_key", "group", "dedupe_key",
)


def _trusted_task(**fields: Any) -> Task:
    """``Task(**fields)`` for a record the codec has just read: every field given, so the
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field, a fifth of a claimed
    task's decoding) is skipped. Equality, hashing and immutability are the dataclass's as usual."""
    task = object.__new__(Task)
    task.__dict__.update(fields)
    return task


@dataclass(frozen=True)
class RecordCodec:
    """Reads one store's records. ``time`` and ``document`` say how the store keeps instants and
    JSON values; ``keys`` maps a model field name to the store's key where they differ."""

    time: Callable[[Any], datetime | None]
    document: Callable[[Any], Any] = json_text
    keys: Mapping[str, str] = field(default_factory=dict)
    #: The fields this store keeps under another key (model name -> store key); set in __post_init__.
    _key: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Resolved once: mapping a record is on every claim's path (tens of thousands a second).
        key = {name: self.keys.get(name, name) for name in _FIELDS}
        object.__setattr__(self, "_key", {name: stored for name, stored in key.items() if stored != name})

    def _named(self, record: Record) -> Record:
        """The record under the model's field names: as it is, for a store that uses them."""
        if not self._key:
            return record
        renamed = dict(record)
        for name, stored in self._key.items():
            renamed[name] = record.get(stored)
        return renamed

    def attempt(self, record: Record) -> Attempt:
        time = self.time
        get: Callable[[str], Any] = self._named(record).get  # a store's values are untyped
        error = get("error")
        return Attempt(
            attempt_no=int(get("attempt_no")),
            outcome=Outcome(get("outcome")),
            started_at=time(get("started_at")),
            finished_at=time(get("finished_at")),
            error=None if error is None else ErrorInfo.from_dict(self.document(error)),
        )

    def attempts(self, records: Iterable[Record] | None) -> tuple[Attempt, ...]:
        """The history in attempt order, whatever order the store returned it in."""
        if not records:
            return ()
        return tuple(sorted((self.attempt(r) for r in records or ()), key=lambda a: a.attempt_no))

    def task(self, record: Record, attempts: Iterable[Record] | None = None) -> Task:
        """``attempts`` defaults to the record's own ``attempts`` (empty on claim paths)."""
        time, document = self.time, self.document
        get: Callable[[str], Any] = self._named(record).get  # a store's values are untyped
        # Inline rather than helper calls: this runs once per claimed task.
        payload, headers, backoff = get("payload"), get("headers"), get("backoff")
        result, last_error = get("result"), get("last_error")
        max_attempts, status = get("max_attempts"), TaskStatus(get("status"))
        return _trusted_task(
            id=get("id"),
            queue=get("queue"),
            handler=get("handler"),
            payload=None if payload is None else document(payload),
            status=status,
            headers=dict(document(headers) or {}) if headers is not None else {},
            attempt_count=int(get("attempt_count") or 0),
            redrive_count=int(get("redrive_count") or 0),
            max_attempts=None if max_attempts in (None, "") else int(max_attempts),
            backoff=None if backoff is None else Backoff.from_dict(document(backoff)),
            next_attempt_at=time(get("next_attempt_at")),
            lease_expires_at=time(get("lease_expires_at")),
            created_at=time(get("created_at")),
            updated_at=time(get("updated_at")),
            dead_at=time(get("dead_at")),
            result=None if result is None else document(result),
            last_error=None if last_error is None else ErrorInfo.from_dict(document(last_error)),
            attempts=self.attempts(get("attempts") if attempts is None else attempts),
            priority=int(get("priority") or 0),
            concurrency_key=get("concurrency_key") or None,
            rate_key=get("rate_key") or None,
            group=get("group") or None,
            dedupe_key=get("dedupe_key") or None,
            # Only while in flight: a store may keep the last claim's time after it ends, or not.
            claimed_at=time(get("claimed_at")) if status is TaskStatus.IN_FLIGHT else None,
            # The same for who claimed it ('' or absent: the claimer gave no name).
            claimed_by=(get("claimed_by") or None) if status is TaskStatus.IN_FLIGHT else None,
        )

    def claimed(self, record: Record) -> ClaimedTask:
        """A task as a claim (or the expired-lease scan) hands it out: with its claim, no history."""
        record = self._named(record)
        get: Callable[[str], Any] = record.get  # a store's values are untyped
        lease = self.time(get("lease_expires_at"))
        claimed_at = self.time(get("claimed_at"))
        assert lease is not None and claimed_at is not None, "a claimed record carries its lease"
        return ClaimedTask(
            task=self.task(record, attempts=()),
            claim_token=get("claim_token"),
            claimed_at=claimed_at,
            lease_expires_at=lease,
        )
