"""The OpenAPI 3.1 document of the HTTP API: the route table's paths, with schemas written from
the engine's own limits and patterns.

The operations (paths, methods, parameters, request and response schemas, problem statuses) come
from ``routes.ROUTES``, the one list of routes; the schemas below are written by hand so that they
state what the handlers really enforce: name patterns, size limits, closed request objects.
3.1 (full JSON Schema) because 3.0 cannot state some of the rules: header names
(``propertyNames``), "delay_seconds or run_at, not both", "select by ids, a filter or all".
tests/hostile/test_fuzz_openapi.py fuzzes the API against this document.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence
from zoneinfo import available_timezones

from ...engine import payloads
from ... import validation
from ...model import Outcome
from ...validation import Limits
from ...engine.cron import EXPRESSION_PATTERN
from ...engine.schedules import SCHEDULE_NAME



class Route(Protocol):
    """What the document needs of a route (``routes.Route`` has it). Named here so that this
    module, which ``routes.py`` imports for its openapi route, does not import the table back."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def operation_id(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def responses(self) -> tuple[tuple[int, str, str], ...]: ...

    @property
    def problems(self) -> tuple[int, ...]: ...

    @property
    def request_schema(self) -> str | None: ...

    @property
    def query(self) -> tuple[str, ...]: ...

    @property
    def path_parameters(self) -> Sequence[str]: ...

_PROBLEM_REF = {"$ref": "#/components/responses/Problem"}


def _json(schema_name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}}


def _ok(description: str, schema_name: str) -> dict[str, Any]:
    return {"description": description, "content": _json(schema_name)}


def _problems(*statuses: int) -> dict[str, Any]:
    return {str(status): _PROBLEM_REF for status in statuses}


#: Text every backend can store: no NUL (PostgreSQL refuses it in text and jsonb).
_NO_NUL = "^[^\\u0000]*$"

