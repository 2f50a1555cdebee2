"""The values the storage core and a backend's primitives pass each other.

A leaf (the vocabulary, the record codec and the cursors' instants): ``core.py`` and every
backend import it, and so does ``rollup.py``, which pages through finished tasks with a
``Selection`` without importing the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Mapping

from ..model import NewTask, TaskStatus
from .codec import Record
from .cursors import from_micros

#: Counts per status, as ``stats`` primitives return them (missing statuses count 0).
StatusCounts = Mapping[str, int]
#: The statuses of live work: what ``live_stats`` counts.
LIVE_STATUSES = (TaskStatus.PENDING, TaskStatus.IN_FLIGHT, TaskStatus.DEAD)


#: The instant each status's tasks are listed by (then by id): what runs next, what expires
#: next, what died first, what finished first. Every backend indexes tasks of one queue and status
#: this way (the claim, the reaper, the DLQ and retention walk the same orders).
ORDER_FIELD: Mapping[TaskStatus, str] = {
    TaskStatus.PENDING: "next_attempt_at",
    TaskStatus.IN_FLIGHT: "lease_expires_at",
    TaskStatus.DEAD: "dead_at",
    TaskStatus.SUCCEEDED: "updated_at",
    TaskStatus.CANCELLED: "updated_at",
}

#: The order in which a listing without a status walks the statuses.
LISTING_ORDER = (TaskStatus.PENDING, TaskStatus.IN_FLIGHT, TaskStatus.DEAD, TaskStatus.SUCCEEDED, TaskStatus.CANCELLED)


@dataclass(frozen=True)
class Selection:
    """Which tasks of one queue, in one status, an operation means: the filter and, for a page,
    the keyset position after which it starts (``after``: the status's ``order_field`` in epoch
    microseconds, then the task id)."""

    queue: str
    status: TaskStatus = TaskStatus.DEAD
    ids: tuple[str, ...] | None = None
    error_type: str | None = None
    handler: str | None = None
    after: tuple[int, str] | None = None

    @property
    def order_field(self) -> str:
        """The record field this selection's tasks are ordered by (then by id)."""
        return ORDER_FIELD[self.status]

    @property
    def after_time(self) -> datetime | None:
        return None if self.after is None else from_micros(self.after[0])

    #: The dead-letter name of ``after_time`` (the DLQ is ordered by dead_at).
    after_dead_at = after_time

    @property
    def after_id(self) -> str | None:
        return None if self.after is None else self.after[1]

    @property
    def matches_nothing(self) -> bool:
        """An empty id list selects nothing: no store is asked."""
        return self.ids is not None and not self.ids


#: The dead-letter operations' name for a selection (status DEAD).
DeadSelection = Selection


@dataclass(frozen=True)
class InsertedRecord:
    """What an insert primitive returns per input task, in input order: the stored record (the
    new one, or the one already holding that id) and whether this call created it."""

    record: Record
    inserted: bool
    #: The record is an existing task the request matched by its dedupe_key (``_insert_deduplicated``).
    deduplicated: bool = False


#: The statuses a dedupe_key matches when the request names none.
DEFAULT_DEDUPE_STATES = (TaskStatus.PENDING, TaskStatus.IN_FLIGHT)


def dedupe_states_of(task: NewTask) -> tuple[str, ...]:
    """The status values ``task``'s dedupe_key matches (its own, or PENDING and IN_FLIGHT)."""
    return tuple(s.value for s in (task.dedupe_states or DEFAULT_DEDUPE_STATES))


@dataclass(frozen=True)
class QueueCounts:
    """What a stats primitive returns: counts per status and, over due PENDING tasks, the age in
    seconds of the oldest one by the store's clock (None or 0 when none is due)."""

    counts: StatusCounts
    oldest_due_age_seconds: float | None
    #: Whether the queue is paused, when the store read it in the same step (else the core asks).
    paused: bool | None = None
