"""Bulk operations as jobs: a redrive, purge or cancel over a selection that runs in the
background, in bounded, rate-limited chunks, and survives the death of whoever runs it.

An operation is an engine document (``Storage.put_document``, compare-and-set on a version) of
kind ``operation``; a second document of kind ``operation-lock``, keyed by the queue, names the
one operation running on that queue. Starting one::

    count what the selection matches (the dry run)   → ``matched``
    take the queue's lock (insert if absent; a lock naming a finished operation is replaced)
    write the operation (RUNNING, cursor none, done 0) and an audit entry

Advancing one (the reaper, ``rdq dev`` and ``rdq reaper`` call ``drive_operations``)::

    reserve the next chunk's slot in the document (compare-and-set): ``n`` tasks at
        ``rate_per_second`` take n / rate seconds, so slots never overlap, whoever advances
    list the next ``n`` selected tasks after the cursor (the DLQ's or the task listing's keyset)
    act on exactly those ids (redrive / purge / cancel)          ← a crash here …
    record the new cursor and the count (compare-and-set, retried on a concurrent write)

… is harmless: the chunk is listed again from the old cursor, and the tasks it already acted on
no longer match (a redriven or purged task is not DEAD; a cancelled one is not PENDING), so no
task is acted on twice. A redrive or purge takes only tasks dead when the operation started
(``dead_at <= started_at``): a task redriven by it that dies again is not redriven again by the
same operation. A cancel takes what is PENDING as it goes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Callable, Mapping

from .errors import InvalidInput, TaskConflict, TaskNotFound
from .events import operation_finished_event
from .ids import new_sequential_id
from . import payloads
from .model import Task, TaskFilter, TaskStatus
from .storage.spi import Storage

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
        rate = data.get("rate_per_second")
        return cls(
            id=data["id"], action=data["action"], queue=data["queue"], selection=dict(data.get("selection") or {}),
            status=data["status"], matched=int(data.get("matched") or 0), done=int(data.get("done") or 0),
            rate_per_second=None if rate is None else float(rate), cursor=data.get("cursor"),
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
    if rate_per_second is not None:
        if isinstance(rate_per_second, bool) or not isinstance(rate_per_second, (int, float)) \
                or not 0 < rate_per_second <= 100_000 or not math.isfinite(rate_per_second):
            raise InvalidInput("rate_per_second must be a number in (0, 100000]", "rate_per_second")
        rate_per_second = float(rate_per_second)
    matched = storage.count_tasks(queue, _status_of(action), selection)
    now = storage.now()
    operation = Operation(
        id=new_sequential_id(), action=action, queue=queue, selection=selection.described(all), status=RUNNING,
        matched=matched, rate_per_second=rate_per_second, actor=actor, started_at=now, updated_at=now,
        next_chunk_at=now,
    )
    _take_lock(storage, operation)
    stored = storage.put_document(OPERATION, operation.id, operation._body(), expected_version=None)
    if stored is None:  # pragma: no cover - a fresh sequential id cannot exist
        raise TaskConflict(f"operation {operation.id} exists")
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
            document = storage.get_document(OPERATION, str(lock.body.get("operation")))
            if document is not None and document.body.get("status") == RUNNING:
                found.append(Operation.from_dict(document.body, document.version))
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
    _release_lock(storage, cancelled)
    storage.record_audit(actor=actor, action="cancel_operation", queue=cancelled.queue,
                         selection={"operation": cancelled.id}, count=cancelled.done)
    return cancelled


# -- advancing -----------------------------------------------------------------------------------
@dataclass
class DriveReport:
    chunks: int = 0
    acted: int = 0
    finished: list[str] = field(default_factory=list)


def drive_operations(storage: Storage, *, deadline: float, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], object] = time.sleep) -> DriveReport:
    """Advance every running operation, chunk by chunk at its rate, until all are finished or
    ``deadline`` (on ``clock``) is near. Returns at once when nothing runs."""
    report = DriveReport()
    while clock() < deadline:
        running = list_operations(storage, running_only=True, limit=1000)
        if not running:
            return report
        wait = math.inf
        for operation in running:
            if clock() >= deadline:
                return report
            advanced, acted, ready_in = advance_operation(storage, operation)
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
    chunk = MAX_CHUNK if operation.rate_per_second is None else \
        max(1, min(MAX_CHUNK, int(operation.rate_per_second * CHUNK_SECONDS)))
    slot = max(now, operation.next_chunk_at or now)
    if slot > now:
        return operation, None, (slot - now).total_seconds()
    duration = timedelta(seconds=chunk / operation.rate_per_second) if operation.rate_per_second else timedelta(0)
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
        _release_lock(storage, after)
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
        return payloads.purge_dead_tasks(storage, operation.queue, tasks)
    chosen = TaskFilter(ids=tuple(t.id for t in tasks))
    if operation.action == "redrive":
        return storage.redrive(operation.queue, chosen)
    return storage.cancel_selected(operation.queue, chosen)


# -- the documents -------------------------------------------------------------------------------
def _take_lock(storage: Storage, operation: Operation) -> None:
    body = {"operation": operation.id}
    for _ in range(_CAS_ATTEMPTS):
        if storage.put_document(LOCK, operation.queue, body, expected_version=None) is not None:
            return
        lock = storage.get_document(LOCK, operation.queue)
        if lock is None:
            continue  # released meanwhile: try to insert again
        holder = storage.get_document(OPERATION, str(lock.body.get("operation")))
        if holder is not None and holder.body.get("status") == RUNNING:
            raise TaskConflict(f"operation {holder.key} ({holder.body.get('action')}) is running on queue "
                               f"{operation.queue!r}; cancel it or wait for it to finish")
        # The lock names a finished operation (or one whose start did not complete): take it over.
        if storage.put_document(LOCK, operation.queue, body, expected_version=lock.version) is not None:
            return
    raise TaskConflict(f"another operation is starting on queue {operation.queue!r}; retry")


def _release_lock(storage: Storage, operation: Operation) -> None:
    lock = storage.get_document(LOCK, operation.queue)
    if lock is not None and lock.body.get("operation") == operation.id:
        storage.delete_document(LOCK, operation.queue, expected_version=lock.version)


def _update(storage: Storage, operation_id: str, change: Callable[[Operation], Operation]) -> Operation:
    """Apply ``change`` to the freshest version of the document (compare-and-set, retried)."""
    for _ in range(_CAS_ATTEMPTS):
        current = get_operation(storage, operation_id)
        wanted = change(current)
        if wanted == current and wanted.next_chunk_at == current.next_chunk_at:
            return current
        if wanted.finished and not current.finished:
            # rdq.operation.finished goes into the outbox right before the final compare-and-set,
            # not after it: a crash between the two then leaves an event for an operation the next
            # pass finishes (the event id is the operation's, so it is written once), never a
            # finished operation without its event. A losing compare-and-set is retried, and its
            # event (same id) stands as first written.
            storage.record_events([operation_finished_event(wanted)])
        stored = storage.put_document(OPERATION, operation_id, wanted._body(), expected_version=current.version)
        if stored is not None:
            return replace(wanted, version=stored.version)
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
