"""The API function: every route of the HTTP API on Powertools' ``APIGatewayRestResolver``.

Errors are ``application/problem+json`` (RFC 9457) with a precise status: 400 malformed JSON,
401 missing bearer token (only when ``RDQ_API_TOKEN`` is set), 404 unknown task or route,
405 known route with another method, 409 conflicts, 413 body or payload too large, 415 not JSON,
422 invalid fields, 503 storage unreachable. Anything unexpected is a bare 500 problem: the
stack trace goes to the log, never into the response. Payloads are never logged unless the
deployer opts in with ``RDQ_LOG_PAYLOADS=true``.

Routes with a ``:verb`` suffix (``tasks:batch``, ``dlq:redrive``, ``dlq:purge``) are literal
rules here; API Gateway cannot hold ':' in a resource path part, so the template routes them
through ``/v1/queues/{queue}/{action}`` and the path still arrives intact in the event.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
import re
from datetime import datetime, timezone
from http import HTTPStatus
from typing import Any, Mapping

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response

from ..client import Client, build_new_task, build_new_tasks
from ..errors import InvalidCursor, InvalidInput, StorageUnavailable, TaskConflict, TaskNotFound
from ..model import EnqueueResult, NewTask
from ..validation import Limits
from .connection import shared_storage
from .invoker import invoker
from .observability import logger, metrics, tracer
from .openapi import openapi_document
from .settings import Settings

PROBLEM_JSON = "application/problem+json"

app = APIGatewayRestResolver()


class ApiProblem(Exception):
    """A request refused before it reached the engine (size, type, syntax, auth)."""

    def __init__(self, status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})


#: RFC 9110 titles, pinned: Python renamed these phrases in 3.13 ("Request Entity Too Large",
#: "Unprocessable Entity" before), and the problem ``type`` URNs derived from them must not change
#: with the runtime (docs/limits.md lists them).
_TITLES = {413: "Content Too Large", 422: "Unprocessable Content"}


def problem_title(status: int) -> str:
    return _TITLES.get(status) or HTTPStatus(status).phrase


def problem(status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None) -> Response:
    title = problem_title(status)
    body: dict[str, Any] = {
        "type": f"urn:rdq:problem:{title.lower().replace(' ', '-')}",
        "title": title,
        "status": status,
        "detail": detail,
    }
    if field is not None:
        body["field"] = field
    try:
        body["instance"] = app.current_event.path
    except Exception:  # noqa: BLE001 - no current event (resolver failed early)
        pass
    return Response(status_code=status, content_type=PROBLEM_JSON, body=json.dumps(body), headers=dict(headers or {}))


def reply(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(status_code=status, content_type="application/json", body=json.dumps(body), headers=dict(headers or {}))


# -- request plumbing --------------------------------------------------------------------------
def _settings() -> Settings:
    return app.context["settings"]


def _client() -> Client:
    return Client(shared_storage(_settings()))


def _header(name: str) -> str | None:
    headers = app.current_event.get("headers") or {}
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def _raw_body() -> bytes:
    event = app.current_event
    body = event.get("body")
    if body is None:
        return b""
    if event.get("isBase64Encoded"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ApiProblem(400, "the request body is not valid base64") from None
    return body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)


def json_body() -> dict[str, Any]:
    """The request body as a JSON object, or the precise 4xx for why it is not one."""
    raw = _raw_body()
    limit = _settings().max_body_bytes
    if len(raw) > limit:
        raise ApiProblem(413, f"the request body exceeds {limit} bytes")
    content_type = (_header("content-type") or "").split(";")[0].strip().lower()
    if content_type != "application/json" and not (content_type.startswith("application/") and content_type.endswith("+json")):
        raise ApiProblem(415, "send the body as application/json", headers={"Accept-Post": "application/json"})
    if not raw.strip():
        raise ApiProblem(400, "the request body is empty; a JSON object is required")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiProblem(400, f"the request body is not valid JSON: {exc}"[:300]) from None
    except RecursionError:
        raise ApiProblem(400, "the request body nests too deeply") from None
    if not isinstance(data, dict):
        raise InvalidInput("the request body must be a JSON object", "body")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # {"handler": "a", "handler": "b"} means different things to different parsers (a gateway or
    # WAF may read the first, Python keeps the last): refuse the ambiguity instead of picking.
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key {duplicate[:100]!r} in an object")
    return data


def _check_payload_size(item: Mapping[str, Any], field: str) -> None:
    # The engine would refuse an oversized payload as invalid (422); over HTTP the precise
    # answer is 413, so measure it here first, the same way the engine does.
    if "payload" not in item:
        return
    try:
        size = len(json.dumps(item["payload"], allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError):
        return  # not JSON-shaped, or a lone surrogate (UnicodeEncodeError): the engine reports it as a 422
    if size > Limits.payload_bytes:
        raise ApiProblem(413, f"{field} exceeds {Limits.payload_bytes} bytes once encoded as JSON", field)


def _log_payloads() -> bool:
    """Payloads are logged only when the deployer opts in with ``RDQ_LOG_PAYLOADS=true``."""
    return os.environ.get("RDQ_LOG_PAYLOADS", "").strip().lower() in {"1", "true", "yes", "on"}


def _due_now(task: NewTask) -> bool:
    if task.run_at is not None:
        return task.run_at <= datetime.now(timezone.utc)
    return task.delay_seconds <= 0


def _wake_worker(queue: str, new_tasks: list[NewTask], results: list[EnqueueResult]) -> None:
    if any(r.created and _due_now(t) for t, r in zip(new_tasks, results)):
        _wake_worker_for(queue)


def _wake_worker_for(queue: str) -> None:
    """Every action that makes work due now (enqueue, redrive) wakes a worker, so its latency
    does not wait for the schedule's next tick."""
    settings = _settings()
    if settings.wake_worker and settings.worker_function:
        invoker.wake(settings.worker_function, [queue], settings.wake_debounce_seconds)


