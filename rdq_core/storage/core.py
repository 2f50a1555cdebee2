"""The storage core: the behaviour every backend shares, written once.

``Storage`` (``spi.py``) is the contract the engine and hosts call. ``StorageCore`` implements all
of it on top of a small set of *primitives* a backend writes in its own dialect -- one atomic store
operation each, no policy, no mapping, no bookkeeping::

    engine ──► StorageCore.settle(settlements)            (public SPI method, here)
                 │ empty batch → nothing; repeats of a task id → refused
                 │ text repaired (lone surrogates → U+FFFD)
                 ├──► backend._settle(items) → ids applied   (the primitive: one atomic step)
                 │ transient store error → StorageUnavailable
                 └── ids not applied → StaleClaim

What the core owns, so no backend writes it again:

* **Guards**: empty batches cost nothing; ``claim``/``find_expired_leases``/``purge_succeeded``
  with ``limit <= 0`` return nothing without touching the store; ``list_dead`` with
  ``limit < 1`` is ``InvalidInput``; ids, claim tokens, queue names and filter values that are
  not strings are ``InvalidInput`` (a store must never see a request value that could read as a
  query operator); a settlement to any status but SUCCEEDED, PENDING or DEAD (PENDING only, for
  a SNOOZED one) is ``InvalidInput``.
* **Errors**: the backend declares ``transient_errors`` (and may refine ``is_transient``); any
  of them escaping a primitive becomes ``StorageUnavailable``. ``connection=`` on a store that
  cannot join a caller's transaction is ``UnsupportedOperation``.
* **Mapping**: a primitive returns *records* (mappings keyed by model field names, see
  ``codec.py``); ``codec`` turns them into model objects.
* **Fencing bookkeeping**: a write primitive returns the ids it applied; every other id is
  refused with ``StaleClaim`` after the applied ones are kept.
* **Dead-letter selection**: ``DeadFilter`` and the keyset cursor become one ``DeadSelection``
  the backend translates; paging (one row beyond the page) and cursors are done here.
* **Cancel's reasons**: not found vs not PENDING.
* **Lifecycle events** (``rdq_core/events.py``): which events ``_settle`` and ``_redrive`` write
  into the outbox with their change (``events``), and the outbox's guards and records.
"""

from __future__ import annotations

import abc
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

from ..errors import (
    InvalidCursor,
    InvalidInput,
    RdqError,
    StaleClaim,
    StorageUnavailable,
    TaskConflict,
    TaskNotFound,
    UnsupportedOperation,
)
from ..events import EventSettings, OutboxEvent
from ..flow import NO_FLOW, FlowPolicy
from ..ids import new_sequential_id
from ..model import (
    AuditEntry,
    Document,
    AuditPage,
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    NewTask,
    Outcome,
    QueueStats,
    Settlement,
    Task,
    TaskFilter,
    TaskPage,
    TaskStatus,
)
from .codec import Record, RecordCodec
from .spi import (
    LiveQueueStats,
    OpenTransaction,
    Storage,
    decode_audit_cursor,
    decode_dead_cursor,
    decode_task_cursor,
    encode_audit_cursor,
    encode_dead_cursor,
    encode_task_cursor,
    from_micros,
    storable_error,
    storable_json,
    storable_text,
)

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