#: Every path parameter a route template may name, by name.
_PATH_PARAMS = {
    "queue": {"name": "queue", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": f"^{validation.QUEUE_NAME.pattern}$"}},
    "task_id": {"name": "task_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": f"^{validation.TASK_ID.pattern}$"}},
    "operation_id": {"name": "operation_id", "in": "path", "required": True,
                     "schema": {"type": "string", "pattern": "^[A-Za-z0-9]{1,64}$"}},
    "schedule": {"name": "schedule", "in": "path", "required": True,  # schedules (rdq_core.engine.schedules)
                 "schema": {"type": "string", "pattern": f"^{SCHEDULE_NAME.pattern}$"}},
}
#: Every query parameter a route may accept, by name.
_QUERY_PARAMS = {
    "cursor": {"name": "cursor", "in": "query", "description": "opaque: the next_cursor of the previous page of this queue; "
               "any other value is 400; empty means the first page",
               "schema": {"type": "string", "maxLength": 1024, "pattern": "^[A-Za-z0-9_-]*$"}},
    "limit": {"name": "limit", "in": "query",
              "schema": {"type": "integer", "minimum": 1, "maximum": Limits.page_size, "default": 50}},
    "error_type": {"name": "error_type", "in": "query", "description": "exact error type; empty means no filter",
                   "schema": {"type": "string", "maxLength": 256, "pattern": _NO_NUL}},
    "handler": {"name": "handler", "in": "query", "description": "exact handler name; empty means no filter",
                "schema": {"type": "string", "pattern": f"^({validation.HANDLER_NAME.pattern})?$"}},
    "status": {"name": "status", "in": "query", "description": "one status; empty means every status, PENDING first",
               "schema": {"type": "string", "enum": ["", "PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "CANCELLED"]}},
    "fields": {"name": "fields", "in": "query",
               "description": "summary: tasks without payload and result (payload_omitted: true); full or empty: every field. "
                              "Either way a page ends early, with a next_cursor, before it passes 4 MB",
               "schema": {"type": "string", "enum": ["", "full", "summary"]}},
    "queue": {"name": "queue", "in": "query", "description": "one queue's entries; empty means every queue",
              "schema": {"type": "string", "pattern": f"^({validation.QUEUE_NAME.pattern})?$"}},
    "window": {"name": "window", "in": "query", "description": "the last hour (60 points) or day (1440); empty means hour",
               "schema": {"type": "string", "enum": ["", "hour", "day"]}},
}

# -- trace context (rdq_core.engine.tracecontext): the request headers an enqueue reads ----------------
_TRACED_OPERATIONS = {"enqueueTask", "enqueueBatch"}
_TRACE_HEADERS = [
    {"name": "traceparent", "in": "header", "schema": {"type": "string"},
     "description": "W3C Trace Context: stored with the task(s) as rdq.traceparent and restored in the worker; "
                    "an invalid value is dropped, never refused"},
    {"name": "tracestate", "in": "header", "schema": {"type": "string"},
     "description": "W3C Trace Context, kept with a valid traceparent; an invalid value is dropped"},
    {"name": "X-Amzn-Trace-Id", "in": "header", "schema": {"type": "string"},
     "description": "X-Ray trace header, converted to a traceparent when no valid traceparent is sent"},
]


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "type": [schema["type"], "null"]}


def _bulk_result(done: str) -> dict[str, Any]:
    return {"oneOf": [
        {"type": "object", "required": [done], "additionalProperties": False, "properties": {done: {"type": "integer"}}},
        {"type": "object", "required": ["matched"], "additionalProperties": False, "description": "dry_run",
         "properties": {"matched": {"type": "integer"}}},
    ]}


def _schemas() -> dict[str, Any]:
    name = {"type": "string", "pattern": f"^{validation.HANDLER_NAME.pattern}$"}
    task_id = {"type": "string", "pattern": f"^{validation.TASK_ID.pattern}$"}
    flow_key = {"type": "string", "pattern": f"^{validation.FLOW_KEY.pattern}$"}
    seconds = {"type": ["number", "null"], "minimum": 0, "maximum": Limits.delay_seconds}
    flow_fields = {  # docs/flow-control.md
        "priority": {"type": ["integer", "null"], "minimum": 0, "maximum": Limits.max_priority,
                     "description": "claim order: lower runs first (default 0)"},
        "concurrency_key": _nullable(flow_key), "rate_key": _nullable(flow_key), "group": _nullable(flow_key),
        "dedupe_key": _nullable(flow_key), "dedupe_for_seconds": seconds, "dedupe_max_wait_seconds": seconds,
        "dedupe_states": {"type": ["array", "null"], "minItems": 1,
                          "items": {"type": "string", "enum": ["PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "CANCELLED"]}},
        "dedupe_mode": {"type": ["string", "null"], "enum": ["skip", "replace", "debounce", None]},
    }
    backoff = {
        "type": "object", "additionalProperties": False,
        "properties": {
            "initial_seconds": {"type": "number", "minimum": 0, "maximum": 86400},
            "factor": {"type": "number", "minimum": 1, "maximum": 10},
            "max_seconds": {"type": "number", "minimum": 0, "maximum": 604800},
            "jitter": {"type": "number", "minimum": 0, "maximum": 1},
        },
    }
    error = {"type": ["object", "null"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}, "stack": {"type": ["string", "null"]}}}
    timestamp = {"type": ["string", "null"], "format": "date-time"}
    return {
        "JsonValue": {
            "description": f"any JSON value without NUL characters, at most {Limits.payload_bytes} bytes encoded "
                           f"and {Limits.json_depth} levels deep",
            "anyOf": [
                {"type": ["null", "boolean", "number"]},
                {"type": "string", "pattern": _NO_NUL},
                {"type": "array", "items": {"$ref": "#/components/schemas/JsonValue"}},
                {"type": "object", "propertyNames": {"pattern": _NO_NUL},
                 "additionalProperties": {"$ref": "#/components/schemas/JsonValue"}},
            ],
        },
        "NewTask": {
            "type": "object", "additionalProperties": False, "required": ["handler"],
            "description": "an optional field sent as null counts as absent",
            "not": {"required": ["delay_seconds", "run_at"], "description": "delay_seconds or run_at, not both",
                    "properties": {"delay_seconds": {"type": "number"}, "run_at": {"type": "string"}}},
            # large payloads: a payload_ref stands for the payload, so the payload is then null or absent
            "if": {"required": ["payload_ref"], "properties": {"payload_ref": {"type": "object"}}},
            "then": {"properties": {"payload": {"type": "null"}}},
            "properties": {
                "handler": name,
                "payload": {"$ref": "#/components/schemas/JsonValue"},
                "payload_ref": {"anyOf": [{"$ref": "#/components/schemas/PayloadRef"}, {"type": "null"}],
                                "description": "instead of payload: a large payload uploaded through "
                                               "POST /v1/queues/{queue}/payloads (not with a payload)"},
                "id": _nullable(task_id),
                "delay_seconds": {"type": ["number", "null"], "minimum": 0, "maximum": Limits.delay_seconds},
                "run_at": {"type": ["string", "null"], "format": "date-time"},
                "max_attempts": {"type": ["integer", "null"], "minimum": 1, "maximum": Limits.max_attempts},
                "backoff": _nullable(backoff),
                "headers": {"type": ["object", "null"], "maxProperties": Limits.headers_count,
                            "propertyNames": {"minLength": 1, "maxLength": Limits.header_key_chars, "pattern": _NO_NUL,
                                              "not": {"pattern": "^rdq\\."}, "description": "the rdq. prefix is reserved"},
                            "additionalProperties": {"type": "string", "maxLength": Limits.header_value_chars,
                                                     "pattern": _NO_NUL}},
                **flow_fields,
            },
        },
        "BatchRequest": {
            "type": "object", "additionalProperties": False, "required": ["tasks"],
            "properties": {"tasks": {"type": "array", "minItems": 1, "maxItems": Limits.batch_items,
                                     "description": "task ids must be unique within a batch (422 otherwise)",
                                     "items": {"$ref": "#/components/schemas/NewTask"}}},
        },
        "BatchResult": {
            "type": "object", "required": ["results", "created", "existing", "conflict"],
            "properties": {
                "results": {"type": "array", "items": {"oneOf": [
                    {"type": "object", "required": ["id", "queue", "result", "status"], "additionalProperties": False,
                     "properties": {
                        "id": {"type": "string"}, "queue": {"type": "string"},
                        "result": {"type": "string", "enum": ["created", "existing"]},
                        "deduplicated": {"type": "boolean", "description": "existing because its dedupe_key matched "
                                                                           "this task (id is the matched task's)"},
                        "status": {"$ref": "#/components/schemas/Status"}}},
                    {"type": "object", "required": ["id", "result"], "additionalProperties": False,
                     "description": "the id is taken on another queue; nothing was written",
                     "properties": {"id": {"type": "string"}, "result": {"const": "conflict"}}},
                ]}},
                "created": {"type": "integer"}, "existing": {"type": "integer"}, "conflict": {"type": "integer"},
                "deduplicated": {"type": "integer", "description": "of the existing ones, matched by dedupe_key"},
            },
        },
        "Status": {"type": "string", "enum": ["PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "CANCELLED"]},
        "Attempt": {
            "type": "object", "required": ["attempt_no", "outcome"],
            "properties": {
                "attempt_no": {"type": "integer", "minimum": 1},
                "outcome": {"type": "string", "enum": [o.value for o in Outcome]},
                "started_at": timestamp, "finished_at": timestamp, "error": error,
            },
        },
        "Task": {
            "type": "object",
            "required": ["id", "queue", "handler", "status", "attempt_count", "redrive_count", "attempts"],
            "properties": {
                "id": {"type": "string"}, "queue": {"type": "string"}, "handler": {"type": "string"},
                "created": {"type": "boolean", "description": "enqueue only: false when the id already existed on this queue"
                                                              " and nothing was enqueued"},
                "payload": {}, "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                "status": {"$ref": "#/components/schemas/Status"},
                "attempt_count": {"type": "integer"}, "redrive_count": {"type": "integer"},
                "max_attempts": {"type": ["integer", "null"]},
                "backoff": _nullable(backoff),
                "next_attempt_at": timestamp, "lease_expires_at": timestamp, "created_at": timestamp,
                "updated_at": timestamp, "dead_at": timestamp,
                "result": {}, "last_error": error,
                "attempts": {"type": "array", "items": {"$ref": "#/components/schemas/Attempt"}},
                "priority": {"type": "integer", "minimum": 0, "maximum": Limits.max_priority},
                "concurrency_key": _nullable(flow_key), "rate_key": _nullable(flow_key), "group": _nullable(flow_key),
                "dedupe_key": _nullable(flow_key),
                "claimed_at": {**timestamp, "description": "while IN_FLIGHT: when the running attempt was claimed"},
                "claimed_by": {"type": ["string", "null"], "maxLength": Limits.worker_chars,
                               "description": "while IN_FLIGHT: the worker holding the running attempt, as it "
                                              "named itself (rdq worker: host:pid and name; Lambda: function, "
                                              "request id and log stream); else null"},
                "deduplicated": {"type": "boolean", "description": "enqueue only: true when a task with the same "
                                                                   "dedupe_key was found and is returned instead"},
            },
        },
        "QueueStats": {
            "type": "object",
            "required": ["queue", "pending", "in_flight", "dead", "succeeded", "cancelled", "oldest_pending_age_seconds"],
            "properties": {
                "queue": {"type": "string"}, "pending": {"type": "integer"}, "in_flight": {"type": "integer"},
                "dead": {"type": "integer"}, "succeeded": {"type": "integer"}, "cancelled": {"type": "integer"},
                "oldest_pending_age_seconds": {"type": "number"},
                "paused": {"type": "boolean", "description": "workers claim nothing from a paused queue"},
            },
        },
        # The console's charts (rdq_core/storage/rollup.py): one point per minute, oldest first.
        "QueueMetrics": {
            "type": "object",
            "required": ["queue", "window", "step_seconds", "minutes", "succeeded", "retried", "dead_lettered",
                         "cancelled", "pending", "in_flight", "dead", "oldest_pending_age_seconds", "totals", "handlers"],
            "properties": {
                "queue": {"type": "string"}, "window": {"type": "string", "enum": ["hour", "day"]},
                "step_seconds": {"type": "integer"},
                "minutes": {"type": "array", "items": {"type": "integer"},
                            "description": "each point's start, epoch seconds: a minute apart over an hour, five over a day"},
                **{name: {"type": "array", "items": {"type": "number"},
                          "description": "per minute (over a day, the average of the point's minutes)"}
                   for name in ("succeeded", "retried", "dead_lettered", "cancelled")},
                "totals": {"type": "object", "additionalProperties": {"type": "integer"}},
                **{name: {"type": "array", "items": {"type": ["number", "null"]},
                          "description": "as the maintenance pass saw it when it closed the minute; null: no sample"}
                   for name in ("pending", "in_flight", "dead", "oldest_pending_age_seconds")},
                "handlers": {"type": "array", "items": {"type": "object", "required": ["handler", "summary"]}},
            },
        },
        "MetricsOverview": {
            "type": "object", "required": ["window", "step_seconds", "minutes", "totals", "queues"],
            "properties": {"window": {"type": "string"}, "step_seconds": {"type": "integer"},
                           "minutes": {"type": "array", "items": {"type": "integer"}},
                           "queues": {"type": "array", "items": {"type": "object", "required": ["queue"]}}},
        },
        "QueueList": {
            "type": "object", "required": ["queues"],
            "properties": {"queues": {"type": "array", "items": {"$ref": "#/components/schemas/QueueStats"}}},
        },
        "DeadPage": {
            "type": "object", "required": ["tasks", "next_cursor"],
            "properties": {"tasks": {"type": "array", "items": {"$ref": "#/components/schemas/Task"}},
                           "next_cursor": {"type": ["string", "null"]}},
        },
        "TaskPage": {
            "type": "object", "required": ["tasks", "next_cursor"],
            "description": "tasks without their attempt history (GET /v1/tasks/{task_id} has it)",
            "properties": {"tasks": {"type": "array", "items": {"$ref": "#/components/schemas/Task"}},
                           "next_cursor": {"type": ["string", "null"]}},
        },
        "AuditEntry": {
            "type": "object", "required": ["id", "at", "actor", "action", "queue", "selection", "count"],
            "properties": {
                "id": {"type": "string"}, "at": {"type": "string", "format": "date-time"},
                "actor": {"type": "string",
                          "description": "the IAM principal, api-key:<id>, or local (rdq dev, the CLI on a store)"},
                "action": {"type": "string",
                           "enum": ["redrive", "purge", "cancel", "pause", "resume", "cancel_operation", "schedule",
                                    "unschedule"]},
                "queue": {"type": "string"}, "selection": {"type": "object"}, "count": {"type": "integer"},
            },
        },
        "AuditPage": {
            "type": "object", "required": ["entries", "next_cursor"],
            "properties": {"entries": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEntry"}},
                           "next_cursor": {"type": ["string", "null"]}},
        },
        # Pause, resume and an operation's cancel take no parameters, but the body is still
        # JSON: the Content-Type is what keeps HTML forms and no-cors fetches out.
        "EmptyObject": {"type": "object", "additionalProperties": False, "maxProperties": 0},
        "TaskSelection": {
            "type": "object", "additionalProperties": False,
            "description": "ids, a filter (error_type and/or handler), or {\"all\": true}; an empty selection is refused."
                           " With dry_run the answer is {\"matched\": n} and nothing changes",
            "anyOf": [{"required": ["ids"]}, {"required": ["error_type"]}, {"required": ["handler"]},
                      {"required": ["all"], "properties": {"all": {"const": True}}}],
            "properties": {
                "ids": {"type": "array", "minItems": 1, "maxItems": Limits.batch_items, "items": task_id},
                "error_type": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": _NO_NUL},
                "handler": name,
                "all": {"type": "boolean"},
                "dry_run": {"type": "boolean"},
                "background": {"type": "boolean", "description": "run as a background operation (202)"},
                "rate_per_second": {"type": ["number", "null"], "minimum": Limits.operation_rate_min,
                                    "maximum": Limits.operation_rate_max,
                                    "description": "a background operation acting on at most this many tasks a second"},
            },
        },
        "Operation": {
            "type": "object", "required": ["id", "action", "queue", "status", "matched", "done"],
            "properties": {
                "id": {"type": "string"}, "action": {"type": "string", "enum": ["redrive", "purge", "cancel"]},
                "queue": {"type": "string"}, "selection": {"type": "object"},
                "status": {"type": "string", "enum": ["RUNNING", "SUCCEEDED", "CANCELLED"]},
                "matched": {"type": "integer", "description": "what the selection matched when it started"},
                "done": {"type": "integer"}, "rate_per_second": {"type": ["number", "null"]},
                "actor": {"type": "string"}, "started_at": timestamp, "updated_at": timestamp, "finished_at": timestamp,
            },
        },
        "OperationStarted": {"type": "object", "required": ["operation"],
                             "properties": {"operation": {"$ref": "#/components/schemas/Operation"}}},
        "OperationList": {"type": "object", "required": ["operations"],
                          "properties": {"operations": {"type": "array", "items": {"$ref": "#/components/schemas/Operation"}}}},
        "RedriveResult": _bulk_result("redriven"),
        "PurgeResult": _bulk_result("purged"),
        "CancelResult": _bulk_result("cancelled"),
        # -- large payloads (rdq_core.engine.payloads) --
        "PayloadRef": {
            "type": "object", "additionalProperties": False, "required": ["bucket", "key", "size", "sha256"],
            "description": "an object in the payload store, as POST /v1/queues/{queue}/payloads issued it",
            "properties": {"bucket": {"type": "string", "minLength": 1, "maxLength": 255},
                           "key": {"type": "string", "pattern": "^payloads/[a-z0-9][a-z0-9._-]{0,119}/"
                                                                f"{validation.TASK_ID.pattern}/[0-9a-f]{{32}}$"},
                           "size": {"type": "integer", "minimum": 0, "maximum": payloads.max_bytes()},
                           "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
        },
        "PayloadUploadRequest": {
            "type": "object", "additionalProperties": False, "required": ["size", "sha256", "task_id"],
            "properties": {"size": {"type": "integer", "minimum": 1, "maximum": payloads.max_bytes(),
                                    "description": "bytes of the payload's JSON (UTF-8); at most RDQ_PAYLOAD_MAX_BYTES"},
                           "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                           "task_id": {"type": "string", "pattern": f"^{validation.TASK_ID.pattern}$",
                                       "description": "the id of the task this payload is for: only that task may "
                                                      "be enqueued with the payload_ref"}},
        },
        "PayloadUpload": {
            "type": "object", "required": ["upload", "payload_ref"],
            "properties": {
                "upload": {"type": "object", "required": ["url", "method", "headers", "expires_in_seconds"],
                           "properties": {"url": {"type": "string"}, "method": {"const": "PUT"},
                                          "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                                          "expires_in_seconds": {"type": "integer"}}},
                "payload_ref": {"$ref": "#/components/schemas/PayloadRef"},
            },
        },
        "TaskObjects": {
            "type": "object", "required": ["payload", "result"],
            "properties": {name: {"type": ["object", "null"], "properties": {
                "payload_ref": {"type": "object"}, "url": {"type": "string"}, "expires_in_seconds": {"type": "integer"}}}
                for name in ("payload", "result")},
        },
        "OpenApiDocument": {"type": "object"},
        "Problem": {
            "type": "object", "required": ["type", "title", "status", "detail"],
            "properties": {"type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
                           "detail": {"type": "string"}, "field": {"type": "string"}, "instance": {"type": "string"}},
        },
    }


# -- schedules (rdq_core.engine.schedules) ----------------------------------------------------------
def _schedule_schemas() -> dict[str, Any]:
    name = {"type": "string", "pattern": f"^{SCHEDULE_NAME.pattern}$"}
    fields: dict[str, Any] = {
        "name": name,
        "expression": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": f"^{EXPRESSION_PATTERN}$",
                       "description": "rate(value unit) or cron(minutes hours day-of-month month day-of-week year), "
                                      "EventBridge Scheduler syntax; rdq dev also takes rate(N seconds)"},
        "timezone": {"type": "string", "enum": sorted(available_timezones()) or ["UTC"], "default": "UTC",
                     "description": "IANA time zone in which a cron is evaluated"},
        "queue": {"type": "string", "pattern": f"^{validation.QUEUE_NAME.pattern}$"},
        "handler": {"type": "string", "pattern": f"^{validation.HANDLER_NAME.pattern}$"},
        "payload": {"description": f"any JSON value, at most {Limits.payload_bytes} bytes encoded"},
        "max_attempts": {"type": ["integer", "null"], "minimum": 1, "maximum": Limits.max_attempts},
    }
    instant = {"type": ["string", "null"], "format": "date-time"}
    return {
        "NewSchedule": {"type": "object", "required": ["name", "expression", "queue", "handler"],
                        "additionalProperties": False, "properties": fields},
        "Schedule": {"type": "object", "required": ["name", "expression", "timezone", "queue", "handler"],
                     "properties": {**fields, "created_at": instant, "next_fire_at": instant,
                                    "next_task_id": {"type": ["string", "null"]}}},
        "ScheduleList": {"type": "object", "required": ["schedules"],
                         "properties": {"schedules": {"type": "array", "items": {"$ref": "#/components/schemas/Schedule"}}}},
        "ScheduleDeleted": {"type": "object", "required": ["deleted"], "properties": {"deleted": name}},
    }


def _operation(route: Route) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": route.operation_id, "summary": route.summary}
    parameters = [_PATH_PARAMS[name] for name in route.path_parameters] + [_QUERY_PARAMS[name] for name in route.query]
    if route.operation_id in _TRACED_OPERATIONS:  # trace context (rdq_core.engine.tracecontext)
        parameters += _TRACE_HEADERS
    if parameters:
        operation["parameters"] = parameters
    if route.request_schema is not None:
        operation["requestBody"] = {"required": True, "content": _json(route.request_schema)}
    operation["responses"] = {**{str(status): _ok(description, schema) for status, description, schema in route.responses},
                              **_problems(*route.problems)}
    return operation


def openapi_paths(routes: Iterable[Route]) -> dict[str, Any]:
    """The document's ``paths``, one operation per route of the table."""
    paths: dict[str, Any] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return paths


def openapi_document(
    routes: Iterable[Route], server_url: str = "/", auth_mode: str = "iam", bearer: bool = False
) -> dict[str, Any]:
    """The whole document for ``routes`` (``routes.ROUTES``), as served at ``server_url``."""
    paths = openapi_paths(routes)
    security_schemes: dict[str, Any] = {}
    security: list[dict[str, list[str]]] = []
    if bearer:
        security_schemes["bearer"] = {"type": "http", "scheme": "bearer"}
        security.append({"bearer": []})
    elif auth_mode == "api_key":
        security_schemes["apiKey"] = {"type": "apiKey", "in": "header", "name": "x-api-key"}
        security.append({"apiKey": []})
    elif auth_mode == "iam":
        security_schemes["sigv4"] = {"type": "apiKey", "in": "header", "name": "Authorization",
                                     "description": "AWS Signature Version 4 (service execute-api)"}
        security.append({"sigv4": []})
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "rdq", "version": "1",
                 "description": "Retry-and-dead-letter task queue. Errors are application/problem+json."},
        "servers": [{"url": server_url}],
        "paths": paths,
        "components": {
            "schemas": {**_schemas(), **_schedule_schemas()},
            "responses": {"Problem": {
                "description": "an RFC 9457 problem",
                "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
            }},
            "securitySchemes": security_schemes,
        },
    }
    if security:
        document["security"] = security
    return document
