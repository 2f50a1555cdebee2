"""The route table: every route of the HTTP API, declared once.

Each ``Route`` names its method, path template, operation id, the function that answers it,
its request and response schemas, the problem statuses it can answer, and a summary. From the
table alone come

* the resolver's registrations (``api.py``),
* the 405 answer and its ``Allow`` header for a known path asked with another method
  (``allowed_methods``), and
* the ``paths`` of the OpenAPI document (``openapi.py``), which ``GET /v1/openapi.json`` serves
  and tests/hostile/test_fuzz_openapi.py fuzzes the API against.

Adding a route is one entry in ``ROUTES`` and one function ``(request, **path parameters) ->
Reply``. Path templates use OpenAPI's ``{name}``; routes with a ``:verb`` suffix (``tasks:batch``,
``dlq:redrive``) are literal paths here. The deployed API sends every path to the function through
one ``{proxy+}`` resource (template.yaml), and ``rdq dev`` serves the same function, so this table
is the only list of routes there is.

Every route goes through ``rdq_core.client.Client``: validation, the conflict rule and the store
calls are the library's, the same as for a Python caller; a route adds only what is HTTP's (the
body's size and syntax, the status codes, waking a worker).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from ...engine import tracecontext
from ...engine import payloads
from ...client import Client
from ...engine.new_tasks import build_new_task, build_new_tasks
from ...errors import InvalidInput
from ...model import EnqueueResult, NewTask
from ...problems import ApiProblem
from ...engine.schedules import schedule_body
from ...validation import Limits, operation_rate
from .connection import shared_storage
from .invoker import FleetStarts, invoker
from .observability import logger
from .openapi import openapi_document
from .paging import (audit_cursor_after, dead_cursor_after, fields_of, task_body, task_cursor_after,
                     within_budget)
from .request import ApiRequest, Reply


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    operation_id: str
    handler: Callable[..., Reply]
    summary: str
    #: (status, description, schema name in the document's components) of each success answer.
    responses: tuple[tuple[int, str, str], ...]
    #: The problem statuses this route can answer (all ``application/problem+json``).
    problems: tuple[int, ...] = ()
    request_schema: str | None = None
    #: The query parameters it accepts; any other is refused (422).
    query: tuple[str, ...] = ()
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The path as the REST resolver matches it: a parameter is one non-empty segment, and
        # trailing slashes are ignored.
        parts = re.split(r"(\{\w+\})", self.path)
        regex = "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in parts)
        object.__setattr__(self, "pattern", re.compile(f"^{regex}/*$"))

    @property
    def resolver_rule(self) -> str:
        """The path in the resolver's syntax (``<queue>`` for ``{queue}``)."""
        return re.sub(r"\{(\w+)\}", r"<\1>", self.path)

    @property
    def path_parameters(self) -> list[str]:
        return re.findall(r"\{(\w+)\}", self.path)


# -- what the routes share ---------------------------------------------------------------------
def _client(request: ApiRequest) -> Client:
    return Client(shared_storage(request.settings), actor=request.actor)


def _limit(params: Mapping[str, str], default: int = 50) -> int:
    text = params.get("limit")
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,4}", text):
        raise InvalidInput(f"limit must be an integer in 1..{Limits.page_size}", "limit")
    return int(text)


