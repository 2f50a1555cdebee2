"""Bulk operations as jobs: a redrive, purge or cancel over a selection that runs in the
background, in bounded, rate-limited chunks, and survives the death of whoever runs it.

An operation is an engine document (``Storage.put_document``, compare-and-set on a version) of
kind ``operation``; a second document of kind ``operation-lock``, keyed by the queue, says which
operation holds the queue. Starting one::

    count what the selection matches (the dry run)   → ``matched``
    take the queue's lock in ONE single-document write: insert it, or compare-and-set over a
        lock that is free; the lock carries the whole new operation (``start``)
    write the operation document from that body (RUNNING, cursor none, done 0), and an audit entry

The lock is the one place where "who runs on this queue" is decided, by the store's own atomic
insert or compare-and-set, so of any number of concurrent starters exactly one wins. A lock is
free when it is released, or when the operation it names is finished. A lock naming an operation
whose document is not written yet is never free: the start it carries is written by whoever reads
it (a starter that died after taking the lock leaves a RUNNING operation the next maintenance pass
drives, not a queue locked forever, and not a second operation). Locks are replaced, never
deleted, so their versions only grow and a stale compare-and-set cannot succeed (no ABA).

Advancing one (the reaper, ``rdq dev`` and ``rdq reaper`` call ``drive_operations``)::

    reserve the next chunk's slot in the document (compare-and-set): ``n`` tasks at
        ``rate_per_second`` take n / rate seconds, so slots never overlap, whoever advances;
        the slot is also the runner's lease: a runner that dies leaves it to lapse, then the
        next pass takes the chunk again
    list the next ``n`` selected tasks after the cursor (the DLQ's or the task listing's keyset)
    act on exactly those ids (redrive / purge / cancel)          ← a crash here …
    record the new cursor and the count (compare-and-set, retried on a concurrent write)

… is harmless: the chunk is listed again from the old cursor, and the tasks it already acted on
no longer match (a redriven or purged task is not DEAD; a cancelled one is not PENDING), so no
task is acted on twice. A redrive or purge takes only tasks dead when the operation started
(``dead_at <= started_at``): a task redriven by it that dies again is not redriven again by the
same operation. A cancel takes what is PENDING as it goes.

Finishing (the last chunk, or a cancel) is the compare-and-set that moves the document out of
RUNNING; of a racing cancel and last chunk exactly one wins. Only the winner, after winning,
writes ``rdq.operation.finished`` (from the document it stored) and then releases the lock; a
crash between the two leaves the lock naming a finished operation, and whoever next reads that
lock writes the event from the stored document before taking or releasing it. So the event always
says what the stored operation says.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Callable, Mapping

from ..errors import InvalidInput, OperationStillRunning, TaskConflict, TaskNotFound
from ..events import operation_finished_event
from ..ids import new_sequential_id
from . import payload_retention
from .. import validation
from ..model import Document, Task, TaskFilter, TaskStatus
from ..storage.spi import Storage

log = logging.getLogger(__name__)

OPERATION, LOCK = "operation", "operation-lock"
ACTIONS = ("redrive", "purge", "cancel")
RUNNING, SUCCEEDED, CANCELLED = "RUNNING", "SUCCEEDED", "CANCELLED"
#: Tasks one chunk acts on at most (one listing and one bulk write).
MAX_CHUNK = 500
#: How long one chunk's slot lasts at the operation's rate: chunks are sized to fill it.
CHUNK_SECONDS = 0.5
#: Compare-and-set retries before a write gives up (each retry re-reads the document).
_CAS_ATTEMPTS = 8
#: The longest one chunk's slot can be: one task at the slowest rate. A stored slot further away
#: than this (a clock jump, a hand-edited document) is pulled back to it.
MAX_SLOT = timedelta(seconds=1 / validation.Limits.operation_rate_min)


@dataclass(frozen=True)
class Operation:
    id: str
    action: str
    queue: str
    selection: Mapping[str, Any]
    status: str
    matched: int
    done: int = 0
    rate_per_second: float | None = None
    cursor: str | None = None
    actor: str = "local"
    started_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    #: When the next chunk may start (the rate limit's slot), by the store's clock.
    next_chunk_at: datetime | None = None
    version: int = field(default=0, compare=False)

    @property
    def finished(self) -> bool:
        return self.status != RUNNING

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "action": self.action, "queue": self.queue, "selection": dict(self.selection),
            "status": self.status, "matched": self.matched, "done": self.done,
            "rate_per_second": self.rate_per_second, "actor": self.actor,
            "started_at": _iso(self.started_at), "updated_at": _iso(self.updated_at),
            "finished_at": _iso(self.finished_at),
        }

    def _body(self) -> dict[str, Any]:
        return {**self.to_dict(), "cursor": self.cursor, "next_chunk_at": _iso(self.next_chunk_at)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], version: int = 0) -> "Operation":
        return cls(
            id=data["id"], action=data["action"], queue=data["queue"], selection=dict(data.get("selection") or {}),
            status=data["status"], matched=int(data.get("matched") or 0), done=int(data.get("done") or 0),
            rate_per_second=_stored_rate(data.get("rate_per_second")), cursor=data.get("cursor"),
            actor=str(data.get("actor") or "local"), started_at=_parse(data.get("started_at")),
            updated_at=_parse(data.get("updated_at")), finished_at=_parse(data.get("finished_at")),
            next_chunk_at=_parse(data.get("next_chunk_at")), version=version,
        )


# -- starting, reading, cancelling ---------------------------------------------------------------
def start_operation(storage: Storage, *, action: str, queue: str, selection: TaskFilter, all: bool = False,
                    rate_per_second: float | None = None, actor: str = "local") -> Operation:
    """Start a background ``action`` over ``selection`` of ``queue`` (validated by the caller);
    ``TaskConflict`` when another operation is running on that queue."""
    if action not in ACTIONS:
        raise InvalidInput(f"action must be one of {', '.join(ACTIONS)}", "action")
    rate_per_second = validation.operation_rate(rate_per_second)
    matched = storage.count_tasks(queue, _status_of(action), selection)
    now = storage.now()
    operation = Operation(
        id=new_sequential_id(), action=action, queue=queue, selection=selection.described(all), status=RUNNING,
        matched=matched, rate_per_second=rate_per_second, actor=actor, started_at=now, updated_at=now,
        next_chunk_at=now,
    )
    _take_lock(storage, operation)
    # The lock already carries this start: a reader of the lock may have written the document
    # from it first (the same body), which is as good.
    stored = storage.put_document(OPERATION, operation.id, operation._body(), expected_version=None) \
        or storage.get_document(OPERATION, operation.id)
    if stored is None:  # pragma: no cover - operation documents are never deleted
        raise TaskConflict(f"operation {operation.id} vanished while starting; retry")
    storage.record_audit(actor=actor, action=action, queue=queue,
                         selection={**operation.selection, "operation": operation.id,
                                    **({"rate_per_second": rate_per_second} if rate_per_second else {})},
                         count=matched)
    log.info("operation started", extra={"operation": operation.id, "action": action, "queue": queue,
                                         "matched": matched})
    return replace(operation, version=stored.version)


def get_operation(storage: Storage, operation_id: str) -> Operation:
    document = storage.get_document(OPERATION, _checked_id(operation_id))
    if document is None:
        raise TaskNotFound(operation_id, what="operation")
    return Operation.from_dict(document.body, document.version)


def list_operations(storage: Storage, *, queue: str | None = None, limit: int = 50,
                    running_only: bool = False) -> list[Operation]:
    """Operations newest first (of ``queue``, or all), up to ``limit``."""
    found: list[Operation] = []
    if running_only:
        for lock in _all(storage, LOCK):
            if lock.body.get("released"):
                continue
            document = storage.get_document(OPERATION, str(lock.body.get("operation")))
            start = lock.body.get("start")
            if document is not None and document.body.get("status") == RUNNING:
                found.append(Operation.from_dict(document.body, document.version))
            elif document is None and isinstance(start, Mapping):  # started, document not written yet
                found.append(Operation.from_dict(start))
    else:
        found = [Operation.from_dict(d.body, d.version) for d in _all(storage, OPERATION)]
    found = [op for op in found if queue is None or op.queue == queue]
    return sorted(found, key=lambda op: op.id, reverse=True)[:limit]


def cancel_operation(storage: Storage, operation_id: str, *, actor: str = "local") -> Operation:
    """Stop a running operation after the chunk in progress; what it already did stays done."""
    operation = get_operation(storage, operation_id)
    if operation.finished:
        raise TaskConflict(f"operation {operation_id} is {operation.status}, not RUNNING")
    now = storage.now()
    cancelled = _update(storage, operation_id, lambda op: replace(op, status=CANCELLED, finished_at=now, updated_at=now)
                        if not op.finished else op)
    if cancelled.status != CANCELLED:
        raise TaskConflict(f"operation {operation_id} is {cancelled.status}, not RUNNING")
    storage.record_audit(actor=actor, action="cancel_operation", queue=cancelled.queue,
                         selection={"operation": cancelled.id}, count=cancelled.done)
    return cancelled


def wait_until_finished(get: Callable[[str], Operation], operation_id: str, *, timeout: float, poll: float,
                        still_running: Callable[[str], Exception] | None = None,
                        clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep) -> Operation:
    """Read ``operation_id`` through ``get`` every ``poll`` seconds until it is finished; past
    ``timeout`` seconds raise ``still_running(message)`` (default ``OperationStillRunning``).

    Both clients wait through this one loop; they differ only in how they read an operation."""
    deadline = clock() + timeout
    while True:
        operation = get(operation_id)
        if operation.finished:
            return operation
        if clock() + poll > deadline:
            message = (f"operation {operation_id} is still {operation.status} after {timeout:g}s "
                       f"({operation.done} of {operation.matched} done)")
            raise (still_running or OperationStillRunning)(message)
        sleep(poll)


# -- advancing -----------------------------------------------------------------------------------
@dataclass
class DriveReport:
    chunks: int = 0
    acted: int = 0
    finished: list[str] = field(default_factory=list)
    #: Operations that raised while advancing (each logged; tried again by the next pass).
    failed: list[str] = field(default_factory=list)


def drive_operations(storage: Storage, *, deadline: float, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], object] = time.sleep) -> DriveReport:
    """Advance every running operation, chunk by chunk at its rate, until all are finished or
    ``deadline`` (on ``clock``) is near. Returns at once when nothing runs."""
    report = DriveReport()
    failed: set[str] = set()
    while clock() < deadline:
        running = [op for op in _running(storage, failed, report) if op.id not in failed]
        if not running:
            return report
        wait = math.inf
        for operation in running:
            if clock() >= deadline:
                return report
            try:
                advanced, acted, ready_in = advance_operation(storage, operation)
            except Exception as exc:  # noqa: BLE001 - one bad operation must not stop the others
                # Skipped for the rest of this call (the next pass tries it again), and logged
                # without its selection: ids and error type only.
                failed.add(operation.id)
                report.failed.append(operation.id)
                log.error("operation could not advance", extra={
                    "operation": operation.id, "queue": operation.queue, "action": operation.action,
                    "error_type": type(exc).__name__, "error": str(exc)[:200]})
                continue
            if acted is not None:
                report.chunks += 1
                report.acted += acted
            if advanced.finished:
                report.finished.append(advanced.id)
            else:
                wait = min(wait, ready_in)
        if wait == math.inf:
            continue
        pause = min(max(wait, 0.0), deadline - clock())
        if pause > 0:
            sleep(pause)
    return report


def advance_operation(storage: Storage, operation: Operation) -> tuple[Operation, int | None, float]:
    """One chunk, if its slot has come: ``(operation after, tasks acted on or None, seconds until
    the next slot)``."""
    now = storage.now()
    rate = operation.rate_per_second  # within the validated bounds: see _stored_rate
    chunk = MAX_CHUNK if rate is None else max(1, min(MAX_CHUNK, int(rate * CHUNK_SECONDS)))
    # At most MAX_SLOT ahead: a stored slot beyond it cannot stall the operation for good.
    slot = min(max(now, operation.next_chunk_at or now), now + MAX_SLOT)
    if slot > now:
        return operation, None, (slot - now).total_seconds()
    duration = timedelta(seconds=chunk / rate) if rate else timedelta(0)
    # Reserve the slot: a second advancer reading the same version loses the compare-and-set.
    reserved = storage.put_document(OPERATION, operation.id, replace(operation, next_chunk_at=slot + duration)._body(),
                                    expected_version=operation.version)
    if reserved is None:
        return get_operation(storage, operation.id), None, 0.0
    operation = Operation.from_dict(reserved.body, reserved.version)
    tasks, next_cursor, exhausted = _next_chunk(storage, operation, chunk)
    acted = _act(storage, operation, tasks) if tasks else 0

    def progress(op: Operation) -> Operation:
        if op.finished:  # cancelled meanwhile: keep the status, count what this chunk did
            return replace(op, done=op.done + acted)
        moved = replace(op, done=op.done + acted, cursor=next_cursor if next_cursor is not None else op.cursor,
                        updated_at=now)
        return replace(moved, status=SUCCEEDED, finished_at=now) if exhausted else moved

    after = _update(storage, operation.id, progress)
    if exhausted and after.status == SUCCEEDED:
        log.info("operation finished", extra={"operation": after.id, "action": after.action, "queue": after.queue,
                                              "done": after.done})
    ready_in = 0.0 if after.next_chunk_at is None else max(0.0, (after.next_chunk_at - now).total_seconds())
    return after, acted, ready_in


def _next_chunk(storage: Storage, operation: Operation, chunk: int) -> tuple[list[Task], str | None, bool]:
    """The tasks of the next chunk, the cursor after it, and whether the selection is exhausted."""
    selection = _filter(operation.selection)
    status = _status_of(operation.action)
    page = storage.list_tasks(operation.queue, status=status, limit=chunk, cursor=operation.cursor, filter=selection)
    if status is TaskStatus.PENDING:
        return list(page.tasks), page.next_cursor, page.next_cursor is None
    started = operation.started_at
    tasks = [t for t in page.tasks if started is None or (t.dead_at is not None and t.dead_at <= started)]
    # Ordered by dead_at: once one died after the start, every later one did too.
    exhausted = page.next_cursor is None or len(tasks) < len(page.tasks)
    return tasks, page.next_cursor, exhausted


def _act(storage: Storage, operation: Operation, tasks: list[Task]) -> int:
    if operation.action == "purge":
        # Purged with their large-payload and result objects (those still dead when purged).
        return payload_retention.purge_dead_tasks(storage, operation.queue, tasks)
    chosen = TaskFilter(ids=tuple(t.id for t in tasks))
    if operation.action == "redrive":
        return storage.redrive(operation.queue, chosen)
    return storage.cancel_selected(operation.queue, chosen)


# -- the documents -------------------------------------------------------------------------------
def _take_lock(storage: Storage, operation: Operation) -> None:
    """Hold ``operation.queue`` for ``operation``, decided by one atomic write of the lock
    document (an insert, or a compare-and-set over a free lock); ``TaskConflict`` otherwise."""
    body = {"operation": operation.id, "start": operation._body(), "released": False}
    for _ in range(_CAS_ATTEMPTS):
        if storage.put_document(LOCK, operation.queue, body, expected_version=None) is not None:
            return
        lock = storage.get_document(LOCK, operation.queue)
        if lock is None:
            continue  # deleted by an older release: insert again
        holder = _holder(storage, lock)
        if holder is not None:
            raise TaskConflict(f"operation {holder.id} ({holder.action}) is running on queue "
                               f"{operation.queue!r}; cancel it or wait for it to finish")
        # Free: replace it at the version read. A concurrent starter that read the same version
        # loses this compare-and-set and, reading again, finds this operation running.
        if storage.put_document(LOCK, operation.queue, body, expected_version=lock.version) is not None:
            return
    raise TaskConflict(f"another operation is starting on queue {operation.queue!r}; retry")


def _holder(storage: Storage, lock: Document) -> Operation | None:
    """The RUNNING operation ``lock`` holds its queue for, or None when the lock is free.

    Brings the lock's operation up to date on the way: a start whose document is missing is
    written from the lock (so it runs), and a finished operation gets its event (written once
    per id; a no-op when its finisher already wrote it)."""
    if lock.body.get("released"):
        return None
    operation_id = str(lock.body.get("operation"))
    document = storage.get_document(OPERATION, operation_id)
    if document is None:
        start = lock.body.get("start")
        if not isinstance(start, Mapping):
            return None  # a lock from before locks carried their start: nothing can run it
        document = storage.put_document(OPERATION, operation_id, start, expected_version=None) \
            or storage.get_document(OPERATION, operation_id)
        if document is None:  # pragma: no cover - operation documents are never deleted
            return Operation.from_dict(start)
    operation = Operation.from_dict(document.body, document.version)
    if operation.finished:
        storage.record_events([operation_finished_event(operation)])
        return None
    return operation


def _running(storage: Storage, skip: set[str], report: DriveReport) -> list[Operation]:
    """The operations holding a queue, for a maintenance pass: each lock is brought up to date
    (see ``_holder``) and one naming a finished operation is released. A lock that cannot be read
    or settled is logged and left to the next pass; the others go on."""
    running: list[Operation] = []
    for lock in _all(storage, LOCK):
        if lock.body.get("released") or str(lock.body.get("operation")) in skip:
            continue
        try:
            holder = _holder(storage, lock)
            if holder is None:
                _release(storage, lock)
            else:
                running.append(holder)
        except Exception as exc:  # noqa: BLE001 - one bad lock must not stop the other queues
            skip.add(str(lock.body.get("operation")))
            report.failed.append(str(lock.body.get("operation")))
            log.error("operation lock could not be settled", extra={
                "queue": lock.key, "operation": str(lock.body.get("operation")),
                "error_type": type(exc).__name__, "error": str(exc)[:200]})
    return running


def _release(storage: Storage, lock: Document) -> None:
    """Mark ``lock`` free (a compare-and-set: a lock taken meanwhile stays taken). Replaced, not
    deleted, so the lock's version keeps growing."""
    storage.put_document(LOCK, lock.key, {"operation": lock.body.get("operation"), "released": True},
                         expected_version=lock.version)


