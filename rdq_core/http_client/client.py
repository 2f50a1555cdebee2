"""``HttpClient``: ``Client``'s methods over the rdq API (``transport.py`` carries them).

Methods, signatures, return types and exceptions are ``Client``'s (mypy and
tests/unit/test_client_protocol.py check both against ``client_protocol.QueueClient``). The
differences are in the package's text (``rdq_core/http_client/__init__.py``).
"""

from __future__ import annotations

import enum
import hashlib
import os
import urllib.parse
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Unpack

from ..client_protocol import EnqueueOptions, QueueClient, check_enqueue_options
from ..engine import operations, tracecontext
from ..engine import payloads as payload_objects
from ..engine.operations import Operation
from ..errors import ApiUnavailable, InvalidInput, ScheduleNotFound, TaskNotFound, UnsupportedOperation
from ..ids import new_task_id
from ..model import AuditPage, Backoff, DeadPage, EnqueueResult, NewTask, QueueStats, Task, TaskPage, TaskStatus
from ..validation import Limits
from .auth import Auth
from .objects import local_object_path, local_transfer, presigned_transfer
from .transport import IDEMPOTENT, ONCE, ApiTransport, TransportOptions


class HttpClient(ApiTransport):
    """``Client``'s interface over the API: each method one request (or a few), sent and retried
    by ``ApiTransport``."""

    def __init__(self, api_url: str, *, auth: Auth | None = None, payload_threshold_bytes: int | None = None,
                 payload_dir: str | os.PathLike[str] | None = None, **transport: Unpack[TransportOptions]) -> None:
        """``auth``: ``default_auth`` when None; ``transport``: timeouts, retries and TLS
        (``TransportOptions``)."""
        super().__init__(api_url, auth=auth, **transport)
        #: Payloads that encode to more than this are uploaded first (None: $RDQ_PAYLOAD_THRESHOLD_BYTES or 200 KiB).
        self.payload_threshold_bytes = payload_threshold_bytes
        #: rdq dev's payload directory, the only place its file: URLs may point (None: $RDQ_PAYLOAD_DIR,
        #: else any directory named rdq-payloads); see ``local_object_path``.
        self.payload_dir = os.fspath(payload_dir) if payload_dir is not None else None

    def close(self) -> None:
        """Nothing to release (one connection per request); here for ``Client``'s interface."""

    def __enter__(self) -> "HttpClient":
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

        Raises ``TaskConflict`` if ``id`` is taken on another queue. The trace context (as
        ``Client.enqueue`` chooses it) travels as the request's ``traceparent`` header.
        """
        _no_connection(connection)
        item = _task_body({"handler": handler, "payload": payload, **check_enqueue_options(options)})
        item = self._offloaded(queue, item)  # a payload over the threshold is uploaded first
        trace = tracecontext.http_headers(tracecontext.enqueue_headers(traceparent, tracestate))
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks", IDEMPOTENT, body=item, headers=trace)
        return Task.from_dict(response.json())

    def enqueue_new(self, new_task: NewTask, *, connection: Any = None) -> EnqueueResult:
        """``Client.enqueue_new`` over HTTP: one task already validated by ``build_new_task``;
        ``created`` is False when the id already existed on that queue. A conflict is the API's
        409, raised as ``TaskConflict``."""
        _no_connection(connection)
        # A stored trace context travels as the traceparent header (the API refuses rdq.* in the body).
        trace = tracecontext.http_headers(new_task.headers)
        item = _new_task_body(new_task)
        response = self._call("POST", f"/v1/queues/{_segment(new_task.queue)}/tasks", IDEMPOTENT, body=item, headers=trace)
        body = response.json()
        return EnqueueResult(task=Task.from_dict(body), created=bool(body.get("created", response.status == 201)),
                             deduplicated=bool(body.get("deduplicated", False)))

    def enqueue_many(
        self, queue: str, items: Sequence[Mapping[str, Any]], *, connection: Any = None,
        traceparent: str | None = None, tracestate: str | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue up to ``Limits.batch_items`` tasks in one request; per-item results (one trace
        context for all of them, as ``enqueue``)."""
        _no_connection(connection)
        if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
            raise InvalidInput("tasks must be a list", "tasks")
        # Items that are not objects are sent as they are: the API refuses them with their index.
        bodies = [_task_body(item) if isinstance(item, Mapping) else item for item in items]
        bodies = [self._offloaded(queue, body) if isinstance(body, dict) else body for body in bodies]  # large payloads
        trace = tracecontext.http_headers(tracecontext.enqueue_headers(traceparent, tracestate))
        return self._enqueue_batch(queue, bodies, trace)

    def enqueue_new_many(self, new_tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        """``Client.enqueue_new_many`` over HTTP: tasks already validated by ``build_new_tasks``;
        per-item results in order, a conflict included (``conflict=True``), never raised.

        One request per queue and trace context (the batch route takes one of each), in chunks of
        ``Limits.batch_items``; tasks from one producer call usually make a single request."""
        _no_connection(connection)
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[int]] = {}
        for index, new_task in enumerate(new_tasks):
            trace = tuple(sorted(tracecontext.http_headers(new_task.headers).items()))
            groups.setdefault((new_task.queue, trace), []).append(index)
        results: dict[int, EnqueueResult] = {}
        for (queue, trace), indexes in groups.items():
            for start in range(0, len(indexes), Limits.batch_items):
                chunk = indexes[start:start + Limits.batch_items]
                answers = self._enqueue_batch(queue, [_new_task_body(new_tasks[i]) for i in chunk], dict(trace))
                results.update(zip(chunk, answers, strict=True))
        return [results[index] for index in range(len(new_tasks))]

    def _enqueue_batch(self, queue: str, bodies: list[Any], trace: Mapping[str, str]) -> list[EnqueueResult]:
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks:batch", IDEMPOTENT, body={"tasks": bodies},
                              headers=trace)
        results = []
        for sent, answer in zip(bodies, response.json()["results"], strict=True):
            task = Task(
                id=answer["id"], queue=answer.get("queue", queue), handler=sent.get("handler", ""),
                payload=sent.get("payload"), status=TaskStatus(answer.get("status", TaskStatus.PENDING.value)),
                headers=dict(sent.get("headers") or {}), max_attempts=sent.get("max_attempts"),
                backoff=Backoff.from_dict(sent.get("backoff")), priority=int(sent.get("priority") or 0),
                concurrency_key=sent.get("concurrency_key"), rate_key=sent.get("rate_key"), group=sent.get("group"),
                dedupe_key=sent.get("dedupe_key"),
            )
            results.append(EnqueueResult(task=task, created=answer["result"] == "created",
                                         conflict=answer["result"] == "conflict",
                                         deduplicated=bool(answer.get("deduplicated", False))))
        return results

    # -- reading and operating -------------------------------------------------------------
    def get(self, task_id: str, *, resolve: bool = False) -> Task:
        """``resolve=True`` downloads a payload or result kept in the payload store (presigned URLs
        from ``GET /v1/tasks/{id}/objects``) and checks its size and SHA-256."""
        task = Task.from_dict(self._call("GET", f"/v1/tasks/{_segment(task_id, 'id')}", IDEMPOTENT, task_id=task_id).json())
        return self._resolved(task) if resolve else task

    def cancel(self, task_id: str) -> Task:
        return Task.from_dict(self._call("DELETE", f"/v1/tasks/{_segment(task_id, 'id')}", ONCE, task_id=task_id).json())

    def stats(self, queue: str) -> QueueStats:
        return QueueStats.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/stats", IDEMPOTENT).json())

    def list_queues(self) -> list[QueueStats]:
        """Every queue that holds at least one task or is paused, by name, with its counts."""
        return [QueueStats.from_dict(item) for item in self._call("GET", "/v1/queues", IDEMPOTENT).json()["queues"]]

    def list_dead(
        self,
        queue: str,
        *,
        limit: int = 50,
        cursor: str | None = None,
        error_type: str | None = None,
        handler: str | None = None,
    ) -> DeadPage:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        query = {"limit": str(limit), "cursor": cursor, "error_type": error_type, "handler": handler}
        return DeadPage.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/dlq?{_query(query)}", IDEMPOTENT).json())

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
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        status_text = status.value if isinstance(status, TaskStatus) else status
        query = {"status": status_text, "handler": handler, "error_type": error_type, "limit": str(limit), "cursor": cursor}
        return TaskPage.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/tasks?{_query(query)}", IDEMPOTENT).json())

    def redrive(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/dlq:redrive", "redriven", ids, error_type, handler, all, dry_run)

    def purge_dead(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                   handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/dlq:purge", "purged", ids, error_type, handler, all, dry_run)

    def cancel_selected(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                        handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/tasks:cancel", "cancelled", ids, error_type, handler, all,
                          dry_run)

    def pause(self, queue: str) -> QueueStats:
        # Pausing twice is pausing: a repeat after a lost answer is harmless.
        return QueueStats.from_dict(self._call("POST", f"/v1/queues/{_segment(queue)}:pause", IDEMPOTENT, body={}).json())

    def resume(self, queue: str) -> QueueStats:
        return QueueStats.from_dict(self._call("POST", f"/v1/queues/{_segment(queue)}:resume", IDEMPOTENT, body={}).json())

    def list_audit(self, *, queue: str | None = None, limit: int = 50, cursor: str | None = None) -> AuditPage:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        query = {"queue": queue, "limit": str(limit), "cursor": cursor}
        return AuditPage.from_dict(self._call("GET", f"/v1/audit?{_query(query)}", IDEMPOTENT).json())

    # -- schedules (rdq_core.engine.schedules) ----------------------------------------------------
    def put_schedule(self, definition: Any) -> Any:
        """Create or replace a schedule (a ``Schedule`` or its fields); returns it as stored.
        Replacing is idempotent: a repeat after a lost answer stores the same definition."""
        from ..engine.schedules import Schedule, schedule_from_body

        body = dict(definition.to_dict() if isinstance(definition, Schedule) else definition)
        body.pop("created_at", None)
        return schedule_from_body(self._call("POST", "/v1/schedules", IDEMPOTENT, body=body).json())

    def list_schedules(self) -> list[Any]:
        from ..engine.schedules import schedule_from_body

        return [schedule_from_body(item) for item in self._call("GET", "/v1/schedules", IDEMPOTENT).json()["schedules"]]

    def delete_schedule(self, name: str) -> None:
        try:
            self._call("DELETE", f"/v1/schedules/{_segment(name, 'name')}", IDEMPOTENT, task_id=name)
        except TaskNotFound:
            raise ScheduleNotFound(name) from None

    def _bulk(self, path: str, done_key: str, ids: Iterable[str] | None, error_type: str | None, handler: str | None,
              all: bool, dry_run: bool) -> int:
        body = _selection(ids, error_type, handler, all)
        if dry_run:
            body["dry_run"] = True  # read-only: safe to repeat
            return int(self._call("POST", path, IDEMPOTENT, body=body).json()["matched"])
        response = self._call("POST", path, ONCE, body=body)
        answer = response.json()
        if response.status == 202:
            # Too large for one request: the API started a background operation. Wait for it, so
            # the call means what it means on a store: done when it returns.
            return self.wait_for_operation(answer["operation"]["id"]).done
        return int(answer[done_key])

    # -- bulk operations as jobs --------------------------------------------------------------
    def start_operation(self, action: str, queue: str, *, ids: Iterable[str] | None = None,
                        error_type: str | None = None, handler: str | None = None, all: bool = False,
                        rate_per_second: float | None = None) -> Operation:
        """Start a background redrive, purge or cancel (the API answers 202 at once)."""
        paths = {"redrive": "dlq:redrive", "purge": "dlq:purge", "cancel": "tasks:cancel"}
        if action not in paths:
            raise InvalidInput(f"action must be one of {', '.join(paths)}", "action")
        body = {**_selection(ids, error_type, handler, all), "background": True}
        if rate_per_second is not None:
            body["rate_per_second"] = rate_per_second
        # Not repeated after it may have acted: a second start would be refused as a conflict.
        answer = self._call("POST", f"/v1/queues/{_segment(queue)}/{paths[action]}", ONCE, body=body).json()
        return Operation.from_dict(answer["operation"])

    def get_operation(self, operation_id: str) -> Operation:
        path = f"/v1/operations/{_segment(operation_id, 'operation_id')}"
        return Operation.from_dict(self._call("GET", path, IDEMPOTENT, task_id=operation_id).json())

    def list_operations(self, *, queue: str | None = None, limit: int = 50) -> list[Operation]:
        answer = self._call("GET", f"/v1/operations?{_query({'queue': queue, 'limit': str(limit)})}", IDEMPOTENT).json()
        return [Operation.from_dict(item) for item in answer["operations"]]

    def cancel_operation(self, operation_id: str) -> Operation:
        path = f"/v1/operations/{_segment(operation_id, 'operation_id')}:cancel"
        return Operation.from_dict(self._call("POST", path, ONCE, body={}, task_id=operation_id).json())

    def wait_for_operation(self, operation_id: str, *, timeout: float = 3600.0, poll: float = 1.0) -> Operation:
        """Poll until the operation is finished; ``ApiUnavailable`` past ``timeout`` seconds."""
        return operations.wait_until_finished(self.get_operation, operation_id, timeout=timeout, poll=poll,
                                              still_running=ApiUnavailable)

    # -- large payloads (rdq_core/engine/payloads.py) -----------------------------------------------
    def enqueue_item(self, queue: str, item: Mapping[str, Any], *, connection: Any = None) -> EnqueueResult:
        """``Client.enqueue_item`` over HTTP: one task from its fields, a large payload uploaded first."""
        _no_connection(connection)
        body = self._offloaded(queue, _task_body(item))
        trace = tracecontext.http_headers(tracecontext.enqueue_headers())  # as enqueue chooses it
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks", IDEMPOTENT, body=body, headers=trace)
        answer = response.json()
        return EnqueueResult(task=Task.from_dict(answer), created=bool(answer.get("created", response.status == 201)),
                             deduplicated=bool(answer.get("deduplicated", False)))

    def _offloaded(self, queue: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with a payload over the threshold uploaded through a presigned URL and replaced
        by its ``payload_ref``. An API without a payload bucket gets the payload inline."""
        size = payload_objects.encoded_size(body.get("payload"))
        threshold = self.payload_threshold_bytes
        if size is None or size <= (payload_objects.threshold_bytes() if threshold is None else threshold):
            return body
        data = payload_objects.encoded(body["payload"])
        sha256 = hashlib.sha256(data).hexdigest()
        try:
            offer = self._call("POST", f"/v1/queues/{_segment(queue)}/payloads", IDEMPOTENT,
                               body={"size": len(data), "sha256": sha256, "task_id": body["id"]}).json()
        except InvalidInput as exc:
            if "no payload bucket" in str(exc):
                return body  # inline: the API refuses it (413) if it is over 256 KiB
            raise InvalidInput(str(exc), "payload") from None
        upload = offer["upload"]
        ref = payload_objects.PayloadRef.from_dict(offer.get("payload_ref"))
        self._transfer(upload["method"], upload["url"], upload.get("headers") or {}, data, ref)
        slim = {name: value for name, value in body.items() if name != "payload"}
        slim["payload_ref"] = offer["payload_ref"]
        return slim

    def _resolved(self, task: Task) -> Task:
        if payload_objects.REF_HEADER not in task.headers and payload_objects.result_ref(task.result) is None:
            return task
        objects = self._call("GET", f"/v1/tasks/{_segment(task.id, 'id')}/objects", IDEMPOTENT, task_id=task.id).json()
        values: dict[str, Any] = {}
        for name in ("payload", "result"):
            entry = objects.get(name)
            if entry:
                ref = payload_objects.PayloadRef.from_dict(entry["payload_ref"])
                data = self._transfer("GET", entry["url"], {}, b"", ref)
                values[name] = payload_objects.checked_value(data, ref, name)
        return replace(task, **values)

    def _transfer(self, method: str, url: str, headers: Mapping[str, str], data: bytes,
                  ref: payload_objects.PayloadRef) -> bytes:
        """A presigned transfer of the object ``ref`` names; a ``file:`` URL only as the checks of
        ``local_object_path`` allow it (``rdq dev`` on loopback, inside its payload directory)."""
        if urllib.parse.urlsplit(url).scheme == "file":
            return local_transfer(method, self.local_object_path(url, ref), data)
        return presigned_transfer(method, url, headers, data, self.read_timeout)

    def local_object_path(self, url: str, ref: payload_objects.PayloadRef) -> str:
        """The file a ``file:`` URL from the API names, once it is safe to read or write (see
        ``objects.local_object_path``): ``rdq dev`` on loopback, inside its payload directory."""
        return local_object_path(self.endpoint, url, ref, self.payload_dir)


# -- request bodies ----------------------------------------------------------------------------
def _new_task_body(new_task: NewTask) -> dict[str, Any]:
    """A validated task's JSON body; its trace context is left out (it travels as a header)."""
    return _task_body({"id": new_task.id, "handler": new_task.handler, "payload": new_task.payload,
                       "headers": tracecontext.with_trace(new_task.headers, {}) or None,
                       "max_attempts": new_task.max_attempts,
                       "backoff": new_task.backoff, "run_at": new_task.run_at,
                       "delay_seconds": new_task.delay_seconds or None, **new_task.flow_fields()})


def _task_body(item: Mapping[str, Any]) -> dict[str, Any]:
    """One task's JSON body, with an id: generated here when absent, so retries are repeats."""
    body: dict[str, Any] = {}
    for name, value in item.items():
        if value is None and name != "payload":
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, Backoff):
            value = value.to_dict()
        elif name == "headers" and isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif name == "dedupe_states" and isinstance(value, (list, tuple)):
            value = [getattr(state, "value", state) for state in value]
        body[name] = value
    if body.get("id") is None:
        body["id"] = new_task_id()
    return body


def _selection(ids: Iterable[str] | None, error_type: str | None, handler: str | None, all: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"all": all}
    if ids is not None:
        body["ids"] = list(ids)
    if error_type is not None:
        body["error_type"] = error_type
    if handler is not None:
        body["handler"] = handler
    return body


def _query(params: Mapping[str, str | None]) -> str:
    return urllib.parse.urlencode({name: value for name, value in params.items() if value is not None})


def _segment(value: str, field: str = "queue") -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{field} must be a non-empty string", field)
    return urllib.parse.quote(value, safe="")


def _no_connection(connection: Any) -> None:
    if connection is not None:
        raise UnsupportedOperation("connection= joins a database transaction; it cannot cross the HTTP API")


if TYPE_CHECKING:  # mypy proves HttpClient is a QueueClient (rdq_core/client_protocol.py); nothing runs here
    def _conforms(client: HttpClient) -> QueueClient:
        return client