def _check_payload_size(item: Mapping[str, Any], field_name: str) -> None:
    # The engine would refuse an oversized payload as invalid (422); over HTTP the precise
    # answer is 413, so measure it here first, the same way the engine does.
    if "payload" not in item:
        return
    try:
        size = len(json.dumps(item["payload"], allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError):
        return  # not JSON-shaped, or a lone surrogate (UnicodeEncodeError): the engine reports it as a 422
    if size > Limits.payload_bytes:
        raise ApiProblem(413, f"{field_name} exceeds {Limits.payload_bytes} bytes once encoded as JSON", field_name)


def _log_payloads() -> bool:
    """Payloads are logged only when the deployer opts in with ``RDQ_LOG_PAYLOADS=true``."""
    return os.environ.get("RDQ_LOG_PAYLOADS", "").strip().lower() in {"1", "true", "yes", "on"}


def _due_now(task: NewTask) -> bool:
    if task.run_at is not None:
        return task.run_at <= datetime.now(timezone.utc)
    return task.delay_seconds <= 0


def _wake_worker(request: ApiRequest, queue: str, new_tasks: list[NewTask], results: list[EnqueueResult]) -> None:
    if any(r.created and _due_now(t) for t, r in zip(new_tasks, results, strict=True)):
        _wake_worker_for(request, queue)


def _wake_worker_for(request: ApiRequest, queue: str) -> None:
    """Every action that makes work due now (enqueue, redrive) wakes a worker, so its latency
    does not wait for the schedule's next tick."""
    settings = request.settings
    if settings.wake_worker and settings.worker_function:
        # Wake-ups count against the workers' cap: each reserves the slot its worker will take
        # (invoker.py), and there is none while every worker slot is held or pending.
        invoker.wake(settings.worker_function, [queue], settings.wake_debounce_seconds,
                     fleet=FleetStarts(shared_storage(settings), settings.worker_fleet, settings.max_worker_concurrency))


def _reject_unknown_fields(body: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(body) - known
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])


# -- the routes --------------------------------------------------------------------------------
def enqueue_task(request: ApiRequest, queue: str) -> Reply:
    body = request.json_body()
    _check_payload_size(body, "payload")
    body, ref_data = _split_payload_ref(body, "payload_ref")  # a large payload uploaded beforehand
    new_task = build_new_task(queue, body)
    ref = None if ref_data is None else _checked_ref(ref_data, queue, new_task.id, "payload_ref")
    if ref is not None:
        new_task = payloads.with_ref(new_task, ref)
    (new_task,) = tracecontext.stamped([new_task], tracecontext.request_headers(request.header))  # trace context
    result = _client(request).enqueue_new(new_task)  # TaskConflict (409) if the id is taken on another queue
    if ref is not None:
        payloads.enqueued(payloads.default_store(), ref, result.task)  # no longer a pending upload
    _wake_worker(request, queue, [new_task], [result])
    extra: dict[str, Any] = {"task_id": new_task.id, "queue": queue, "is_new": result.created}
    if _log_payloads():
        extra["payload"] = new_task.payload  # opted in: RDQ_LOG_PAYLOADS=true (never the default)
    logger.info("enqueued", extra=extra)
    # 200 with created=false: the id already existed on this queue and nothing was enqueued.
    status = 201 if result.created else 200
    answer = {**result.task.to_dict(), "created": result.created, "deduplicated": result.deduplicated}
    return Reply(status, answer, {"Location": f"/v1/tasks/{result.task.id}"})


def enqueue_batch(request: ApiRequest, queue: str) -> Reply:
    body = request.json_body()
    _reject_unknown_fields(body, {"tasks"})
    items = body.get("tasks")
    if not isinstance(items, list):
        raise InvalidInput("tasks must be a list of task objects", "tasks")
    for index, item in enumerate(items[: Limits.batch_items]):
        if isinstance(item, Mapping):
            _check_payload_size(item, f"tasks[{index}].payload")
    refs: dict[int, Any] = {}
    if any(isinstance(item, Mapping) and "payload_ref" in item for item in items):
        items = list(items)
        for index, item in enumerate(items[: Limits.batch_items]):
            if isinstance(item, Mapping) and "payload_ref" in item:
                items[index], ref_data = _split_payload_ref(item, f"tasks[{index}].payload_ref")
                if ref_data is not None:
                    refs[index] = ref_data
    new_tasks = build_new_tasks(queue, items)
    checked: dict[int, payloads.PayloadRef] = {}
    for index, ref_data in refs.items():
        checked[index] = _checked_ref(ref_data, queue, new_tasks[index].id, f"tasks[{index}].payload_ref")
        new_tasks[index] = payloads.with_ref(new_tasks[index], checked[index])
    new_tasks = tracecontext.stamped(new_tasks, tracecontext.request_headers(request.header))  # trace context
    results = _client(request).enqueue_new_many(new_tasks)  # one round trip for the whole batch
    for index, ref in checked.items():
        if not results[index].conflict:
            payloads.enqueued(payloads.default_store(), ref, results[index].task)  # no longer pending uploads
    _wake_worker(request, queue, new_tasks, results)
    # A conflict's task belongs to another queue: say only that the id is taken, not where or
    # in what state (the caller asked about this queue; the single enqueue's 409 says as much).
    per_item = [
        {"id": r.task.id, "result": "conflict"} if r.conflict else
        {"id": r.task.id, "queue": r.task.queue, "result": "created" if r.created else "existing",
         "deduplicated": r.deduplicated, "status": r.task.status.value}
        for r in results
    ]
    counts = {kind: sum(1 for item in per_item if item["result"] == kind) for kind in ("created", "existing", "conflict")}
    counts["deduplicated"] = sum(1 for r in results if r.deduplicated)
    logger.info("enqueued batch", extra={"queue": queue, "counts": counts})
    return Reply(200, {"results": per_item, **counts})