def _finish(storage: Storage, operation: Operation) -> None:
    """After winning the compare-and-set that finished ``operation``: its event, from what was
    stored, then its queue's lock. A crash in between leaves the lock for ``_holder`` to settle."""
    storage.record_events([operation_finished_event(operation)])
    lock = storage.get_document(LOCK, operation.queue)
    if lock is not None and lock.body.get("operation") == operation.id and not lock.body.get("released"):
        _release(storage, lock)


def _update(storage: Storage, operation_id: str, change: Callable[[Operation], Operation]) -> Operation:
    """Apply ``change`` to the freshest version of the document (compare-and-set, retried)."""
    for _ in range(_CAS_ATTEMPTS):
        current = get_operation(storage, operation_id)
        wanted = change(current)
        if wanted == current and wanted.next_chunk_at == current.next_chunk_at:
            return current
        stored = storage.put_document(OPERATION, operation_id, wanted._body(), expected_version=current.version)
        if stored is not None:
            done = replace(wanted, version=stored.version)
            if done.finished and not current.finished:
                # This write is the one that finished it: rdq.operation.finished follows it, so
                # the event says what won (a racing writer's status never reaches the outbox).
                _finish(storage, done)
            return done
    raise TaskConflict(f"operation {operation_id} is being written concurrently; retry")