# -- routes -----------------------------------------------------------------------------------
@app.post("/v1/queues/<queue>/tasks")
def enqueue_task(queue: str) -> Response:
    body = json_body()
    _check_payload_size(body, "payload")
    new_task = build_new_task(queue, body)
    (result,) = _client().storage.enqueue([new_task])
    if result.conflict:
        raise TaskConflict(f"task id {new_task.id!r} already exists on another queue")
    _wake_worker(queue, [new_task], [result])
    extra: dict[str, Any] = {"task_id": new_task.id, "queue": queue, "is_new": result.created}
    if _log_payloads():
        extra["payload"] = new_task.payload  # opted in: RDQ_LOG_PAYLOADS=true (never the default)
    logger.info("enqueued", extra=extra)
    # 200 with created=false: the id already existed on this queue and nothing was enqueued.
    status = 201 if result.created else 200
    return reply(status, {**result.task.to_dict(), "created": result.created}, {"Location": f"/v1/tasks/{result.task.id}"})


@app.post("/v1/queues/<queue>/tasks:batch")
def enqueue_batch(queue: str) -> Response:
    body = json_body()
    unknown = set(body) - {"tasks"}
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    items = body.get("tasks")
    if not isinstance(items, list):
        raise InvalidInput("tasks must be a list of task objects", "tasks")
    for index, item in enumerate(items[: Limits.batch_items]):
        if isinstance(item, Mapping):
            _check_payload_size(item, f"tasks[{index}].payload")
    new_tasks = build_new_tasks(queue, items)
    results = _client().storage.enqueue(new_tasks)  # one round trip for the whole batch
    _wake_worker(queue, new_tasks, results)
    # A conflict's task belongs to another queue: say only that the id is taken, not where or
    # in what state (the caller asked about this queue; the single enqueue's 409 says as much).
    per_item = [
        {"id": r.task.id, "result": "conflict"} if r.conflict else
        {"id": r.task.id, "queue": r.task.queue, "result": "created" if r.created else "existing", "status": r.task.status.value}
        for r in results
    ]
    counts = {kind: sum(1 for item in per_item if item["result"] == kind) for kind in ("created", "existing", "conflict")}
    logger.info("enqueued batch", extra={"queue": queue, "counts": counts})
    return reply(200, {"results": per_item, **counts})


@app.get("/v1/tasks/<task_id>")
def get_task(task_id: str) -> Response:
    return reply(200, _client().get(task_id).to_dict())


@app.delete("/v1/tasks/<task_id>")
def cancel_task(task_id: str) -> Response:
    task = _client().cancel(task_id)
    logger.info("cancelled", extra={"task_id": task_id, "queue": task.queue})
    return reply(200, task.to_dict())


@app.get("/v1/queues/<queue>/stats")
def queue_stats(queue: str) -> Response:
    return reply(200, _client().stats(queue).to_dict())