def get_task(request: ApiRequest, task_id: str) -> Reply:
    return Reply(200, _client(request).get(task_id).to_dict())


def cancel_task(request: ApiRequest, task_id: str) -> Reply:
    task = _client(request).cancel(task_id)
    logger.info("cancelled", extra={"task_id": task_id, "queue": task.queue})
    return Reply(200, task.to_dict())


def queue_stats(request: ApiRequest, queue: str) -> Reply:
    return Reply(200, _client(request).stats(queue).to_dict())


def list_queues(request: ApiRequest) -> Reply:
    return Reply(200, {"queues": [stats.to_dict() for stats in _client(request).list_queues()]})


def queue_metrics(request: ApiRequest, queue: str) -> Reply:
    params = request.query(("window",))
    return Reply(200, _client(request).storage.queue_metrics(queue, params.get("window") or "hour"))


def metrics_overview(request: ApiRequest) -> Reply:
    params = request.query(("window",))
    return Reply(200, _client(request).storage.metrics_overview(params.get("window") or "hour"))


# Every list route's page is bounded by bytes as well as by limit (paging.py): it ends early,
# with a cursor, rather than exceed Lambda's 6 MB response limit.
_DLQ_QUERY = ("cursor", "limit", "error_type", "handler", "fields")


def list_dead(request: ApiRequest, queue: str) -> Reply:
    params = request.query(_DLQ_QUERY)
    fields = fields_of(params)
    page = _client(request).list_dead(
        queue, limit=_limit(params), cursor=params.get("cursor") or None,
        error_type=params.get("error_type") or None, handler=params.get("handler") or None,
    )
    tasks, next_cursor = within_budget(page.tasks, lambda t: task_body(t, fields), dead_cursor_after(queue),
                                       page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"tasks": tasks, "next_cursor": next_cursor})


_TASKS_QUERY = ("status", "handler", "error_type", "cursor", "limit", "fields")


def list_tasks(request: ApiRequest, queue: str) -> Reply:
    params = request.query(_TASKS_QUERY)
    fields = fields_of(params)
    page = _client(request).list_tasks(
        queue, status=params.get("status") or None, handler=params.get("handler") or None,
        error_type=params.get("error_type") or None, limit=_limit(params), cursor=params.get("cursor") or None,
    )
    tasks, next_cursor = within_budget(page.tasks, lambda t: task_body(t, fields), task_cursor_after(queue),
                                       page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"tasks": tasks, "next_cursor": next_cursor})


#: A bulk action matching more tasks than this runs as a background operation (202): one request
#: never has to act on an unbounded selection within API Gateway's 29 s.
INLINE_LIMIT = 1000


def _selection(request: ApiRequest) -> dict[str, Any]:
    body = request.json_body()
    _reject_unknown_fields(body, {"ids", "error_type", "handler", "all", "dry_run", "background", "rate_per_second"})
    if "ids" in body and not (isinstance(body["ids"], list) and all(isinstance(i, str) for i in body["ids"])):
        raise InvalidInput("ids must be a list of task ids", "ids")
    for flag in ("all", "dry_run", "background"):
        if flag in body and not isinstance(body[flag], bool):
            raise InvalidInput(f"{flag} must be true or false", flag)
    for name in ("error_type", "handler"):
        if name in body and not isinstance(body[name], str):
            raise InvalidInput(f"{name} must be a string", name)
    # Bounded here, before anything is counted or started (422 naming the field and the range).
    rate = operation_rate(body.get("rate_per_second"))
    return {"ids": body.get("ids"), "error_type": body.get("error_type"), "handler": body.get("handler"),
            "all": bool(body.get("all", False)), "dry_run": bool(body.get("dry_run", False)),
            "background": bool(body.get("background", False)), "rate_per_second": rate}


