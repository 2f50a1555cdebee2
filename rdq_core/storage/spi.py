"""The storage SPI: the one interface every backend implements.

Contract (held by the compliance kit, ``rdq_core.compliance``):

* **Clock.** The backend's clock is the only time authority for due-ness, leases and
  timestamps (``now()``, Redis ``TIME``, the MongoDB server time, SQLite's clock). Durations
  (delays, leases) come in as seconds and are added to the backend's now.
* **Atomic claim.** ``claim`` flips up to ``limit`` due PENDING tasks of one queue (oldest
  ``next_attempt_at`` first) to IN_FLIGHT in one atomic step, stamping ``claimed_at``,
  ``lease_expires_at = now + lease``, the claimer's name (``claimed_by``, shown only while
  IN_FLIGHT) and a fresh, never-reused claim token per task. No two
  concurrent claims may ever return the same task.
* **Fencing.** Every post-claim write (``settle``, ``extend_leases``, ``release``) presents
  ``(task_id, claim_token)``. A token that does not match an IN_FLIGHT task changes nothing for
  that task; after applying the valid items the call raises ``StaleClaim`` naming the refused
  ids. ``settle`` of a LEASE_EXPIRED outcome is additionally refused while the lease has not
  expired by the backend clock (a worker that extended in time keeps its task).
* **History.** ``settle`` appends the attempt with ``attempt_no = MAX(attempt_no) + 1`` over
  that task's history, computed by the store inside the same atomic step -- never from
  ``attempt_count``, which is only the retry budget and is reset by redrive. Attempts are
  unique on ``(task_id, attempt_no)``.
* **Batches.** Enqueue, claim, settle, release, extend and the expired-lease scan take many
  tasks per call and cost a constant number of round trips per call, not per task. Tasks
  returned by ``claim`` and ``find_expired_leases`` carry no attempt history (``attempts`` is
  empty): the engine never needs it there, and loading it would make claims cost per history
  row. ``get`` and ``list_dead`` return the full history.
* **Text.** Strings in a ``Settlement`` (error type, message and stack; strings inside the
  result) are stored with every lone UTF-16 surrogate replaced by U+FFFD (``storable_text``):
  a handler that echoes an undecodable file name (``os.fsdecode(b"report-\\xff.csv")``) must
  not make its batch fail with an encoding error on one backend and not on another.
* **Bounded calls.** Every call either completes or raises ``StorageUnavailable`` within a
  bounded time (connect, statement and socket timeouts, overridable from the URL), so a
  half-open connection can never hang a claim loop.
* **Worker slots.** ``take_worker_slot`` / ``renew_worker_slot`` / ``free_worker_slot`` cap how
  many workers of a fleet run at once, leased and fenced like claims; ``reserve_worker_starts``
  counts workers being invoked against the same cap before they run; written once over the engine
  documents (``slots.py``), so a store that keeps the documents' compare-and-set promise has them.
* **Idempotent enqueue.** An id that exists on the same queue is a no-op that returns the
  existing task (``created=False``) and changes nothing; on another queue it is a conflict.

* **Guards.** Empty batches touch nothing. ``claim``, ``find_expired_leases`` and
  ``purge_succeeded`` with ``limit <= 0`` return nothing; ``list_dead`` with ``limit < 1`` raises
  ``InvalidInput``; a request value that is not a string where one is expected is
  ``InvalidInput``; ``connection=`` on a store that cannot join it is ``UnsupportedOperation``.

The engine decides (policy, backoff, error classification); the backend applies. Backends
never compute retry policy. The built-in backends implement this contract through
``core.StorageCore``, which owns the shared behaviour, writing only store primitives.

**Shape.** This module imports only leaves: the value types (``values.py``), the cursors
(``cursors.py``), and ``slots.py`` and ``rollup.py``, which are written over a
``values.DocumentStore`` rather than this class; so the default slot and chart methods below
delegate to them with plain imports, and nothing in storage imports back up into the SPI except
the core and the backends that implement it.
"""

from __future__ import annotations

import abc
import json
from datetime import datetime
from typing import Any, ClassVar, Mapping, Protocol, Sequence