class StorageCore(Storage, abc.ABC):
    """The SPI's behaviour over a backend's primitives (see the module doc)."""

    #: Reads this store's records.
    codec: ClassVar[RecordCodec]
    #: A name for messages: "PostgreSQL", "Redis", ...
    store_name: ClassVar[str] = "store"
    #: Exception types that mean the store could not serve the call now; they become
    #: ``StorageUnavailable`` (retryable). Anything else is a bug and propagates as is.
    transient_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: Whether ``enqueue(connection=...)`` can write inside the caller's open transaction.
    joins_transactions: ClassVar[bool] = False

    # -- error translation -------------------------------------------------------------------
    def is_transient(self, exc: BaseException) -> bool:
        """Refine in a backend whose driver reports transient conditions by code or text."""
        return isinstance(exc, self.transient_errors)

    @contextmanager
    def translated_errors(self) -> Iterator[None]:
        """The one place a store's own exception becomes the SPI's ``StorageUnavailable``."""
        try:
            yield
        except RdqError:
            raise
        except Exception as exc:
            if self.is_transient(exc):
                raise StorageUnavailable(f"{self.store_name} operation failed: {exc}") from exc
            raise

    # -- primitives a backend writes (one atomic store operation each) -----------------------
    @abc.abstractmethod
    def _now(self) -> datetime:
        """The store's clock."""

    @abc.abstractmethod
    def _insert(self, tasks: Sequence[NewTask], connection: Any) -> Sequence[InsertedRecord]:
        """Insert each task as PENDING unless its id exists; one result per input, in order."""

    @abc.abstractmethod
    def _insert_deduplicated(self, task: NewTask, connection: Any) -> InsertedRecord:
        """Enqueue one task that has a ``dedupe_key``, atomically against concurrent enqueues of the
        same queue and key (never a check and an insert another enqueue can slip between):

        * a task already holding ``task.id``: its record, not inserted (idempotency comes first);
        * else the newest task (by ``created_at``, then id) of the same queue and ``dedupe_key``
          whose status is in ``dedupe_states_of(task)`` or that was created within
          ``task.dedupe_for_seconds`` of the store's now: its record after the mode is applied,
          ``deduplicated=True``. Only a PENDING match changes: ``replace`` stores the request's
          payload and headers (a payload-store reference is a header); ``debounce`` moves
          ``next_attempt_at`` to the request's due time (now + delay, or run_at), but never past
          the match's ``created_at + dedupe_max_wait_seconds``;
        * else the task inserted as ``_insert`` would, with its ``dedupe_key`` stored.
        """

    @abc.abstractmethod
    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> Sequence[Record]:
        """Flip up to ``limit`` due PENDING tasks to IN_FLIGHT atomically, in claim order and
        within ``flow`` (docs/flow-control.md); claimed records."""

    @abc.abstractmethod
    def _extend(self, refs: Sequence[ClaimRef], lease_seconds: float) -> Mapping[str, Any]:
        """``{task id: stored lease expiry}`` for each ref still held, after extending it."""

    @abc.abstractmethod
    def _settle(self, settlements: Sequence[Settlement]) -> set[str]:
        """Apply each decision whose claim still holds (one per task id); the ids applied."""

    @abc.abstractmethod
    def _release(self, refs: Sequence[ClaimRef]) -> set[str]:
        """Return each still-held task to PENDING; the ids released."""

    @abc.abstractmethod
    def _expired(self, limit: int, queue: str | None) -> Sequence[Record]:
        """Claimed records of IN_FLIGHT tasks whose lease expired, oldest expiry first."""

    @abc.abstractmethod
    def _load(self, task_id: str) -> Record | None:
        """The task's record with its ``attempts``, or None."""

    @abc.abstractmethod
    def _cancel(self, task_id: str) -> tuple[Record | None, bool]:
        """PENDING → CANCELLED if PENDING. ``(record after the call, cancelled by this call)``;
        ``(None, False)`` when absent."""

    @abc.abstractmethod
    def _page(self, selection: Selection, limit: int, history: bool) -> Sequence[Record]:
        """Up to ``limit`` selected records of ``selection.status`` ordered by
        ``(selection.order_field, id)``, after ``selection.after``; with their ``attempts`` when
        ``history`` (else none need be loaded)."""

    @abc.abstractmethod
    def _count(self, selection: Selection) -> int:
        """How many tasks the selection (status and filter; never ``after``) holds."""

    @abc.abstractmethod
    def _cancel_selected(self, selection: Selection) -> int:
        """Selected PENDING → CANCELLED (``selection.status`` is PENDING); the count."""

    @abc.abstractmethod
    def _redrive(self, selection: DeadSelection) -> int:
        """Selected DEAD → PENDING due now, budget reset, ``redrive_count + 1``; the count."""

    @abc.abstractmethod
    def _purge_dead(self, selection: DeadSelection) -> int:
        """Delete selected dead tasks and their history; the count."""

    @abc.abstractmethod
    def _stats(self, queue: str) -> QueueCounts:
        """Counts per status and the oldest due PENDING task's age."""

    def _live_stats(self, queue: str) -> QueueCounts:
        """``_stats`` for PENDING, IN_FLIGHT and DEAD only (other counts may be left out), read
        at a cost in proportion to those tasks. A backend whose ``_stats`` already costs that
        (counters, not scans) keeps this default."""
        return self._stats(queue)

    @abc.abstractmethod
    def _queues(self) -> Sequence[str]:
        """Names of queues that hold at least one task."""

    @abc.abstractmethod
    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` SUCCEEDED/CANCELLED tasks last updated before the cutoff."""

    @abc.abstractmethod
    def _set_paused(self, queue: str, paused: bool) -> None:
        """Record whether ``queue`` is paused. ``_claim`` of a paused queue claims nothing, checked
        in the claim's own step or before it: a claim that starts after this returns sees it."""

    @abc.abstractmethod
    def _paused(self) -> Sequence[str]:
        """Names of the paused queues."""

    @abc.abstractmethod
    def _audit_append(self, entry: Mapping[str, Any]) -> Any:
        """Store one audit entry (``id, actor, action, queue, selection`` as JSON text, ``count``),
        stamped with the store's clock; returns that time as the store keeps it."""

    @abc.abstractmethod
    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        """``(version, body)`` of the document, or None."""

    @abc.abstractmethod
    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        """Compare-and-set in one atomic step: with ``expected`` None, insert unless the document
        exists; else replace it only while its version is ``expected``. The new version (1 for an
        insert, ``expected + 1`` after), or None when the condition did not hold."""

    @abc.abstractmethod
    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        """Delete the document if its version is still ``expected``; whether it was deleted."""

    @abc.abstractmethod
    def _doc_page(self, kind: str, after: str | None, limit: int) -> Sequence[tuple[str, int, str]]:
        """Up to ``limit`` ``(key, version, body)`` of ``kind`` ordered by key bytes, after ``after``."""

    @abc.abstractmethod
    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> Sequence[Record]:
        """Up to ``limit`` audit entries (of ``queue``, or all) newest first by ``(at, id)``,
        strictly before ``before``; records with the fields of ``_audit_append`` plus ``at``."""

    @abc.abstractmethod
    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Insert outbox events (``id, type, queue, task_id, detail`` as JSON text), stamped with
        the store's clock, after every event already there; an id already there is kept."""

    @abc.abstractmethod
    def _outbox_take(self, limit: int, lease_seconds: float) -> Sequence[Record]:
        """Up to ``limit`` events whose lease is absent or past, in write order, each leased
        until now + ``lease_seconds`` in the same atomic step; records with the fields of
        ``_outbox_put`` plus ``at``."""

    @abc.abstractmethod
    def _outbox_ack(self, ids: Sequence[str]) -> int:
        """Delete these events; how many there were."""

    # -- the SPI ---------------------------------------------------------------------------
    #: Which events the task primitives write (``events``); None until configured or first read.
    _event_settings: EventSettings | None = None

    @property
    def events(self) -> EventSettings:
        """What ``_settle`` and ``_redrive`` write into the outbox with the change: read from the
        environment on first use, so every process of one deployment (worker, reaper, API, a
        producer's Client) writes the same events."""
        if self._event_settings is None:
            self._event_settings = EventSettings.from_env()
        return self._event_settings

    def configure_events(self, settings: EventSettings) -> None:
        self._event_settings = settings

    def record_events(self, events: Sequence[OutboxEvent]) -> None:
        if not self.events.enabled or not events:
            return
        for event in events:
            _require_text(event.id, "id")
            _require_text(event.queue, "queue")
        rows = [{"id": e.id, "type": e.type, "queue": e.queue, "task_id": e.task_id,
                 "detail": storable_json(dict(e.detail))} for e in events]
        with self.translated_errors():
            self._outbox_put(rows)

    def take_events(self, limit: int, *, lease_seconds: float) -> list[OutboxEvent]:
        _require_limit(limit)
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) or not 0 < lease_seconds <= 3600:
            raise InvalidInput("lease_seconds must be a number in (0, 3600]", field="lease_seconds")
        with self.translated_errors():
            records = self._outbox_take(int(limit), float(lease_seconds))
        return [self._outbox_event(r) for r in records]

    def ack_events(self, ids: Sequence[str]) -> int:
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return 0
        for event_id in wanted:
            _require_text(event_id, "ids")
        with self.translated_errors():
            return int(self._outbox_ack(wanted))

    def _outbox_event(self, record: Record) -> OutboxEvent:
        at = self.codec.time(record["at"])
        assert at is not None, "an outbox event has a time"
        detail = record.get("detail")
        if isinstance(detail, (str, bytes, bytearray)):
            detail = json.loads(detail)
        task_id = record.get("task_id")
        return OutboxEvent(id=str(record["id"]), type=str(record["type"]), queue=str(record["queue"]),
                           task_id=None if task_id in (None, "") else str(task_id), at=at, detail=dict(detail or {}))

    def now(self) -> datetime:
        with self.translated_errors():
            value = self._now()
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)

    def enqueue(self, tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        if connection is not None and not self.joins_transactions:
            raise UnsupportedOperation(f"the {self.store_name} backend cannot join a caller's transaction")
        requests = list(tasks)
        if not requests:
            return []
        for request in requests:
            for field in ("id", "queue", "handler"):
                _require_text(getattr(request, field), field)
        with self.translated_errors():
            inserted = self._insert_all(requests, connection)
        results: list[EnqueueResult] = []
        seen: set[str] = set()
        for request, row in zip(requests, inserted, strict=True):
            # A repeat of an id within one batch is an idempotent repeat, never a second create.
            created = row.inserted and request.id not in seen
            seen.add(request.id)
            task = self.codec.task(row.record)  # an existing task keeps its history, if the record carries it
            results.append(EnqueueResult(task=task, created=created, deduplicated=row.deduplicated,
                                         conflict=not created and task.queue != request.queue))
        return results

    def _insert_all(self, requests: list[NewTask], connection: Any) -> list[InsertedRecord]:
        """Tasks without a dedupe_key go in one batch, exactly as before; each task with one is
        enqueued by ``_insert_deduplicated``, after the batch, in request order."""
        plain = [r for r in requests if r.dedupe_key is None]
        rows = iter(self._insert(plain, connection) if plain else ())
        batch = [None if r.dedupe_key is not None else next(rows) for r in requests]
        return [row if row is not None else self._insert_deduplicated(request, connection)
                for request, row in zip(requests, batch, strict=True)]

    def claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy = NO_FLOW) -> list[ClaimedTask]:
        _require_text(queue, "queue")
        if limit <= 0:
            return []
        with self.translated_errors():
            records = self._claim(queue, int(limit), float(lease_seconds), flow)
        return [self.codec.claimed(r) for r in records]

    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        refs = list(refs)
        if not refs:
            return {}
        _require_refs(refs)
        sent = _first_per_task(refs)
        with self.translated_errors():
            stored = self._extend(list(sent.values()), float(lease_seconds))
        expiries: dict[str, datetime] = {}
        for task_id, value in stored.items():
            expiry = self.codec.time(value)
            assert expiry is not None, "an extended lease has an expiry"
            expiries[task_id] = expiry
        _refuse_unapplied(refs, sent, expiries.keys())
        return expiries

    def settle(self, settlements: Sequence[Settlement]) -> None:
        items = list(settlements)
        if not items:
            return
        _require_refs(items)
        items = [_with_enums(item) for item in items]
        for item in items:
            if item.status not in _SETTLED_STATUSES:
                raise InvalidInput(f"cannot settle task {item.task_id} as {item.status}", field="status")
            if item.outcome is Outcome.SNOOZED and item.status is not TaskStatus.PENDING:
                raise InvalidInput(f"a snoozed task {item.task_id} goes back to PENDING", field="status")
        # One settle per claim: the first decision for a task id is applied, a repeat refused.
        first: dict[str, Settlement] = {}
        for item in items:
            first.setdefault(item.task_id, _storable(item))
        with self.translated_errors():
            applied = self._settle(list(first.values()))
        refused: list[str] = []
        seen: set[str] = set()
        for item in items:
            if item.task_id not in applied or item.task_id in seen:
                refused.append(item.task_id)
            seen.add(item.task_id)
        if refused:
            raise StaleClaim(refused)

    def release(self, refs: Sequence[ClaimRef]) -> None:
        refs = list(refs)
        if not refs:
            return
        _require_refs(refs)
        sent = _first_per_task(refs)
        with self.translated_errors():
            released = self._release(list(sent.values()))
        _refuse_unapplied(refs, sent, released)

    # -- exactly-once effects: a task completed inside a database transaction ----------------
    # (rdq_core/engine/transactions.py drives these; only a store that ``joins_transactions`` has them.)
    def _begin(self, connection: Any) -> OpenTransaction:
        """Open a transaction on ``connection`` (the caller's, idle) or on one of the store's own."""
        raise UnsupportedOperation(self._no_transactions())

    def _settle_on(self, connection: Any, settlements: Sequence[Settlement]) -> set[str]:
        """``_settle`` inside the open transaction on ``connection``, never committing it."""
        raise UnsupportedOperation(self._no_transactions())

    def _no_transactions(self) -> str:
        return (f"the {self.store_name} backend cannot complete a task inside a database transaction "
                "(exactly-once effects need PostgreSQL or SQLite)")

    def begin_transaction(self, connection: Any = None) -> OpenTransaction:
        if not self.joins_transactions:
            raise UnsupportedOperation(self._no_transactions())
        with self.translated_errors():
            return self._begin(connection)

    def settle_in_transaction(self, connection: Any, settlement: Settlement) -> bool:
        if not self.joins_transactions:
            raise UnsupportedOperation(self._no_transactions())
        _require_refs([settlement])
        item = _with_enums(settlement)
        if item.status not in _SETTLED_STATUSES:
            raise InvalidInput(f"cannot settle task {item.task_id} as {item.status}", field="status")
        with self.translated_errors():
            applied = self._settle_on(connection, [_storable(item)])
        return item.task_id in applied

    def find_expired_leases(self, limit: int, queue: str | None = None) -> list[ClaimedTask]:
        if queue is not None:
            _require_text(queue, "queue")
        if limit <= 0:
            return []
        with self.translated_errors():
            records = self._expired(int(limit), queue)
        return [self.codec.claimed(r) for r in records]

    def get(self, task_id: str) -> Task | None:
        _require_text(task_id, "task_id")
        with self.translated_errors():
            record = self._load(task_id)
        return None if record is None else self.codec.task(record)

    def cancel(self, task_id: str) -> Task:
        _require_text(task_id, "task_id")
        with self.translated_errors():
            record, cancelled = self._cancel(task_id)
        if record is None:
            raise TaskNotFound(task_id)
        task = self.codec.task(record)
        if not cancelled:
            raise TaskConflict(f"task {task_id!r} is {task.status.value}, only PENDING tasks can be cancelled")
        return task

    def list_dead(
        self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()
    ) -> DeadPage:
        _require_limit(limit)
        after = decode_dead_cursor(queue, cursor) if cursor is not None else None
        selection = self._selection(queue, filter, after)
        if selection.matches_nothing:
            return DeadPage(tasks=(), next_cursor=None)
        # One record beyond the page tells whether another page exists.
        with self.translated_errors():
            records = self._page(selection, limit + 1, True)
        tasks = tuple(self.codec.task(r) for r in records[:limit])
        next_cursor = None
        if len(records) > limit:
            last = tasks[-1]
            assert last.dead_at is not None, "a dead task has a dead_at"
            next_cursor = encode_dead_cursor(queue, last.dead_at, last.id)
        return DeadPage(tasks=tasks, next_cursor=next_cursor)

    def redrive(self, queue: str, filter: DeadFilter) -> int:
        selection = self._selection(queue, filter)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return self._redrive(selection)

    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        selection = self._selection(queue, filter)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return self._purge_dead(selection)

    def stats(self, queue: str) -> QueueStats:
        return self._queue_stats(queue, None)

    def queue_overview(self) -> list[QueueStats]:
        # The paused set is read once for all queues, not once per queue.
        paused = self.paused_queues()
        with self.translated_errors():
            names = set(self._queues()) | paused
        return [self._queue_stats(queue, paused) for queue in sorted(names)]

    def _queue_stats(self, queue: str, paused: set[str] | None) -> QueueStats:
        live, counts = self._read_counts(queue, self._stats, paused)
        return QueueStats(queue=queue, pending=live.pending, in_flight=live.in_flight, dead=live.dead,
                          succeeded=counts.get(TaskStatus.SUCCEEDED.value, 0),
                          cancelled=counts.get(TaskStatus.CANCELLED.value, 0),
                          oldest_pending_age_seconds=live.oldest_pending_age_seconds, paused=live.paused)

    def live_stats(self, queue: str) -> LiveQueueStats:
        return self._read_counts(queue, self._live_stats, None)[0]

    def _read_counts(self, queue: str, read: Callable[[str], QueueCounts], paused: set[str] | None
                     ) -> tuple[LiveQueueStats, dict[str, int]]:
        """``read``'s counts of ``queue`` as its live figures, and every count by status."""
        _require_text(queue, "queue")
        with self.translated_errors():
            found = read(queue)
        counts = {str(status): int(n) for status, n in found.counts.items()}
        live = LiveQueueStats(
            queue=queue,
            pending=counts.get(TaskStatus.PENDING.value, 0),
            in_flight=counts.get(TaskStatus.IN_FLIGHT.value, 0),
            dead=counts.get(TaskStatus.DEAD.value, 0),
            oldest_pending_age_seconds=max(0.0, float(found.oldest_due_age_seconds or 0.0)),
            paused=found.paused if found.paused is not None
            else queue in (paused if paused is not None else self.paused_queues()),
        )
        return live, counts

    def list_queues(self) -> list[str]:
        with self.translated_errors():
            return sorted(set(self._queues()))

    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        if limit <= 0:
            return 0
        with self.translated_errors():
            return self._purge_finished(max(0.0, float(older_than_seconds)), int(limit))

    def list_tasks(
        self, queue: str, *, status: TaskStatus | None = None, limit: int, cursor: str | None = None,
        filter: TaskFilter = TaskFilter(),
    ) -> TaskPage:
        _require_limit(limit)
        statuses = LISTING_ORDER if status is None else (_status(status),)
        start, after = 0, None
        if cursor is not None:
            cursor_status, micros, after_id = decode_task_cursor(queue, cursor)
            if cursor_status not in statuses:
                raise InvalidCursor()
            start, after = statuses.index(cursor_status), (micros, after_id)
        # Each status is asked for what the page still needs plus one: one record beyond the page
        # tells whether another page exists, so a page costs at most len(statuses) store calls.
        found: list[tuple[TaskStatus, Task]] = []
        for listed in statuses[start:]:
            selection = self._selection(queue, filter, after, listed)
            after = None
            if selection.matches_nothing:
                break
            with self.translated_errors():
                records = self._page(selection, limit - len(found) + 1, False)
            found.extend((listed, self.codec.task(r)) for r in records)
            if len(found) > limit:
                break
        next_cursor = None
        if len(found) > limit:
            last_status, last = found[limit - 1]
            at = getattr(last, ORDER_FIELD[last_status])
            assert at is not None, f"a {last_status.value} task has a {ORDER_FIELD[last_status]}"
            next_cursor = encode_task_cursor(queue, last_status, at, last.id)
        return TaskPage(tasks=tuple(task for _, task in found[:limit]), next_cursor=next_cursor)

    def count_tasks(self, queue: str, status: TaskStatus, filter: TaskFilter = TaskFilter()) -> int:
        selection = self._selection(queue, filter, None, _status(status))
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return int(self._count(selection))

    def cancel_selected(self, queue: str, filter: TaskFilter) -> int:
        selection = self._selection(queue, filter, None, TaskStatus.PENDING)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return int(self._cancel_selected(selection))

    def set_paused(self, queue: str, paused: bool) -> None:
        _require_text(queue, "queue")
        if not isinstance(paused, bool):
            raise InvalidInput("paused must be true or false", field="paused")
        with self.translated_errors():
            self._set_paused(queue, paused)

    def paused_queues(self) -> set[str]:
        with self.translated_errors():
            return set(self._paused())

    def record_audit(self, *, actor: str, action: str, queue: str, selection: Any, count: int) -> AuditEntry:
        for name, value in (("actor", actor), ("action", action), ("queue", queue)):
            _require_text(value, name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidInput("count must be a non-negative integer", field="count")
        entry = {"id": new_sequential_id(), "actor": storable_text(actor)[:_AUDIT_ACTOR_CHARS], "action": action,
                 "queue": queue, "selection": storable_json(selection if selection is not None else {}),
                 "count": int(count)}
        with self.translated_errors():
            at = self._audit_append(entry)
        return self._audit_entry({**entry, "at": at})

    def list_audit(self, *, queue: str | None = None, limit: int, cursor: str | None = None) -> AuditPage:
        _require_limit(limit)
        if queue is not None:
            _require_text(queue, "queue")
        before = decode_audit_cursor(queue, cursor) if cursor is not None else None
        with self.translated_errors():
            records = self._audit_page(queue, before, limit + 1)
        entries = tuple(self._audit_entry(r) for r in records[:limit])
        next_cursor = None
        if len(records) > limit:
            next_cursor = encode_audit_cursor(queue, entries[-1].at, entries[-1].id)
        return AuditPage(entries=entries, next_cursor=next_cursor)

    # -- helpers ---------------------------------------------------------------------------
    def get_document(self, kind: str, key: str) -> Document | None:
        _require_document_key(kind, key)
        with self.translated_errors():
            found = self._doc_get(kind, key)
        return None if found is None else Document(kind, key, found[0], json.loads(found[1]))

    def put_document(self, kind: str, key: str, body: Mapping[str, Any], *, expected_version: int | None) -> Document | None:
        _require_document_key(kind, key)
        if expected_version is not None and (isinstance(expected_version, bool) or not isinstance(expected_version, int)):
            raise InvalidInput("expected_version must be an integer or None", field="expected_version")
        text = storable_json(dict(body))
        with self.translated_errors():
            version = self._doc_put(kind, key, text, expected_version)
        return None if version is None else Document(kind, key, version, json.loads(text))

    def delete_document(self, kind: str, key: str, *, expected_version: int) -> bool:
        _require_document_key(kind, key)
        with self.translated_errors():
            return bool(self._doc_delete(kind, key, int(expected_version)))

    def list_documents(self, kind: str, *, limit: int, after: str | None = None) -> list[Document]:
        _require_document_key(kind, after if after is not None else kind)
        _require_limit(limit)
        with self.translated_errors():
            rows = self._doc_page(kind, after, limit)
        return [Document(kind, key, version, json.loads(body)) for key, version, body in rows]

    def roll_up_metrics(self, as_of: datetime | None = None) -> int:
        # Over the listings' keyset pages (with history) and the engine documents: every built-in
        # backend has it without code of its own (rollup.py).
        from . import rollup

        return rollup.roll_up(self, as_of)

    def _audit_entry(self, record: Record) -> AuditEntry:
        at = self.codec.time(record["at"])
        assert at is not None, "an audit entry has a time"
        selection = record.get("selection")
        if isinstance(selection, (str, bytes, bytearray)):
            selection = json.loads(selection)
        return AuditEntry(id=str(record["id"]), at=at, actor=str(record["actor"]), action=str(record["action"]),
                          queue=str(record["queue"]), selection=dict(selection or {}), count=int(record["count"]))

    @staticmethod
    def _selection(queue: str, filter: DeadFilter, after: tuple[int, str] | None = None,
                   status: TaskStatus = TaskStatus.DEAD) -> Selection:
        _require_text(queue, "queue")
        for field in ("error_type", "handler"):
            if getattr(filter, field) is not None:
                _require_text(getattr(filter, field), field)
        ids = None
        if filter.ids is not None:
            for task_id in filter.ids:
                _require_text(task_id, "ids")
            ids = tuple(dict.fromkeys(filter.ids))  # order kept, repeats dropped
        return Selection(queue=queue, status=status, ids=ids, error_type=filter.error_type, handler=filter.handler,
                         after=after)


def _first_per_task(refs: Sequence[ClaimRef]) -> dict[str, ClaimRef]:
    """The first ref per task id: a primitive sees each task once, as it reports per task id."""
    first: dict[str, ClaimRef] = {}
    for ref in refs:
        first.setdefault(ref.task_id, ref)
    return first


def _refuse_unapplied(refs: Sequence[ClaimRef], sent: Mapping[str, ClaimRef], applied: Any) -> None:
    # A repeat of a task id shares the result of the ref sent for it if it names the same claim;
    # under another token it cannot also hold the task.
    refused = [ref.task_id for ref in refs
               if ref.task_id not in applied or ref.claim_token != sent[ref.task_id].claim_token]
    if refused:
        raise StaleClaim(refused)


def _storable(item: Settlement) -> Settlement:
    """The settlement with its error text repaired; stores that keep JSON as text repair the
    result when they encode it (``storable_json``)."""
    return item if item.error is None else replace(item, error=storable_error(item.error))


def _with_enums(item: Settlement) -> Settlement:
    """The settlement with its outcome and status as the enums (a caller may pass their names):
    the checks and every backend compare members, and an unknown name is refused here."""
    if type(item.outcome) is Outcome and type(item.status) is TaskStatus:
        return item
    try:
        return replace(item, outcome=Outcome(item.outcome), status=TaskStatus(item.status))
    except ValueError:
        raise InvalidInput(f"task {item.task_id}: unknown outcome {item.outcome!r} or status {item.status!r}",
                           field="outcome") from None


def _require_refs(refs: Sequence[ClaimRef] | Sequence[Settlement]) -> None:
    for ref in refs:
        _require_text(ref.task_id, "task_id")
        _require_text(ref.claim_token, "claim_token")


_SETTLED_STATUSES = frozenset({TaskStatus.SUCCEEDED, TaskStatus.PENDING, TaskStatus.DEAD})

#: An actor is an IAM principal ARN, an API key id or ``local``: kept whole up to this length.
_AUDIT_ACTOR_CHARS = 512


_DOCUMENT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:~-]{0,199}")


def _require_document_key(kind: Any, key: Any) -> None:
    for field, value in (("kind", kind), ("key", key)):
        if not isinstance(value, str) or not _DOCUMENT_KEY.fullmatch(value):
            raise InvalidInput(f"a document {field} is 1..200 characters of [A-Za-z0-9._:~-]", field=field)


def _require_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInput("limit must be a positive integer", field="limit")


def _status(status: Any) -> TaskStatus:
    try:
        return TaskStatus(status)
    except ValueError:
        raise InvalidInput(f"status must be one of {', '.join(s.value for s in TaskStatus)}", field="status") from None


def _require_text(value: Any, field: str) -> None:
    # A request value must never reach a store as anything but text: {"$gt": ""} as an id would
    # read as a query operator on a document store.
    if not isinstance(value, str):
        raise InvalidInput(f"{field} must be a string", field=field)