def _bulk(request: ApiRequest, queue: str, action: str, done_key: str) -> tuple[Reply, int]:
    """A bulk action: its dry run (200 ``matched``), inline (200 with the count), or, when asked
    for, rate-limited, or larger than ``INLINE_LIMIT``, a background operation (202)."""
    selection = _selection(request)
    background, rate = selection.pop("background"), selection.pop("rate_per_second")
    client = _client(request)
    act = {"redrive": client.redrive, "purge": client.purge_dead, "cancel": client.cancel_selected}[action]
    if selection["dry_run"]:
        return Reply(200, {"matched": act(queue, **selection)}), 0
    if not background and rate is None:
        background = act(queue, **{**selection, "dry_run": True}) > INLINE_LIMIT
    if background or rate is not None:  # a rate is kept over time: only an operation can
        del selection["dry_run"]
        operation = client.start_operation(action, queue, **selection, rate_per_second=rate)
        return Reply(202, {"operation": operation.to_dict()}, {"Location": f"/v1/operations/{operation.id}"}), 0
    count = act(queue, **selection)
    logger.info(action, extra={"queue": queue, "count": count})
    return Reply(200, {done_key: count}), count


def redrive_dead(request: ApiRequest, queue: str) -> Reply:
    reply, count = _bulk(request, queue, "redrive", "redriven")
    if count:
        _wake_worker_for(request, queue)  # redriven tasks are due now
    return reply


def purge_dead(request: ApiRequest, queue: str) -> Reply:
    return _bulk(request, queue, "purge", "purged")[0]


def cancel_selected(request: ApiRequest, queue: str) -> Reply:
    return _bulk(request, queue, "cancel", "cancelled")[0]


_OPERATIONS_QUERY = ("queue", "limit")


def list_operations(request: ApiRequest) -> Reply:
    params = request.query(_OPERATIONS_QUERY)
    found = _client(request).list_operations(queue=params.get("queue") or None, limit=_limit(params))
    return Reply(200, {"operations": [operation.to_dict() for operation in found]})


def get_operation(request: ApiRequest, operation_id: str) -> Reply:
    return Reply(200, _client(request).get_operation(operation_id).to_dict())


def cancel_operation(request: ApiRequest, operation_id: str) -> Reply:
    _no_body(request)
    return Reply(200, _client(request).cancel_operation(operation_id).to_dict())


def _no_body(request: ApiRequest) -> None:
    """Pause, resume and an operation's cancel take no parameters: an empty body or ``{}``, sent
    as ``application/json`` all the same. An HTML form or a ``no-cors`` fetch from another page
    cannot send that type, so the state-changing POSTs stay out of their reach (415) even where
    nothing else authenticates the caller (``rdq dev`` without a token)."""
    request.require_json_type()
    if request.event.get("body"):
        _reject_unknown_fields(request.json_body(), set())


def pause_queue(request: ApiRequest, queue: str) -> Reply:
    _no_body(request)
    stats = _client(request).pause(queue)
    logger.info("paused", extra={"queue": queue})
    return Reply(200, stats.to_dict())


def resume_queue(request: ApiRequest, queue: str) -> Reply:
    _no_body(request)
    stats = _client(request).resume(queue)
    logger.info("resumed", extra={"queue": queue})
    if stats.pending:
        _wake_worker_for(request, queue)  # what waited is due now
    return Reply(200, stats.to_dict())


_AUDIT_QUERY = ("queue", "cursor", "limit")


def list_audit(request: ApiRequest) -> Reply:
    params = request.query(_AUDIT_QUERY)
    queue = params.get("queue") or None
    page = _client(request).list_audit(queue=queue, limit=_limit(params), cursor=params.get("cursor") or None)
    entries, next_cursor = within_budget(page.entries, lambda e: e.to_dict(), audit_cursor_after(queue),
                                         page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"entries": entries, "next_cursor": next_cursor})


