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
Reply``: in ``task_routes.py`` (tasks and queues) or ``operator_routes.py`` (bulk actions,
operations, pause, audit, schedules); what they share is in ``route_support.py``. Path templates
use OpenAPI's ``{name}``; routes with a ``:verb`` suffix (``tasks:batch``, ``dlq:redrive``) are
literal paths here. The deployed API sends every path to the function through
one ``{proxy+}`` resource (template.yaml), and ``rdq dev`` serves the same function, so this table
is the only list of routes there is.

Every route goes through ``rdq_core.client.Client``: validation, the conflict rule and the store
calls are the library's, the same as for a Python caller; a route adds only what is HTTP's (the
body's size and syntax, the status codes, waking a worker).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ...validation import Limits
from .openapi import openapi_document
from .operator_routes import (AUDIT_QUERY, OPERATIONS_QUERY, cancel_operation, cancel_selected, delete_schedule,
                              get_operation, list_audit, list_operations, list_schedules, pause_queue, purge_dead,
                              put_schedule, redrive_dead, resume_queue)
from .request import ApiRequest, Reply
from .task_routes import (DLQ_QUERY, TASKS_QUERY, cancel_task, create_payload_upload, enqueue_batch, enqueue_task,
                          get_task, get_task_objects, list_dead, list_queues, list_tasks, metrics_overview,
                          queue_metrics, queue_stats)


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


def openapi(request: ApiRequest) -> Reply:
    """The one route that reads the table: the OpenAPI document made from it."""
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
          responses=((200, "one page", "TaskPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=TASKS_QUERY),
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
          responses=((200, "operations", "OperationList"),), problems=(422, *COMMON_PROBLEMS), query=OPERATIONS_QUERY),
    Route("GET", "/v1/operations/{operation_id}", "getOperation", get_operation,
          "A bulk operation's progress: matched, done, status",
          responses=((200, "the operation", "Operation"),), problems=(404, 422, *COMMON_PROBLEMS)),
    Route("POST", "/v1/operations/{operation_id}:cancel", "cancelOperation", cancel_operation,
          "Stop a running bulk operation after its current chunk",
          responses=((200, "the operation, cancelled", "Operation"),),
          problems=(*BODY_PROBLEMS, 404, 409, *COMMON_PROBLEMS), request_schema="EmptyObject"),
    Route("GET", "/v1/audit", "listAudit", list_audit, "Operator actions, newest first, with who took them",
          responses=((200, "one page", "AuditPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=AUDIT_QUERY),
    Route("GET", "/v1/queues/{queue}/dlq", "listDead", list_dead, "Dead tasks, cursor-paged by (dead_at, id)",
          responses=((200, "one page", "DeadPage"),), problems=(400, 422, *COMMON_PROBLEMS), query=DLQ_QUERY),
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
