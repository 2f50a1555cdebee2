"""The routes of tasks and queues: enqueue (one or a batch, a large payload uploaded first), read a
task, cancel it, list a queue's tasks and dead tasks, counts and metrics. The table that maps
paths to them is ``routes.py``."""

from __future__ import annotations

from typing import Any, Mapping

from ...aws.s3_payloads import PRESIGN_SECONDS
from ...engine import payload_uploads, payloads, tracecontext
from ...engine.new_tasks import build_new_task, build_new_tasks
from ...errors import InvalidInput
from ...validation import Limits
from .observability import logger
from .paging import dead_cursor_after, fields_of, task_body, task_cursor_after, within_budget
from .request import ApiRequest, Reply
from .route_support import (check_payload_size, client_for, log_payloads, page_limit, reject_unknown_fields,
                            wake_worker)


def enqueue_task(request: ApiRequest, queue: str) -> Reply:
    body = request.json_body()
    check_payload_size(body, "payload")
    body, ref_data = _split_payload_ref(body, "payload_ref")  # a large payload uploaded beforehand
    new_task = build_new_task(queue, body)
    ref = None if ref_data is None else _checked_ref(ref_data, queue, new_task.id, "payload_ref")
    if ref is not None:
        new_task = payloads.with_ref(new_task, ref)
    (new_task,) = tracecontext.stamped([new_task], tracecontext.request_headers(request.header))  # trace context
    result = client_for(request).enqueue_new(new_task)  # TaskConflict (409) if the id is taken on another queue
    if ref is not None:
        payload_uploads.enqueued(payloads.default_store(), ref, result.task)  # no longer a pending upload
    wake_worker(request, queue, [new_task], [result])
    extra: dict[str, Any] = {"task_id": new_task.id, "queue": queue, "is_new": result.created}
    if log_payloads():
        extra["payload"] = new_task.payload  # opted in: RDQ_LOG_PAYLOADS=true (never the default)
    logger.info("enqueued", extra=extra)
    # 200 with created=false: the id already existed on this queue and nothing was enqueued.
    status = 201 if result.created else 200
    answer = {**result.task.to_dict(), "created": result.created, "deduplicated": result.deduplicated}
    return Reply(status, answer, {"Location": f"/v1/tasks/{result.task.id}"})


def enqueue_batch(request: ApiRequest, queue: str) -> Reply:
    body = request.json_body()
    reject_unknown_fields(body, {"tasks"})
    items = body.get("tasks")
    if not isinstance(items, list):
        raise InvalidInput("tasks must be a list of task objects", "tasks")
    for index, item in enumerate(items[: Limits.batch_items]):
        if isinstance(item, Mapping):
            check_payload_size(item, f"tasks[{index}].payload")
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
    results = client_for(request).enqueue_new_many(new_tasks)  # one round trip for the whole batch
    for index, ref in checked.items():
        if not results[index].conflict:
            payload_uploads.enqueued(payloads.default_store(), ref, results[index].task)  # no longer pending uploads
    wake_worker(request, queue, new_tasks, results)
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
    return Reply(200, client_for(request).get(task_id).to_dict())


def cancel_task(request: ApiRequest, task_id: str) -> Reply:
    task = client_for(request).cancel(task_id)
    logger.info("cancelled", extra={"task_id": task_id, "queue": task.queue})
    return Reply(200, task.to_dict())


def queue_stats(request: ApiRequest, queue: str) -> Reply:
    return Reply(200, client_for(request).stats(queue).to_dict())


def list_queues(request: ApiRequest) -> Reply:
    return Reply(200, {"queues": [stats.to_dict() for stats in client_for(request).list_queues()]})


def queue_metrics(request: ApiRequest, queue: str) -> Reply:
    params = request.query(("window",))
    return Reply(200, client_for(request).storage.queue_metrics(queue, params.get("window") or "hour"))


def metrics_overview(request: ApiRequest) -> Reply:
    params = request.query(("window",))
    return Reply(200, client_for(request).storage.metrics_overview(params.get("window") or "hour"))


# Every list route's page is bounded by bytes as well as by limit (paging.py): it ends early,
# with a cursor, rather than exceed Lambda's 6 MB response limit.
DLQ_QUERY = ("cursor", "limit", "error_type", "handler", "fields")


def list_dead(request: ApiRequest, queue: str) -> Reply:
    params = request.query(DLQ_QUERY)
    fields = fields_of(params)
    page = client_for(request).list_dead(
        queue, limit=page_limit(params), cursor=params.get("cursor") or None,
        error_type=params.get("error_type") or None, handler=params.get("handler") or None,
    )
    tasks, next_cursor = within_budget(page.tasks, lambda t: task_body(t, fields), dead_cursor_after(queue),
                                       page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"tasks": tasks, "next_cursor": next_cursor})


TASKS_QUERY = ("status", "handler", "error_type", "cursor", "limit", "fields")


def list_tasks(request: ApiRequest, queue: str) -> Reply:
    params = request.query(TASKS_QUERY)
    fields = fields_of(params)
    page = client_for(request).list_tasks(
        queue, status=params.get("status") or None, handler=params.get("handler") or None,
        error_type=params.get("error_type") or None, limit=page_limit(params), cursor=params.get("cursor") or None,
    )
    tasks, next_cursor = within_budget(page.tasks, lambda t: task_body(t, fields), task_cursor_after(queue),
                                       page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"tasks": tasks, "next_cursor": next_cursor})


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
        return payload_uploads.checked_upload(payloads.default_store(), queue, data, task_id)
    except InvalidInput as exc:
        raise InvalidInput(str(exc), field_name) from None


def create_payload_upload(request: ApiRequest, queue: str) -> Reply:
    """Where to PUT a large payload (a presigned URL) and the reference to enqueue it with."""
    body = request.json_body()
    reject_unknown_fields(body, {"size", "sha256", "task_id"})
    offer = payload_uploads.upload_offer(payloads.default_store(), queue, body.get("size"), body.get("sha256"),
                                  body.get("task_id"))
    logger.info("payload upload offered", extra={"queue": queue, "size": body.get("size")})
    return Reply(201, offer)


def get_task_objects(request: ApiRequest, task_id: str) -> Reply:
    """Presigned download URLs of a task's payload and result when they are kept in the store."""
    task = client_for(request).get(task_id)
    store = payloads.default_store()
    answer: dict[str, Any] = {"payload": None, "result": None}
    for name, ref in (("payload", payloads.payload_ref(task)), ("result", payloads.result_ref(task.result))):
        if ref is not None and store is not None and ref.bucket == store.bucket:
            answer[name] = {"payload_ref": ref.to_dict(), "url": store.download_url(ref.key),
                            "expires_in_seconds": PRESIGN_SECONDS}
    return Reply(200, answer)