# -- schedules (rdq_core.engine.schedules) ----------------------------------------------------------
_SCHEDULE_FIELDS = {"name", "expression", "timezone", "queue", "handler", "payload", "max_attempts"}


def put_schedule(request: ApiRequest) -> Reply:
    """Create or replace a schedule: an EventBridge Scheduler schedule when deployed
    (``RDQ_SCHEDULE_GROUP``), the local schedules file under ``rdq dev``."""
    body = request.json_body()
    _reject_unknown_fields(body, _SCHEDULE_FIELDS)
    _check_payload_size(body, "payload")
    schedule = _client(request).put_schedule(body)
    logger.info("schedule put", extra={"schedule": schedule.name, "queue": schedule.queue})
    return Reply(200, schedule_body(schedule), {"Location": f"/v1/schedules/{schedule.name}"})


def list_schedules(request: ApiRequest) -> Reply:
    return Reply(200, {"schedules": [schedule_body(s) for s in _client(request).list_schedules()]})


def delete_schedule(request: ApiRequest, schedule: str) -> Reply:
    _client(request).delete_schedule(schedule)
    logger.info("schedule deleted", extra={"schedule": schedule})
    return Reply(200, {"deleted": schedule})


# -- large payloads (rdq_core.engine.payloads) ---------------------------------------------------------
def _split_payload_ref(body: Mapping[str, Any], field_name: str) -> tuple[dict[str, Any], Any]:
    """``body`` without its ``payload_ref``, and the reference as sent (None when absent)."""
    rest = dict(body)
    data = rest.pop("payload_ref", None)
    if data is not None and rest.get("payload") is not None:
        raise InvalidInput("give payload or payload_ref, not both", field_name)
    return rest, data


def _checked_ref(data: Any, queue: str, task_id: str, field_name: str) -> payloads.PayloadRef:
    """The reference checked against the store: issued for this queue and this task's id (the one
    the upload was asked for), and the object is there with the size it names."""
    try:
        return payloads.checked_upload(payloads.default_store(), queue, data, task_id)
    except InvalidInput as exc:
        raise InvalidInput(str(exc), field_name) from None


def create_payload_upload(request: ApiRequest, queue: str) -> Reply:
    """Where to PUT a large payload (a presigned URL) and the reference to enqueue it with."""
    body = request.json_body()
    _reject_unknown_fields(body, {"size", "sha256", "task_id"})
    offer = payloads.upload_offer(payloads.default_store(), queue, body.get("size"), body.get("sha256"),
                                  body.get("task_id"))
    logger.info("payload upload offered", extra={"queue": queue, "size": body.get("size")})
    return Reply(201, offer)


def get_task_objects(request: ApiRequest, task_id: str) -> Reply:
    """Presigned download URLs of a task's payload and result when they are kept in the store."""
    task = _client(request).get(task_id)
    store = payloads.default_store()
    answer: dict[str, Any] = {"payload": None, "result": None}
    for name, ref in (("payload", payloads.payload_ref(task)), ("result", payloads.result_ref(task.result))):
        if ref is not None and store is not None and ref.bucket == store.bucket:
            answer[name] = {"payload_ref": ref.to_dict(), "url": store.download_url(ref.key),
                            "expires_in_seconds": payloads.PRESIGN_SECONDS}
    return Reply(200, answer)


def openapi(request: ApiRequest) -> Reply:
    settings = request.settings
    return Reply(200, openapi_document(ROUTES, server_url=request.stage_prefix or "/", auth_mode=settings.auth_mode,
                                       bearer=bool(settings.api_token)))