@app.get("/v1/queues/<queue>/dlq")
def list_dead(queue: str) -> Response:
    params = app.current_event.get("queryStringParameters") or {}
    unknown = set(params) - {"limit", "cursor", "error_type", "handler"}
    if unknown:  # a misspelt filter must not silently list (and invite purging) the whole DLQ
        raise InvalidInput(f"unknown query parameters: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    limit_text = params.get("limit")
    limit = 50
    if limit_text is not None:
        if not re.fullmatch(r"[0-9]{1,4}", limit_text):
            raise InvalidInput(f"limit must be an integer in 1..{Limits.page_size}", "limit")
        limit = int(limit_text)
    cursor = params.get("cursor") or None
    page = _client().list_dead(
        queue, limit=limit, cursor=cursor, error_type=params.get("error_type") or None, handler=params.get("handler") or None
    )
    return reply(200, {"tasks": [t.to_dict() for t in page.tasks], "next_cursor": page.next_cursor})


_SELECTION_FIELDS = {"ids", "error_type", "handler", "all"}


def _selection() -> dict[str, Any]:
    body = json_body()
    unknown = set(body) - _SELECTION_FIELDS
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    if "ids" in body and not (isinstance(body["ids"], list) and all(isinstance(i, str) for i in body["ids"])):
        raise InvalidInput("ids must be a list of task ids", "ids")
    if "all" in body and not isinstance(body["all"], bool):
        raise InvalidInput("all must be true or false", "all")
    for name in ("error_type", "handler"):
        if name in body and not isinstance(body[name], str):
            raise InvalidInput(f"{name} must be a string", name)
    return {"ids": body.get("ids"), "error_type": body.get("error_type"), "handler": body.get("handler"), "all": bool(body.get("all", False))}


@app.post("/v1/queues/<queue>/dlq:redrive")
def redrive_dead(queue: str) -> Response:
    count = _client().redrive(queue, **_selection())
    if count:
        _wake_worker_for(queue)  # redriven tasks are due now
    logger.info("redrove", extra={"queue": queue, "count": count})
    return reply(200, {"redriven": count})


@app.post("/v1/queues/<queue>/dlq:purge")
def purge_dead(queue: str) -> Response:
    count = _client().purge_dead(queue, **_selection())
    logger.info("purged dead", extra={"queue": queue, "count": count})
    return reply(200, {"purged": count})


@app.get("/v1/openapi.json")
def openapi() -> Response:
    event = app.current_event
    # Behind API Gateway the request context path carries the stage ("/Prod/v1/...").
    full_path = (event.get("requestContext") or {}).get("path") or event.path
    prefix = full_path[: -len(event.path)] if full_path.endswith(event.path) else ""
    return reply(200, openapi_document(server_url=prefix or "/", auth_mode=_settings().auth_mode, bearer=bool(_settings().api_token)))


# -- errors -----------------------------------------------------------------------------------
_ROUTE_METHODS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^/v1/queues/[^/]+/tasks/*$"), "POST"),
    (re.compile(r"^/v1/queues/[^/]+/tasks:batch/*$"), "POST"),
    (re.compile(r"^/v1/tasks/[^/]+/*$"), "GET, DELETE"),
    (re.compile(r"^/v1/queues/[^/]+/stats/*$"), "GET"),
    (re.compile(r"^/v1/queues/[^/]+/dlq/*$"), "GET"),
    (re.compile(r"^/v1/queues/[^/]+/dlq:(redrive|purge)/*$"), "POST"),
    (re.compile(r"^/v1/openapi\.json/*$"), "GET"),
]


@app.not_found
def not_found(exc: Exception) -> Response:
    path = app.current_event.path
    for pattern, methods in _ROUTE_METHODS:
        if pattern.match(path):
            return problem(405, f"{app.current_event.http_method} is not allowed here; use {methods}", headers={"Allow": methods})
    return problem(404, f"no route for {app.current_event.http_method} {path}")


@app.exception_handler(ApiProblem)
def on_api_problem(exc: ApiProblem) -> Response:
    return problem(exc.status, exc.detail, exc.field, exc.headers)


@app.exception_handler(InvalidInput)
def on_invalid_input(exc: InvalidInput) -> Response:
    return problem(400 if isinstance(exc, InvalidCursor) else 422, str(exc), exc.field)


@app.exception_handler(TaskNotFound)
def on_not_found(exc: TaskNotFound) -> Response:
    return problem(404, str(exc), "id")


@app.exception_handler(TaskConflict)
def on_conflict(exc: TaskConflict) -> Response:
    return problem(409, str(exc))


@app.exception_handler(StorageUnavailable)
def on_storage_unavailable(exc: StorageUnavailable) -> Response:
    logger.warning("storage unavailable", extra={"error": str(exc)})
    return problem(503, "the task store is unavailable; retry later", headers={"Retry-After": "5"})


@app.exception_handler(Exception)
def on_unexpected(exc: Exception) -> Response:
    logger.exception("unhandled error in the API")
    return problem(500, "internal error; see the function's log")


# -- entry point ------------------------------------------------------------------------------
def _unauthorized(settings: Settings, event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The local bearer-token check (``RDQ_API_TOKEN``); deployed APIs authenticate at API Gateway."""
    if not settings.api_token:
        return None
    headers = {k.lower(): v for k, v in (event.get("headers") or {}).items()}
    supplied = headers.get("authorization") or ""
    scheme, _, token = supplied.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_token.encode()):
        return None
    body = {"type": "urn:rdq:problem:unauthorized", "title": "Unauthorized", "status": 401,
            "detail": "send Authorization: Bearer <RDQ_API_TOKEN>", "instance": event.get("path")}
    return {"statusCode": 401, "headers": {"Content-Type": PROBLEM_JSON, "WWW-Authenticate": 'Bearer realm="rdq"'},
            "multiValueHeaders": {}, "body": json.dumps(body), "isBase64Encoded": False}


def handle_api_event(event: dict[str, Any], context: Any) -> dict[str, Any]:
    settings = Settings.from_env()
    denied = _unauthorized(settings, event)
    if denied is not None:
        return denied
    app.append_context(settings=settings)
    try:
        return app.resolve(event, context)
    finally:
        app.clear_context()


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId", clear_state=True)
@tracer.capture_lambda_handler(capture_response=False)
@metrics.log_metrics
def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    return handle_api_event(event, context)
