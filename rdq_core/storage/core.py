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
  query operator); a settlement to any status but SUCCEEDED, PENDING or DEAD is ``InvalidInput``.
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
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, ClassVar, Iterator, Mapping, Sequence

from ..errors import InvalidInput, RdqError, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound, UnsupportedOperation
from ..model import (
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    NewTask,
    QueueStats,
    Settlement,
    Task,
    TaskStatus,
)
from .codec import Record, RecordCodec
from .spi import Storage, decode_dead_cursor, encode_dead_cursor, from_micros, storable_error

#: Counts per status, as ``stats`` primitives return them (missing statuses count 0).
StatusCounts = Mapping[str, int]


@dataclass(frozen=True)
class DeadSelection:
    """Which dead tasks of one queue an operation means: the filter, and for a page, the keyset
    position after which it starts (``after``: dead_at in epoch microseconds, task id)."""

    queue: str
    ids: tuple[str, ...] | None = None
    error_type: str | None = None
    handler: str | None = None
    after: tuple[int, str] | None = None

    @property
    def after_dead_at(self) -> datetime | None:
        return None if self.after is None else from_micros(self.after[0])

    @property
    def after_id(self) -> str | None:
        return None if self.after is None else self.after[1]

    @property
    def matches_nothing(self) -> bool:
        """An empty id list selects nothing: no store is asked."""
        return self.ids is not None and not self.ids


@dataclass(frozen=True)
class InsertedRecord:
    """What an insert primitive returns per input task, in input order: the stored record (the
    new one, or the one already holding that id) and whether this call created it."""

    record: Record
    inserted: bool


@dataclass(frozen=True)
class QueueCounts:
    """What a stats primitive returns: counts per status and, over due PENDING tasks, the age in
    seconds of the oldest one by the store's clock (None or 0 when none is due)."""

    counts: StatusCounts
    oldest_due_age_seconds: float | None


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
    def _claim(self, queue: str, limit: int, lease_seconds: float) -> Sequence[Record]:
        """Flip up to ``limit`` due PENDING tasks to IN_FLIGHT atomically; claimed records."""

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
    def _dead_page(self, selection: DeadSelection, limit: int) -> Sequence[Record]:
        """Up to ``limit`` selected dead records (with attempts) ordered by ``(dead_at, id)``,
        after ``selection.after``."""

    @abc.abstractmethod
    def _redrive(self, selection: DeadSelection) -> int:
        """Selected DEAD → PENDING due now, budget reset, ``redrive_count + 1``; the count."""

    @abc.abstractmethod
    def _purge_dead(self, selection: DeadSelection) -> int:
        """Delete selected dead tasks and their history; the count."""

    @abc.abstractmethod
    def _stats(self, queue: str) -> QueueCounts:
        """Counts per status and the oldest due PENDING task's age."""

    @abc.abstractmethod
    def _queues(self) -> Sequence[str]:
        """Names of queues that hold at least one task."""

    @abc.abstractmethod
    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` SUCCEEDED/CANCELLED tasks last updated before the cutoff."""

    # -- the SPI ---------------------------------------------------------------------------
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
            inserted = self._insert(requests, connection)
        results: list[EnqueueResult] = []
        seen: set[str] = set()
        for request, row in zip(requests, inserted, strict=True):
            # A repeat of an id within one batch is an idempotent repeat, never a second create.
            created = row.inserted and request.id not in seen
            seen.add(request.id)
            task = self.codec.task(row.record)  # an existing task keeps its history, if the record carries it
            results.append(EnqueueResult(task=task, created=created, conflict=not created and task.queue != request.queue))
        return results

    def claim(self, queue: str, limit: int, lease_seconds: float) -> list[ClaimedTask]:
        _require_text(queue, "queue")
        if limit <= 0:
            return []
        with self.translated_errors():
            records = self._claim(queue, int(limit), float(lease_seconds))
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
        for item in items:
            if item.status not in _SETTLED_STATUSES:
                raise InvalidInput(f"cannot settle task {item.task_id} as {item.status}", field="status")
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
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInput("limit must be a positive integer", field="limit")
        after = decode_dead_cursor(queue, cursor) if cursor is not None else None
        selection = self._selection(queue, filter, after)
        if selection.matches_nothing:
            return DeadPage(tasks=(), next_cursor=None)
        # One record beyond the page tells whether another page exists.
        with self.translated_errors():
            records = self._dead_page(selection, limit + 1)
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
        _require_text(queue, "queue")
        with self.translated_errors():
            found = self._stats(queue)
        counts = {str(status): int(n) for status, n in found.counts.items()}
        return QueueStats(
            queue=queue,
            pending=counts.get(TaskStatus.PENDING.value, 0),
            in_flight=counts.get(TaskStatus.IN_FLIGHT.value, 0),
            dead=counts.get(TaskStatus.DEAD.value, 0),
            succeeded=counts.get(TaskStatus.SUCCEEDED.value, 0),
            cancelled=counts.get(TaskStatus.CANCELLED.value, 0),
            oldest_pending_age_seconds=max(0.0, float(found.oldest_due_age_seconds or 0.0)),
        )

    def list_queues(self) -> list[str]:
        with self.translated_errors():
            return sorted(set(self._queues()))

    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        if limit <= 0:
            return 0
        with self.translated_errors():
            return self._purge_finished(max(0.0, float(older_than_seconds)), int(limit))

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _selection(queue: str, filter: DeadFilter, after: tuple[int, str] | None = None) -> DeadSelection:
        _require_text(queue, "queue")
        for field in ("error_type", "handler"):
            if getattr(filter, field) is not None:
                _require_text(getattr(filter, field), field)
        ids = None
        if filter.ids is not None:
            for task_id in filter.ids:
                _require_text(task_id, "ids")
            ids = tuple(dict.fromkeys(filter.ids))  # order kept, repeats dropped
        return DeadSelection(queue=queue, ids=ids, error_type=filter.error_type, handler=filter.handler, after=after)


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


def _require_refs(refs: Sequence[ClaimRef] | Sequence[Settlement]) -> None:
    for ref in refs:
        _require_text(ref.task_id, "task_id")
        _require_text(ref.claim_token, "claim_token")


_SETTLED_STATUSES = frozenset({TaskStatus.SUCCEEDED, TaskStatus.PENDING, TaskStatus.DEAD})


def _require_text(value: Any, field: str) -> None:
    # A request value must never reach a store as anything but text: {"$gt": ""} as an id would
    # read as a query operator on a document store.
    if not isinstance(value, str):
        raise InvalidInput(f"{field} must be a string", field=field)