# -- the table ---------------------------------------------------------------------------------
#: Problems any route with a JSON body can answer: malformed (400), too large (413), not JSON
#: (415), invalid fields (422).
BODY_PROBLEMS = (400, 413, 415, 422)
#: Problems every data route can answer: bearer token missing (when configured), store unreachable.
COMMON_PROBLEMS = (401, 503)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/queues/{queue}/tasks", "enqueueTask", enqueue_task, "Enqueue one task (idempotent on id)",
          responses=((201, "created", "Task"), (200, "the id already existed on this queue", "Task")),
          problems=(*BODY_PROBLEMS, 409, *COMMON_PROBLEMS), request_schema="NewTask"),
    Route("POST", "/v1/queues/{queue}/tasks:batch", "enqueueBatch", enqueue_batch,
          f"Enqueue up to {Limits.batch_items} tasks in one storage round trip",
          responses=((200, "per-item results", "BatchResult"),),
          # 409: a payload_ref whose object is not (yet) in the payload bucket as it says
          problems=(*BODY_PROBLEMS, 409, *COMMON_PROBLEMS), request_schema="BatchRequest"),
    Route("GET", "/v1/tasks/{task_id}", "getTask", get_task, "A task with its attempt history and result",
          responses=((200, "the task", "Task"),), problems=(404, 422, *COMMON_PROBLEMS)),
    Route("DELETE", "/v1/tasks/{task_id}", "cancelTask", cancel_task, "Cancel a PENDING task",
          responses=((200, "cancelled", "Task"),), problems=(404, 409, 422, *COMMON_PROBLEMS)),
    Route("GET", "/v1/queues", "listQueues", list_queues, "Every queue that holds a task, with its counts",
          responses=((200, "queues by name", "QueueList"),), problems=COMMON_PROBLEMS),
    Route("GET", "/v1/queues/{queue}/stats", "queueStats", queue_stats, "Counts per status and the oldest pending task's age",
          responses=((200, "counts per status", "QueueStats"),), problems=(422, *COMMON_PROBLEMS)),
    Route("GET", "/v1/queues/{queue}/metrics", "queueMetrics", queue_metrics,
          "Per minute over the last hour or day: tasks succeeded, retried, dead-lettered, cancelled; depth; "
          "per handler attempts, failure rate and p50/p95/p99 duration",
          responses=((200, "one point per minute", "QueueMetrics"),), problems=(422, *COMMON_PROBLEMS), query=("window",)),
    Route("GET", "/v1/metrics", "metricsOverview", metrics_overview,
          "Every queue's finished tasks per minute over the last hour or day, summed, with per-queue totals",
          responses=((200, "one point per minute", "MetricsOverview"),), problems=(422, *COMMON_PROBLEMS),
          query=("window",)),
    Route("GET", "/v1/queues/{queue}/tasks", "listTasks", list_tasks,
          "Tasks of a queue by status (each status in its own order), cursor-paged; no attempt history",
          responses=((200, "one page", "TaskPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=_TASKS_QUERY),
    Route("POST", "/v1/queues/{queue}/tasks:cancel", "cancelSelected", cancel_selected,
          "Cancel the selected PENDING tasks (dry_run: count them)",
          responses=((200, "how many were cancelled, or matched", "CancelResult"),
                     (202, "started as a background operation", "OperationStarted")),
          problems=(*BODY_PROBLEMS, 409, *COMMON_PROBLEMS), request_schema="TaskSelection"),
    Route("POST", "/v1/queues/{queue}:pause", "pauseQueue", pause_queue,
          "Pause a queue: workers claim nothing from it; enqueues are still accepted",
          responses=((200, "the queue, paused", "QueueStats"),), problems=(*BODY_PROBLEMS, *COMMON_PROBLEMS),
          request_schema="EmptyObject"),
    Route("POST", "/v1/queues/{queue}:resume", "resumeQueue", resume_queue, "Resume a paused queue",
          responses=((200, "the queue, running", "QueueStats"),), problems=(*BODY_PROBLEMS, *COMMON_PROBLEMS),
          request_schema="EmptyObject"),
    Route("GET", "/v1/operations", "listOperations", list_operations,
          "Bulk operations (background redrive, purge, cancel), newest first",
          responses=((200, "operations", "OperationList"),), problems=(422, *COMMON_PROBLEMS), query=_OPERATIONS_QUERY),
    Route("GET", "/v1/operations/{operation_id}", "getOperation", get_operation,
          "A bulk operation's progress: matched, done, status",
          responses=((200, "the operation", "Operation"),), problems=(404, 422, *COMMON_PROBLEMS)),
    Route("POST", "/v1/operations/{operation_id}:cancel", "cancelOperation", cancel_operation,
          "Stop a running bulk operation after its current chunk",
          responses=((200, "the operation, cancelled", "Operation"),),
          problems=(*BODY_PROBLEMS, 404, 409, *COMMON_PROBLEMS), request_schema="EmptyObject"),
    Route("GET", "/v1/audit", "listAudit", list_audit, "Operator actions, newest first, with who took them",
          responses=((200, "one page", "AuditPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=_AUDIT_QUERY),
    Route("GET", "/v1/queues/{queue}/dlq", "listDead", list_dead, "Dead tasks, cursor-paged by (dead_at, id)",
          responses=((200, "one page", "DeadPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=_DLQ_QUERY),
    Route("POST", "/v1/queues/{queue}/dlq:redrive", "redriveDead", redrive_dead,
          "Redrive the selected dead tasks (dry_run: count them)",
          responses=((200, "how many were redriven, or matched", "RedriveResult"),
                     (202, "started as a background operation", "OperationStarted")),
          problems=(*BODY_PROBLEMS, 409, *COMMON_PROBLEMS), request_schema="TaskSelection"),
    Route("POST", "/v1/queues/{queue}/dlq:purge", "purgeDead", purge_dead, "Delete the selected dead tasks (dry_run: count them)",
          responses=((200, "how many were deleted, or matched", "PurgeResult"),
                     (202, "started as a background operation", "OperationStarted")),
          problems=(*BODY_PROBLEMS, 409, *COMMON_PROBLEMS), request_schema="TaskSelection"),
    # schedules (rdq_core.engine.schedules)
    Route("POST", "/v1/schedules", "putSchedule", put_schedule,
          "Create or replace a schedule (cron or rate); each period enqueues one task, id sched.<name>.<instant>",
          responses=((200, "the schedule as stored", "Schedule"),),
          problems=(*BODY_PROBLEMS, *COMMON_PROBLEMS), request_schema="NewSchedule"),
    Route("GET", "/v1/schedules", "listSchedules", list_schedules, "Every schedule, by name, with its next fire time",
          responses=((200, "schedules by name", "ScheduleList"),), problems=COMMON_PROBLEMS),
    Route("DELETE", "/v1/schedules/{schedule}", "deleteSchedule", delete_schedule, "Delete a schedule",
          responses=((200, "deleted", "ScheduleDeleted"),), problems=(404, 422, *COMMON_PROBLEMS)),
    # large payloads (rdq_core.engine.payloads)
    Route("POST", "/v1/queues/{queue}/payloads", "createPayloadUpload", create_payload_upload,
          "A presigned PUT URL for a large payload, and the payload_ref to enqueue it with",
          responses=((201, "where to upload, and the reference", "PayloadUpload"),),
          problems=(*BODY_PROBLEMS, *COMMON_PROBLEMS), request_schema="PayloadUploadRequest"),
    Route("GET", "/v1/tasks/{task_id}/objects", "getTaskObjects", get_task_objects,
          "Presigned download URLs of a task's payload and result kept in the payload store",
          responses=((200, "a URL per stored object (null when inline)", "TaskObjects"),),
          problems=(404, 422, *COMMON_PROBLEMS)),
    Route("GET", "/v1/openapi.json", "openapi", openapi, "This document",
          responses=((200, "this document", "OpenApiDocument"),), problems=(401,)),
)


def allowed_methods(path: str) -> str | None:
    """The ``Allow`` header for a path the table knows (``"GET, DELETE"``), or ``None``.

    Only the most specific template that matches counts: ``/v1/operations/x:cancel`` also
    matches ``/v1/operations/{operation_id}`` (an id may hold a colon), but the literal
    ``:cancel`` route is what the path names, and a GET of it can never succeed."""
    matching = [route for route in ROUTES if route.pattern.match(path)]
    if not matching:
        return None
    best = max(_literal_length(route.path) for route in matching)
    methods = dict.fromkeys(route.method for route in matching if _literal_length(route.path) == best)
    return ", ".join(methods)


def _literal_length(template: str) -> int:
    """How much of a path template is literal text (not ``{parameters}``): its specificity."""
    return len(re.sub(r"\{\w+\}", "", template))