from ..errors import UnsupportedOperation
from ..events import EventSettings, OutboxEvent
from ..flow import NO_FLOW, FlowPolicy
from ..model import (
    AuditEntry,
    Document,
    AuditPage,
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    ErrorInfo,
    NewTask,
    QueueStats,
    Settlement,
    Task,
    TaskFilter,
    TaskPage,
    TaskStatus,
)
from ..validation import without_lone_surrogates
from . import rollup, slots
# Re-exported: the SPI's names for its value types and cursors, which live in leaves of their own.
from .cursors import decode_audit_cursor as decode_audit_cursor
from .cursors import decode_dead_cursor as decode_dead_cursor
from .cursors import decode_task_cursor as decode_task_cursor
from .cursors import encode_audit_cursor as encode_audit_cursor
from .cursors import encode_dead_cursor as encode_dead_cursor
from .cursors import encode_task_cursor as encode_task_cursor
from .cursors import from_micros as from_micros
from .cursors import to_micros as to_micros
from .values import LiveQueueStats as LiveQueueStats
from .values import WorkerSlot as WorkerSlot  # the SPI's slot type
from .values import WorkerStart as WorkerStart  # a reserved (pending) start


class EnqueueListener(Protocol):
    """One connection that hears enqueues (``Storage.enqueue_listener``); used by one thread."""

    def receive(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds; the queues enqueued into since the last call (empty
        when none). Raises (``StorageUnavailable`` or the driver's error) when the connection is
        lost: the caller opens a new listener."""

    def close(self) -> None:
        """Drop the connection."""


class OpenTransaction(Protocol):
    """A database transaction a handler's effects and its task's completion share
    (``Storage.begin_transaction``; driven by ``rdq_core.engine.transactions``)."""

    #: The DB-API connection the transaction is open on (the application's, or the store's own).
    connection: Any

    def commit(self) -> None:
        """Commit, and give back a connection the store lent. Raises when the commit failed (its
        fate may then be unknown: the fenced completion inside it keeps a retry safe)."""

    def rollback(self) -> None:
        """Roll back (never raises for a connection already broken), and give back a lent one."""


class Storage(abc.ABC):
    """A connection to one rdq store. Thread-safe: one instance may serve many threads."""

    #: URL schemes this backend serves, e.g. ``("postgresql", "postgres")``.
    schemes: ClassVar[tuple[str, ...]] = ()

    #: Statements / commands / script calls sent to the server so far (benchmarks read it).
    round_trips: int = 0

    #: Seconds an idle ``rdq worker`` waits between claims unless configured otherwise; an
    #: enqueue ends the wait early on a store with an ``enqueue_listener``.
    idle_poll_seconds: float = 1.0

    # -- lifecycle -------------------------------------------------------------------------
    @abc.abstractmethod
    def migrate(self) -> None:
        """Create or upgrade the schema (tables, indexes, scripts). Idempotent and versioned."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The instance is unusable afterwards."""

    def close_idle_connections(self) -> int:
        """Close the connections not in use now; the next call opens one again. A Lambda worker
        calls it as its invocation ends, so a frozen environment keeps no connection open.
        Returns how many were closed (0 where a store keeps nothing worth closing)."""
        return 0

    @abc.abstractmethod
    def now(self) -> datetime:
        """The backend clock (timezone-aware UTC)."""

    # -- producer side ---------------------------------------------------------------------
    @abc.abstractmethod
    def enqueue(self, tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        """Insert tasks as PENDING, idempotently, in one round trip; results in input order.

        ``connection`` lets a backend that supports it (``joins_transactions``: PostgreSQL, SQLite)
        write inside the caller's open transaction without committing it. Others raise
        ``UnsupportedOperation`` (a ``TypeError``) when it is given.
        """

    # -- worker side -----------------------------------------------------------------------
    @abc.abstractmethod
    def claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy = NO_FLOW, *,
              worker: str = "") -> list[ClaimedTask]:
        """Atomically claim up to ``limit`` due PENDING tasks of ``queue`` (see module doc),
        lowest priority first, then by due time, within the queue's ``flow`` policy
        (docs/flow-control.md).

        ``worker`` names the claimer (printable, at most ``Limits.worker_chars`` characters, else
        ``InvalidInput`` and nothing claimed); it is stored with each claim in the same atomic
        step, read back as ``Task.claimed_by`` while the task is IN_FLIGHT, and '' stores none."""

    @abc.abstractmethod
    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        """Set ``lease_expires_at = max(lease_expires_at, now + lease_seconds)`` for each
        still-held claim, computed by the store in the same atomic step as the fence check.

        An extension never moves an expiry earlier: a short extension (a heartbeat that asks
        for less than the lease still has left) leaves the lease as it is. Returns the
        resulting expiry per task id -- the later of the two, as stored -- and raises
        ``StaleClaim`` for refused refs (after applying the others).
        """

    @abc.abstractmethod
    def settle(self, settlements: Sequence[Settlement]) -> None:
        """Apply the engine's decisions (see ``Settlement``); raises ``StaleClaim`` for refused items."""

    @abc.abstractmethod
    def release(self, refs: Sequence[ClaimRef]) -> None:
        """Return claimed-but-unstarted tasks to PENDING: no attempt row, budget unchanged,
        ``next_attempt_at`` unchanged. Raises ``StaleClaim`` for refused refs."""

    def enqueue_listener(self, queues: Sequence[str]) -> "EnqueueListener | None":
        """A new listener told of enqueues into ``queues`` (empty: every queue) as they commit,
        or None when this store cannot push (the worker polls then). Best-effort: a listener may
        miss or repeat a wake-up, never make an enqueue fail. See ``rdq_core.engine.wakeup``."""
        return None

    # -- reaper side -----------------------------------------------------------------------
    @abc.abstractmethod
    def find_expired_leases(self, limit: int, queue: str | None = None) -> list[ClaimedTask]:
        """Up to ``limit`` IN_FLIGHT tasks whose lease expired by the backend clock, oldest
        expiry first, with the claim token they are held under. Read-only: the reaper then
        settles them with outcome LEASE_EXPIRED, fenced by that token, so two reapers racing
        record exactly one LEASE_EXPIRED attempt."""

    # -- operator side ---------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, task_id: str) -> Task | None:
        """The task with its full attempt history (ordered by attempt_no), or None."""

    @abc.abstractmethod
    def cancel(self, task_id: str) -> Task:
        """PENDING -> CANCELLED. ``TaskNotFound`` if absent, ``TaskConflict`` if not PENDING."""

    @abc.abstractmethod
    def list_dead(
        self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()
    ) -> DeadPage:
        """Dead tasks of ``queue`` ordered by ``(dead_at, id)``, with attempts.

        Paging is keyset-based (see ``encode_dead_cursor``): every task that is dead when paging
        starts and stays dead appears exactly once, however many tasks die meanwhile.
        """

    @abc.abstractmethod
    def redrive(self, queue: str, filter: DeadFilter) -> int:
        """DEAD -> PENDING, due now: ``attempt_count = 0``, ``redrive_count += 1``, history kept."""

    @abc.abstractmethod
    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        """Delete matching DEAD tasks and their attempts; returns the count."""

    @abc.abstractmethod
    def stats(self, queue: str) -> QueueStats:
        """Counts per status and the age of the oldest due PENDING task (``now -
        min(next_attempt_at)`` over due tasks; 0 when none is due). Cheap: index lookups."""

    def live_stats(self, queue: str) -> LiveQueueStats:
        """``stats`` without the finished counts: PENDING, IN_FLIGHT and DEAD counts, the oldest
        due age and the paused flag, read at a cost in proportion to the queue's live work (a
        backend answers it from indexes that hold only those statuses), not to every task ever
        kept. The per-minute gauges and the worker's fan-out read this."""
        found = self.stats(queue)
        return LiveQueueStats(found.queue, found.pending, found.in_flight, found.dead,
                              found.oldest_pending_age_seconds, found.paused)

    @abc.abstractmethod
    def list_queues(self) -> list[str]:
        """Names of queues that hold at least one task."""

    def queue_overview(self) -> list[QueueStats]:
        """``stats`` of every queue that holds a task or is paused, by name. A backend may read
        what the queues share (the paused set) once instead of once per queue."""
        return [self.stats(queue) for queue in sorted(set(self.list_queues()) | self.paused_queues())]

    @abc.abstractmethod
    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        """Retention: delete up to ``limit`` SUCCEEDED and CANCELLED tasks (with attempts) last
        updated more than ``older_than_seconds`` ago. Returns the count deleted."""

    @abc.abstractmethod
    def list_tasks(
        self, queue: str, *, status: TaskStatus | None = None, limit: int, cursor: str | None = None,
        filter: TaskFilter = TaskFilter(),
    ) -> TaskPage:
        """Tasks of ``queue`` (in ``status``, or in every status), keyset-paged, without attempts.

        Within a status the order is that status's instant, then id: PENDING by
        ``next_attempt_at``, IN_FLIGHT by ``lease_expires_at``, DEAD by ``dead_at``, SUCCEEDED and
        CANCELLED by ``updated_at``. Without a status the statuses come one after another in that
        order. A task that stays in its status (and keeps its instant) while the pages are read
        appears exactly once. Each page costs store work in proportion to its size (plus what a
        handler or error-type filter skips).
        """

    @abc.abstractmethod
    def count_tasks(self, queue: str, status: TaskStatus, filter: TaskFilter = TaskFilter()) -> int:
        """How many tasks of ``queue`` in ``status`` the filter matches (a bulk action's dry run)."""

    @abc.abstractmethod
    def cancel_selected(self, queue: str, filter: TaskFilter) -> int:
        """PENDING -> CANCELLED for every PENDING task of ``queue`` the filter matches; the count."""

    @abc.abstractmethod
    def set_paused(self, queue: str, paused: bool) -> None:
        """Pause or resume a queue. Once this returns, no claim of that queue returns a task until
        it is resumed; enqueues are accepted meanwhile, and claimed tasks run to their end."""

    @abc.abstractmethod
    def paused_queues(self) -> set[str]:
        """Names of the paused queues (whether or not they hold tasks)."""

    # -- engine documents ------------------------------------------------------------------
    @abc.abstractmethod
    def get_document(self, kind: str, key: str) -> Document | None:
        """A document the engine keeps (see ``Document``), or None."""

    @abc.abstractmethod
    def put_document(self, kind: str, key: str, body: Mapping[str, Any], *, expected_version: int | None) -> Document | None:
        """Compare-and-set, atomic: ``expected_version=None`` inserts only if absent; a version
        replaces only while the stored one is that version. The stored document, or None when
        the condition failed (someone else wrote first)."""

    @abc.abstractmethod
    def delete_document(self, kind: str, key: str, *, expected_version: int) -> bool:
        """Delete only while the stored version is ``expected_version``; whether it was deleted."""

    @abc.abstractmethod
    def list_documents(self, kind: str, *, limit: int, after: str | None = None) -> list[Document]:
        """Documents of ``kind`` by key (byte order), after ``after``."""

    # -- worker slots (a concurrency cap the store enforces; ``slots.py``) ---------------------
    # Built on the engine documents above, so every store has them without code of its own.
    def take_worker_slot(self, fleet: str, cap: int, lease_seconds: float) -> WorkerSlot | None:
        """Take one of ``fleet``'s ``cap`` slots for ``lease_seconds`` (by this store's clock),
        atomically against every other taker, under a fresh token; None when ``cap`` slots are
        held. A slot is free when never taken, freed, or its lease expired. Slots at or above a
        lowered cap are never taken, and count as held until their holders end, so no more than
        ``cap`` holders run at any instant. A full fleet costs one read."""
        return slots.take_worker_slot(self, fleet, cap, lease_seconds)

    def renew_worker_slot(self, slot: WorkerSlot, lease_seconds: float) -> WorkerSlot | None:
        """Set the lease to now + ``lease_seconds`` while ``slot.token`` holds the slot and its
        lease has not run out; the renewed slot, or None (nothing changed)."""
        return slots.renew_worker_slot(self, slot, lease_seconds)

    def free_worker_slot(self, slot: WorkerSlot) -> bool:
        """Free the slot while ``slot.token`` holds it; a stale token changes nothing (False)."""
        return slots.free_worker_slot(self, slot)

    def worker_slots_held(self, fleet: str) -> int:
        """How many of ``fleet``'s slots are held now (those above a lowered cap, and pending
        starts, included)."""
        return slots.worker_slots_held(self, fleet)

    def reserve_worker_starts(self, fleet: str, cap: int, lease_seconds: float, *, fleet_size: int,
                              most: int | None = None) -> list[WorkerStart]:
        """Reserve free slots for workers about to be invoked (*pending starts*, leased for
        ``lease_seconds``), so that held and pending slots reach ``min(fleet_size, cap)``, at most
        ``most`` of them new. One starter decides at a time per fleet; one that finds another
        deciding reserves nothing. A reservation counts against the cap like a held slot."""
        return slots.reserve_worker_starts(self, fleet, cap, lease_seconds, fleet_size=fleet_size, most=most)

    def take_reserved_worker_slot(self, start: WorkerStart, lease_seconds: float) -> WorkerSlot | None:
        """The invoked worker takes over its reservation: the slot held for ``lease_seconds``
        under a fresh token; None when it is no longer pending under ``start.token``."""
        return slots.take_reserved_worker_slot(self, start, lease_seconds)

    def cancel_worker_start(self, start: WorkerStart) -> bool:
        """Give back a reservation whose worker will not come; fenced by its token."""
        return slots.cancel_worker_start(self, start)

    def worker_starts_pending(self, fleet: str) -> int:
        """How many of ``fleet``'s held slots are reservations not yet taken over."""
        return slots.worker_starts_pending(self, fleet)

    @abc.abstractmethod
    def record_audit(self, *, actor: str, action: str, queue: str, selection: Any, count: int) -> AuditEntry:
        """Append one operator action to the audit trail, stamped by the store's clock."""

    @abc.abstractmethod
    def list_audit(self, *, queue: str | None = None, limit: int, cursor: str | None = None) -> AuditPage:
        """Audit entries (of ``queue``, or all) newest first, keyset-paged by ``(at, id)``."""

    # -- per-minute metrics for the console's charts (``rollup.py``) ----------------------------
    # Kept in engine documents by the maintenance pass, read from them: no backend code of its own.
    def roll_up_metrics(self, as_of: datetime | None = None) -> int:
        """The maintenance step: count the minutes closed since the last pass (tasks finished,
        retries, per-handler durations and failures, depth) and delete those past a day; the
        number of minute documents written. ``as_of`` stands for the store's clock."""
        raise UnsupportedOperation(f"{type(self).__name__} keeps no per-minute metrics")

    def queue_metrics(self, queue: str, window: str = "hour", as_of: datetime | None = None) -> dict[str, Any]:
        """``queue``'s series per minute over ``window`` ("hour" or "day") up to the minute before
        ``as_of`` (default: the store's now); see ``rollup.queue_series``."""
        return rollup.queue_series(self, queue, window, as_of)

    def metrics_overview(self, window: str = "hour", as_of: datetime | None = None) -> dict[str, Any]:
        """Every queue's finished tasks per minute over ``window``, summed, with per-queue totals."""
        return rollup.overview_series(self, window, as_of)

    # -- lifecycle events (the outbox; rdq_core/events.py) ----------------------------------
    @abc.abstractmethod
    def configure_events(self, settings: EventSettings) -> None:
        """Which events this store writes from now on (by default, ``EventSettings.from_env()``
        when the first write needs it). Task events are written by ``settle`` and ``redrive`` in
        the same atomic step as the change."""

    @abc.abstractmethod
    def record_events(self, events: Sequence[OutboxEvent]) -> None:
        """Put events into the outbox (an event id already there is kept as it is)."""

    @abc.abstractmethod
    def take_events(self, limit: int, *, lease_seconds: float) -> list[OutboxEvent]:
        """Up to ``limit`` outbox events not leased to another deliverer, oldest first (so the
        events of one task come in the order they were written), each leased to the caller for
        ``lease_seconds``: no other ``take_events`` returns them until the lease passes."""

    @abc.abstractmethod
    def ack_events(self, ids: Sequence[str]) -> int:
        """Remove delivered events from the outbox; how many were there."""

    # -- exactly-once effects: completing a task inside a database transaction ----------------
    #: The store can write inside an application's open transaction: ``enqueue(connection=)``
    #: and ``begin_transaction`` / ``settle_in_transaction`` (PostgreSQL, SQLite).
    joins_transactions: ClassVar[bool] = False

    def begin_transaction(self, connection: Any = None) -> OpenTransaction:
        """Open a transaction on ``connection`` (the application's, of the kind ``enqueue``
        accepts, with no transaction in progress) or on one of the store's own. Stores that
        cannot join transactions raise ``UnsupportedOperation``."""
        raise UnsupportedOperation(f"{type(self).__name__} cannot complete a task inside a database transaction")

    def settle_in_transaction(self, connection: Any, settlement: Settlement) -> bool:
        """Apply ``settlement`` as ``settle`` would, fenced by its claim token, inside the open
        transaction on ``connection``, without committing it. False when the claim no longer
        holds (nothing was written); the caller then rolls back."""
        raise UnsupportedOperation(f"{type(self).__name__} cannot complete a task inside a database transaction")

    # -- conveniences built on the primitives ------------------------------------------------
    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- text every store can hold -----------------------------------------------------------------
# Python strings may carry lone UTF-16 surrogates (os.fsdecode of undecodable bytes does that).
# No store can encode them: SQLite and PostgreSQL want UTF-8, BSON too, jsonb rejects "\ud800".
# Settlement text is diagnostic or a handler's result; storing U+FFFD in place of the broken
# code point beats failing the whole batch.

#: ``value`` with each lone surrogate replaced by U+FFFD (one implementation, in validation).
storable_text = without_lone_surrogates


def storable_json(value: Any) -> str:
    """Compact JSON text of ``value`` (non-ASCII kept as is), made storable by ``storable_text``.

    Repairing the encoded text fixes strings and object keys alike without walking the value.
    """
    return storable_text(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def storable_error(error: ErrorInfo | None) -> ErrorInfo | None:
    if error is None:
        return None
    return ErrorInfo(
        type=storable_text(error.type),
        message=storable_text(error.message or ""),
        stack=None if error.stack is None else storable_text(error.stack),
    )
