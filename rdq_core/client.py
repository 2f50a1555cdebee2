"""The producer and operator client: the public Python interface to a store.

```python
from rdq_core import Client

rdq = Client("postgresql://…")        # or Client() for $RDQ_STORAGE_URL / the SQLite default
task = rdq.enqueue("emails", "send_email", {"to": "a@b.c"}, id="order-42")
rdq.enqueue_many("emails", [{"handler": "send_email", "payload": {...}}])   # one round trip
rdq.get(task.id).attempts
rdq.stats("emails").pending
```
Every argument is validated here (``InvalidInput``) before anything is written.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Unpack

from .engine import payload_retention, payloads as payload_objects
from .engine import operations, tracecontext
from . import validation
from .client_protocol import EnqueueOptions, QueueClient, check_enqueue_options
from .errors import InvalidCursor, InvalidInput, TaskNotFound
from .engine.new_tasks import build_new_task, build_new_tasks, written_or_conflict
from .engine.operations import Operation
from .model import (
    AuditPage,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    NewTask,
    QueueStats,
    Task,
    TaskPage,
    TaskStatus,
)
from .storage import open_storage
from .storage.spi import Storage, decode_dead_cursor, to_micros

#: Who an operator action is recorded as when the caller does not say: a process on this machine
#: talking to the store directly (the CLI, a script). The API names the caller's IAM principal or
#: API key instead.
LOCAL_ACTOR = "local"


class Client:
    """``actor`` is who the audit trail records for the operator actions this client takes
    (redrive, purge, cancel, pause, resume)."""

    def __init__(self, storage: str | Storage | None = None, *, actor: str = LOCAL_ACTOR,
                 payload_store: payload_objects.PayloadStore | None | bool = True) -> None:
        self.storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self._owns_storage = not isinstance(storage, Storage)
        self.actor = actor
        # -- large payloads (rdq_core/engine/payloads.py): True = the process's store ($RDQ_PAYLOAD_BUCKET
        # or $RDQ_PAYLOAD_DIR), None/False = none (payloads stay inline, 256 KiB at most).
        self._payload_store = payload_store

    def close(self) -> None:
        if self._owns_storage:
            self.storage.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- producing -------------------------------------------------------------------------
    def enqueue(
        self,
        queue: str,
        handler: str,
        payload: Any = None,
        *,
        connection: Any = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> Task:
        """Enqueue one task; an existing id on the same queue returns the existing task.

        ``options`` are the task's fields, grouped in ``rdq_core.client_protocol`` (``TaskOptions``,
        ``FlowOptions``: docs/flow-control.md, ``DedupeOptions``); a keyword outside them is a
        ``TypeError``. Raises ``TaskConflict`` if ``id`` is taken on another queue. ``connection``
        (PostgreSQL; SQLite: a sqlite3 connection to the store's file) writes inside the caller's open
        transaction. ``traceparent``/``tracestate`` (W3C) are the trace the task continues; by
        default the current OpenTelemetry span's (docs/handlers.md, "Tracing"); an invalid one is
        dropped, never refused.
        """
        fields = {"handler": handler, "payload": payload, **check_enqueue_options(options)}
        (item,), uploaded = self._offloaded(queue, [fields], single=True)
        (item,) = tracecontext.stamped([item], tracecontext.enqueue_headers(traceparent, tracestate))
        try:
            result = self.enqueue_new(item, connection=connection)
        except BaseException:
            self._forget_uploads(uploaded)
            raise
        self._forget_uploads(uploaded, [result])
        return result.task

    def enqueue_many(
        self, queue: str, items: Sequence[Mapping[str, Any]], *, connection: Any = None,
        traceparent: str | None = None, tracestate: str | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue up to ``Limits.batch_items`` tasks in one round trip; per-item results. Every
        task carries one trace context, as ``enqueue`` chooses it."""
        new_tasks, uploaded = self._offloaded(queue, items)
        new_tasks = tracecontext.stamped(list(new_tasks), tracecontext.enqueue_headers(traceparent, tracestate))
        try:
            results = self.enqueue_new_many(new_tasks, connection=connection)
        except BaseException:
            self._forget_uploads(uploaded)
            raise
        self._forget_uploads(uploaded, results)
        return results

    def enqueue_new(self, new_task: NewTask, *, connection: Any = None) -> EnqueueResult:
        """Write one task already validated by ``build_new_task``; ``created`` is False when the id
        already existed on this queue (nothing was written).

        Raises ``TaskConflict`` if the id is taken on another queue. The message names neither that
        queue nor the task's state: over HTTP a caller allowed on one queue reads it (docs/security.md).
        """
        (result,) = self.enqueue_new_many([new_task], connection=connection)
        return written_or_conflict(new_task, result)

    def enqueue_new_many(self, new_tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        """Write tasks already validated by ``build_new_tasks`` in one round trip; per-item results,
        a conflict included (``conflict=True``), never raised."""
        if connection is not None:
            return self.storage.enqueue(new_tasks, connection=connection)
        return self.storage.enqueue(new_tasks)

    # -- reading and operating -------------------------------------------------------------
    def get(self, task_id: str, *, resolve: bool = False) -> Task:
        """The task with its history. A payload or result kept in the payload store is a reference
        (``headers["rdq.payload_ref"]``, ``{"$rdq_s3": …}``); ``resolve=True`` fetches and checks them."""
        validation.task_id(task_id)
        task = self.storage.get(task_id)
        if task is None:
            raise TaskNotFound(task_id)
        if resolve:
            return payload_objects.resolved(task, self.payload_store)
        return task

    def cancel(self, task_id: str) -> Task:
        task = self.storage.cancel(validation.task_id(task_id))
        self._audit("cancel", task.queue, {"ids": [task.id]}, 1)
        payload_objects.finished(task, self.payload_store)  # its payload object expires with retention
        return task

    def stats(self, queue: str) -> QueueStats:
        return self.storage.stats(validation.queue_name(queue))

    def list_queues(self) -> list[QueueStats]:
        """Every queue that holds at least one task or is paused, by name, with its counts (one
        stats call per queue: index lookups each)."""
        return self.storage.queue_overview()

    def list_tasks(
        self,
        queue: str,
        *,
        status: TaskStatus | str | None = None,
        handler: str | None = None,
        error_type: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> TaskPage:
        """One page of a queue's tasks (without attempt history), in one status or in all; see
        ``Storage.list_tasks`` for the order. ``next_cursor`` fetches the next page."""
        return self.storage.list_tasks(
            validation.queue_name(queue), status=task_status(status), limit=validation.page_size(limit),
            cursor=_cursor_text(cursor), filter=dead_filter(error_type=error_type, handler=handler),
        )

    def list_dead(
        self,
        queue: str,
        *,
        limit: int = 50,
        cursor: str | None = None,
        error_type: str | None = None,
        handler: str | None = None,
    ) -> DeadPage:
        queue = validation.queue_name(queue)
        if cursor is not None:
            _check_cursor(queue, cursor)
        return self.storage.list_dead(
            queue,
            limit=validation.page_size(limit),
            cursor=cursor,
            filter=dead_filter(error_type=error_type, handler=handler),
        )

    def redrive(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        """Dead tasks matching the selection -> PENDING (due now, budget reset, history kept);
        the count. ``dry_run`` counts them and changes nothing."""
        return self._bulk("redrive", TaskStatus.DEAD, self.storage.redrive, queue, ids, error_type, handler, all, dry_run)

    def purge_dead(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                   handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        """Delete the dead tasks matching the selection, with their history; the count. Their
        payload and result objects in the payload store are deleted with them."""
        if self.payload_store is not None and not dry_run:
            return self._purge_dead_with_objects(queue, ids, error_type, handler, all)
        return self._bulk("purge", TaskStatus.DEAD, self.storage.purge_dead, queue, ids, error_type, handler, all,
                          dry_run)

    def cancel_selected(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                        handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        """Cancel every PENDING task matching the selection (claimed ones run on); the count."""
        return self._bulk("cancel", TaskStatus.PENDING, self.storage.cancel_selected, queue, ids, error_type, handler,
                          all, dry_run)

    def pause(self, queue: str) -> QueueStats:
        """Workers claim nothing from ``queue`` until it is resumed; enqueues are still accepted
        and tasks already claimed run to their end."""
        return self._set_paused(queue, True)

    def resume(self, queue: str) -> QueueStats:
        return self._set_paused(queue, False)

    def list_audit(self, *, queue: str | None = None, limit: int = 50, cursor: str | None = None) -> AuditPage:
        """Operator actions, newest first: who, what, which queue and selection, how many tasks."""
        return self.storage.list_audit(
            queue=None if queue is None else validation.queue_name(queue), limit=validation.page_size(limit),
            cursor=_cursor_text(cursor),
        )

    # -- bulk operations as jobs (rdq_core/engine/operations.py) -------------------------------------
    def start_operation(self, action: str, queue: str, *, ids: Iterable[str] | None = None,
                        error_type: str | None = None, handler: str | None = None, all: bool = False,
                        rate_per_second: float | None = None) -> Operation:
        """Start ``action`` (redrive, purge or cancel) over the selection in the background, in
        bounded chunks at ``rate_per_second`` (default: as fast as chunks go), advanced by the
        reaper. ``TaskConflict`` when an operation is already running on the queue."""
        selection = _selection(ids, error_type, handler, all)
        return operations.start_operation(self.storage, action=action, queue=validation.queue_name(queue),
                                          selection=selection, all=all, rate_per_second=rate_per_second,
                                          actor=self.actor)

    def get_operation(self, operation_id: str) -> Operation:
        return operations.get_operation(self.storage, operation_id)

    def list_operations(self, *, queue: str | None = None, limit: int = 50) -> list[Operation]:
        """Operations newest first, of ``queue`` or of every queue."""
        return operations.list_operations(self.storage, queue=None if queue is None else validation.queue_name(queue),
                                          limit=validation.page_size(limit))

    def cancel_operation(self, operation_id: str) -> Operation:
        return operations.cancel_operation(self.storage, operation_id, actor=self.actor)

    def wait_for_operation(self, operation_id: str, *, timeout: float = 3600.0, poll: float = 1.0) -> Operation:
        """Poll until the operation is finished; ``OperationStillRunning`` past ``timeout`` seconds.
        A reaper advances it (``rdq dev``, ``rdq worker``, ``rdq reaper``, the Lambda reaper):
        with none running, it stays where it is."""
        return operations.wait_until_finished(self.get_operation, operation_id, timeout=timeout, poll=poll)

    # -- large payloads (rdq_core/engine/payloads.py) ------------------------------------------------
    @property
    def payload_store(self) -> payload_objects.PayloadStore | None:
        """Where payloads over the threshold go; None keeps every payload inline."""
        store = self._payload_store
        if store is True:
            return payload_objects.default_store()
        return store or None

    def enqueue_item(self, queue: str, item: Mapping[str, Any], *, connection: Any = None) -> EnqueueResult:
        """One task from its fields (those ``build_new_task`` takes), a payload over the threshold
        written to the payload store first; the ``EnqueueResult`` (``created`` False for a repeat)."""
        (new_task,), uploaded = self._offloaded(queue, [item], single=True)
        (new_task,) = tracecontext.stamped([new_task], tracecontext.enqueue_headers())  # as enqueue chooses it
        try:
            result = self.enqueue_new(new_task, connection=connection)
        except BaseException:
            self._forget_uploads(uploaded)
            raise
        self._forget_uploads(uploaded, [result])
        return result

    def _offloaded(self, queue: str, items: Sequence[Mapping[str, Any]], *, single: bool = False
                   ) -> tuple[list[NewTask], list[payload_objects.PayloadRef | None]]:
        """Validate ``items`` (payloads over the threshold as null), then write those payloads to
        the store: the tasks carry references instead. Nothing is written if validation fails."""
        store = self.payload_store
        large = [isinstance(item, Mapping) and payload_objects.should_offload(item.get("payload"), store)
                 for item in items] if isinstance(items, Sequence) else []
        slim = [{**item, "payload": None} if big else item for item, big in zip(items, large, strict=True)
                ] if any(large) else items
        new_tasks = [build_new_task(queue, slim[0])] if single else build_new_tasks(queue, slim)
        if not any(large):
            return new_tasks, []
        refs: list[payload_objects.PayloadRef | None] = []
        try:
            for index, (item, big) in enumerate(zip(items, large, strict=True)):
                if not big:
                    refs.append(None)
                    continue
                assert store is not None
                try:
                    ref = payload_objects.offload_payload(store, queue, item.get("payload"), new_tasks[index].id)
                except InvalidInput as exc:
                    raise (exc if single else
                           InvalidInput(f"tasks[{index}]: {exc}", f"tasks[{index}].{exc.field}")) from None
                refs.append(ref)
                new_tasks[index] = payload_objects.with_ref(new_tasks[index], ref)
        except BaseException:
            self._forget_uploads(refs)
            raise
        return new_tasks, refs

    def _forget_uploads(self, refs: Sequence[payload_objects.PayloadRef | None],
                        results: Sequence[EnqueueResult] | None = None) -> None:
        """Delete the objects no task points at: all of them when the write failed, else those of
        ids that already existed (an idempotent repeat keeps the first task's object) -- except one
        a deduplicated request's ``replace`` put on the task it matched."""
        if not refs:
            return
        unused = [ref for index, ref in enumerate(refs)
                  if ref is not None and (results is None or not _points_at(results[index], ref))]
        try:
            payload_retention.delete_objects(self.payload_store, unused)
        except Exception:  # noqa: BLE001 - an orphan object costs storage, never the enqueue's answer
            payload_objects.log.warning("could not delete %d unused payload object(s)", len(unused))

    def _purge_dead_with_objects(self, queue: str, ids: Iterable[str] | None, error_type: str | None,
                                 handler: str | None, all: bool) -> int:
        """Purge page by page: read up to 500 matching dead tasks (the bounded extra read), purge
        exactly those ids, then delete the objects of the ones that are gone."""
        queue = validation.queue_name(queue)
        selection = _selection(ids, error_type, handler, all)
        store = self.payload_store
        total = 0
        if selection.ids is not None:
            pages: Iterable[list[Task]] = [[t for t in map(self.storage.get, selection.ids)
                                           if t is not None and t.queue == queue and t.status is TaskStatus.DEAD]]
        else:
            pages = self._dead_pages(queue, selection)
        for page in pages:
            if not page:
                break
            total += payload_retention.purge_dead_tasks(self.storage, queue, page, store)
        self._audit("purge", queue, selection.described(all), total)
        return total

    def _dead_pages(self, queue: str, selection: DeadFilter) -> Iterable[list[Task]]:
        """The first page of the matching dead tasks, again and again: each page is purged before
        the next is read, so the loop ends when none is left."""
        while True:
            page = self.storage.list_dead(queue, limit=validation.Limits.page_size, cursor=None,
                                          filter=DeadFilter(error_type=selection.error_type, handler=selection.handler))
            yield list(page.tasks)
            if not page.tasks:
                return

    # -- what the operator actions share -------------------------------------------------------
    def _bulk(self, action: str, status: TaskStatus, act: Any, queue: str, ids: Iterable[str] | None,
              error_type: str | None, handler: str | None, all: bool, dry_run: bool) -> int:
        queue = validation.queue_name(queue)
        if not isinstance(dry_run, bool):
            raise InvalidInput("dry_run must be true or false", "dry_run")
        selection = _selection(ids, error_type, handler, all)
        if dry_run:
            return self.storage.count_tasks(queue, status, selection)
        count: int = act(queue, selection)
        self._audit(action, queue, selection.described(all), count)
        return count

    def _set_paused(self, queue: str, paused: bool) -> QueueStats:
        queue = validation.queue_name(queue)
        self.storage.set_paused(queue, paused)
        self._audit("pause" if paused else "resume", queue, {}, 0)
        return self.storage.stats(queue)

    # -- schedules (rdq_core.engine.schedules) ----------------------------------------------------
    @property
    def schedule_book(self) -> Any:
        """Where schedules live: EventBridge Scheduler on a deployed API (``RDQ_SCHEDULE_GROUP``),
        else the local schedules file (``RDQ_SCHEDULES_FILE``, default ``./rdq-schedules.json``)."""
        from .engine.schedules import schedule_book_from_env

        if getattr(self, "_schedule_book", None) is None:
            self._schedule_book = schedule_book_from_env()
        return self._schedule_book

    @schedule_book.setter
    def schedule_book(self, book: Any) -> None:
        self._schedule_book = book

    def put_schedule(self, definition: Any) -> Any:
        """Create or replace a schedule (a ``Schedule`` or its fields as a mapping); returns it as stored."""
        from .engine.schedules import put_schedule

        stored = put_schedule(self.schedule_book, definition)
        self._audit("schedule", stored.queue, {"schedule": stored.name, "expression": stored.expression}, 0)
        return stored

    def list_schedules(self) -> list[Any]:
        """Every schedule, by name."""
        return list(self.schedule_book.list())

    def delete_schedule(self, name: str) -> None:
        """Delete a schedule; ``ScheduleNotFound`` (a ``TaskNotFound``) if there is none by that name."""
        from .engine.schedules import delete_schedule

        queue = next((s.queue for s in self.schedule_book.list() if s.name == name), None)
        delete_schedule(self.schedule_book, name)
        if queue is not None:
            self._audit("unschedule", queue, {"schedule": name}, 0)

    def _audit(self, action: str, queue: str, selection: Mapping[str, Any], count: int) -> None:
        # After the action: the entry records what it did (the count). A failure here surfaces to
        # the caller, who can see in the task states that the action itself took place.
        self.storage.record_audit(actor=self.actor, action=action, queue=queue, selection=selection, count=count)


def _points_at(result: EnqueueResult, ref: payload_objects.PayloadRef) -> bool:
    """Whether the task an enqueue answered with refers to the uploaded object ``ref``."""
    return result.created or result.task.headers.get(payload_objects.REF_HEADER) == ref.to_header()


def dead_filter(*, ids: Iterable[str] | None = None, error_type: str | None = None, handler: str | None = None) -> DeadFilter:
    if error_type is not None and (not isinstance(error_type, str) or not 0 < len(error_type) <= 256
                                   or not validation.storable_text(error_type)):
        raise InvalidInput("error_type must be a string of 1..256 characters (valid Unicode, no NUL)", "error_type")
    if handler is not None:
        validation.handler_name(handler)
    checked_ids = None
    if ids is not None:
        checked_ids = tuple(validation.task_id(i, "ids") for i in ids)
        if not 1 <= len(checked_ids) <= validation.Limits.batch_items:
            raise InvalidInput(f"ids holds 1..{validation.Limits.batch_items} task ids", "ids")
    return DeadFilter(ids=checked_ids, error_type=error_type, handler=handler)


#: The keyset instant of a cursor must be one every backend can hold (datetime's own range).
_CURSOR_MICROS = (to_micros(datetime(1, 1, 1, tzinfo=timezone.utc)),
                  to_micros(datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)))


def _check_cursor(queue: str, cursor: Any) -> None:
    """A cursor is opaque but comes back from the caller: a forged one (instant out of range, an id
    no task can have) is refused as ``InvalidCursor`` here instead of overflowing in a backend."""
    micros, after_id = decode_dead_cursor(queue, cursor)
    if not _CURSOR_MICROS[0] <= micros <= _CURSOR_MICROS[1] or not validation.TASK_ID.fullmatch(after_id):
        raise InvalidCursor()


def _selection(ids: Iterable[str] | None, error_type: str | None, handler: str | None, all: bool) -> DeadFilter:
    """Bulk actions act on an explicit selection: ids, a filter, or ``all=True``."""
    if not isinstance(all, bool):
        raise InvalidInput("all must be true or false", "all")
    if ids is None and error_type is None and handler is None and not all:
        raise InvalidInput("select tasks by ids, error_type/handler, or all", "ids")
    return dead_filter(ids=ids, error_type=error_type, handler=handler)


def task_status(status: Any) -> TaskStatus | None:
    """A listing's status: None (every status), a ``TaskStatus``, or its name."""
    if status is None or isinstance(status, TaskStatus):
        return status
    if isinstance(status, str) and status in TaskStatus._value2member_map_:
        return TaskStatus(status)
    raise InvalidInput(f"status must be one of {', '.join(s.value for s in TaskStatus)}", "status")


def _cursor_text(cursor: Any) -> str | None:
    """A cursor is opaque, but it comes back from the caller: beyond its length bound it is refused
    before any decoding (the store's decoder then checks what it holds)."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 1024:
        raise InvalidCursor()
    return cursor


if TYPE_CHECKING:  # mypy proves Client is a QueueClient (rdq_core/client_protocol.py); nothing runs here
    def _conforms(client: Client) -> QueueClient:
        return client