def _all(storage: Storage, kind: str) -> list[Any]:
    documents: list[Any] = []
    after = None
    while True:
        page = storage.list_documents(kind, limit=500, after=after)
        documents += page
        if len(page) < 500:
            return documents
        after = page[-1].key


# -- helpers -------------------------------------------------------------------------------------
def _stored_rate(value: Any) -> float | None:
    """A stored rate brought into the validated bounds, whatever was stored (a document written
    before the bounds existed, or by hand): advancing never meets a rate its arithmetic cannot
    take. Anything that is not a usable number becomes the slowest rate, never "unlimited"."""
    if value is None:
        return None
    low, high = validation.Limits.operation_rate_min, validation.Limits.operation_rate_max
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return low
    if not math.isfinite(rate):
        return high if rate == math.inf else low
    return min(max(rate, low), high)


def _status_of(action: str) -> TaskStatus:
    return TaskStatus.PENDING if action == "cancel" else TaskStatus.DEAD


def _filter(selection: Mapping[str, Any]) -> TaskFilter:
    ids = selection.get("ids")
    return TaskFilter(ids=None if ids is None else tuple(ids), error_type=selection.get("error_type"),
                      handler=selection.get("handler"))


def _checked_id(operation_id: Any) -> str:
    if not isinstance(operation_id, str) or not 0 < len(operation_id) <= 64 or not operation_id.isalnum():
        raise InvalidInput("an operation id is the id rdq returned when the operation started", "operation_id")
    return operation_id


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _parse(value: Any) -> datetime | None:
    return None if not value else datetime.fromisoformat(value)
