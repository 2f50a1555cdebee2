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

**Where each part lives.** ``StorageCore`` is composed of one part per resource, each declaring
the primitives it calls and the SPI methods it implements over them, as the compliance kit is
organised: the task lifecycle (enqueue, claim, fencing, settle, transactions, get, cancel) here;
``core_browsing.py`` (the DLQ and browsing), ``core_operator.py`` (counts, queues, retention,
pausing, audit), ``core_documents.py`` (engine documents), ``core_outbox.py`` (lifecycle events),
all on ``core_base.py`` (codec, clock, error translation). The values passed to and from the
primitives are in ``primitives.py``, the request checks in ``guards.py``: leaves, so the chart
rollup can page through tasks without importing the core. A backend derives from ``StorageCore``
alone and writes every primitive.
"""

from __future__ import annotations

import abc
from dataclasses import replace
from datetime import datetime
from typing import Any, Mapping, Sequence

from ..errors import InvalidInput, StaleClaim, TaskConflict, TaskNotFound, UnsupportedOperation
from ..flow import NO_FLOW, FlowPolicy
from ..model import ClaimedTask, ClaimRef, EnqueueResult, NewTask, Outcome, Settlement, Task, TaskStatus
from ..validation import worker_name
from . import rollup
from .codec import Record
from .core_base import CoreBase
from .core_browsing import BrowsingCore
from .core_documents import DocumentsCore
from .core_operator import OperatorCore
from .core_outbox import OutboxCore
from .guards import require_text as _require_text
from .spi import OpenTransaction, storable_error

# Re-exported: the values the primitives take and return (``primitives.py``), by their old names.
from .primitives import DEFAULT_DEDUPE_STATES as DEFAULT_DEDUPE_STATES
from .primitives import LISTING_ORDER as LISTING_ORDER
from .primitives import LIVE_STATUSES as LIVE_STATUSES
from .primitives import ORDER_FIELD as ORDER_FIELD
from .primitives import DeadSelection as DeadSelection
from .primitives import InsertedRecord as InsertedRecord
from .primitives import QueueCounts as QueueCounts
from .primitives import Selection as Selection
from .primitives import StatusCounts as StatusCounts
from .primitives import dedupe_states_of as dedupe_states_of


class StorageCore(OperatorCore, BrowsingCore, DocumentsCore, OutboxCore, CoreBase, abc.ABC):
    """The SPI's behaviour over a backend's primitives (see the module doc): the task lifecycle
    here, each other resource in its own part."""

    # -- primitives a backend writes (one atomic store operation each) -----------------------
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
    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy,
               worker: str) -> Sequence[Record]:
        """Flip up to ``limit`` due PENDING tasks to IN_FLIGHT atomically, in claim order and
        within ``flow`` (docs/flow-control.md), storing ``worker`` as each one's ``claimed_by``
        in the same step ('' stores none, replacing an earlier claim's); claimed records."""

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

    # -- the SPI ---------------------------------------------------------------------------
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

    def claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy = NO_FLOW, *,
              worker: str = "") -> list[ClaimedTask]:
        _require_text(queue, "queue")
        worker_name(worker)
        if limit <= 0:
            return []
        with self.translated_errors():
            records = self._claim(queue, int(limit), float(lease_seconds), flow, worker)
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

    # -- helpers ---------------------------------------------------------------------------

    def roll_up_metrics(self, as_of: datetime | None = None) -> int:
        # Over the listings' keyset pages (with history) and the engine documents: every built-in
        # backend has it without code of its own (rollup.py).
        return rollup.roll_up(self, self._history_page, as_of)


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

