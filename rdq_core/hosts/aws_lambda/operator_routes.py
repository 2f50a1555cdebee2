"""The operator's routes: bulk actions on a queue's tasks (redrive, purge, cancel; inline or as a
background operation), the operations themselves, pause and resume, the audit log, and schedules.
The table that maps paths to them is ``routes.py``."""

from __future__ import annotations

from typing import Any

from ...engine.schedules import schedule_body
from ...errors import InvalidInput
from ...validation import operation_rate
from .observability import logger
from .paging import audit_cursor_after, within_budget
from .request import ApiRequest, Reply
from .route_support import check_payload_size, client_for, page_limit, reject_unknown_fields, wake_worker_for


#: A bulk action matching more tasks than this runs as a background operation (202): one request
#: never has to act on an unbounded selection within API Gateway's 29 s.
INLINE_LIMIT = 1000


def _selection(request: ApiRequest) -> dict[str, Any]:
    body = request.json_body()
    reject_unknown_fields(body, {"ids", "error_type", "handler", "all", "dry_run", "background", "rate_per_second"})
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
    client = client_for(request)
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
        wake_worker_for(request, queue)  # redriven tasks are due now
    return reply


def purge_dead(request: ApiRequest, queue: str) -> Reply:
    return _bulk(request, queue, "purge", "purged")[0]


def cancel_selected(request: ApiRequest, queue: str) -> Reply:
    return _bulk(request, queue, "cancel", "cancelled")[0]


OPERATIONS_QUERY = ("queue", "limit")


def list_operations(request: ApiRequest) -> Reply:
    params = request.query(OPERATIONS_QUERY)
    found = client_for(request).list_operations(queue=params.get("queue") or None, limit=page_limit(params))
    return Reply(200, {"operations": [operation.to_dict() for operation in found]})


def get_operation(request: ApiRequest, operation_id: str) -> Reply:
    return Reply(200, client_for(request).get_operation(operation_id).to_dict())


def cancel_operation(request: ApiRequest, operation_id: str) -> Reply:
    _no_body(request)
    return Reply(200, client_for(request).cancel_operation(operation_id).to_dict())


def _no_body(request: ApiRequest) -> None:
    """Pause, resume and an operation's cancel take no parameters: an empty body or ``{}``, sent
    as ``application/json`` all the same. An HTML form or a ``no-cors`` fetch from another page
    cannot send that type, so the state-changing POSTs stay out of their reach (415) even where
    nothing else authenticates the caller (``rdq dev`` without a token)."""
    request.require_json_type()
    if request.event.get("body"):
        reject_unknown_fields(request.json_body(), set())


def pause_queue(request: ApiRequest, queue: str) -> Reply:
    _no_body(request)
    stats = client_for(request).pause(queue)
    logger.info("paused", extra={"queue": queue})
    return Reply(200, stats.to_dict())


def resume_queue(request: ApiRequest, queue: str) -> Reply:
    _no_body(request)
    stats = client_for(request).resume(queue)
    logger.info("resumed", extra={"queue": queue})
    if stats.pending:
        wake_worker_for(request, queue)  # what waited is due now
    return Reply(200, stats.to_dict())


AUDIT_QUERY = ("queue", "cursor", "limit")


def list_audit(request: ApiRequest) -> Reply:
    params = request.query(AUDIT_QUERY)
    queue = params.get("queue") or None
    page = client_for(request).list_audit(queue=queue, limit=page_limit(params), cursor=params.get("cursor") or None)
    entries, next_cursor = within_budget(page.entries, lambda e: e.to_dict(), audit_cursor_after(queue),
                                         page.next_cursor, request.settings.response_budget_bytes)
    return Reply(200, {"entries": entries, "next_cursor": next_cursor})


# -- schedules (rdq_core.engine.schedules) ----------------------------------------------------------
_SCHEDULE_FIELDS = {"name", "expression", "timezone", "queue", "handler", "payload", "max_attempts"}


def put_schedule(request: ApiRequest) -> Reply:
    """Create or replace a schedule: an EventBridge Scheduler schedule when deployed
    (``RDQ_SCHEDULE_GROUP``), the local schedules file under ``rdq dev``."""
    body = request.json_body()
    reject_unknown_fields(body, _SCHEDULE_FIELDS)
    check_payload_size(body, "payload")
    schedule = client_for(request).put_schedule(body)
    logger.info("schedule put", extra={"schedule": schedule.name, "queue": schedule.queue})
    return Reply(200, schedule_body(schedule), {"Location": f"/v1/schedules/{schedule.name}"})


def list_schedules(request: ApiRequest) -> Reply:
    return Reply(200, {"schedules": [schedule_body(s) for s in client_for(request).list_schedules()]})


def delete_schedule(request: ApiRequest, schedule: str) -> Reply:
    client_for(request).delete_schedule(schedule)
    logger.info("schedule deleted", extra={"schedule": schedule})
    return Reply(200, {"deleted": schedule})
