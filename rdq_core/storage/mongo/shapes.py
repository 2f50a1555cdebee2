"""How rdq's values are laid out in MongoDB: task documents, the filters that fence and select them,
keyset bounds, the attempt rows a task carries, and instants as epoch milliseconds. Plain
functions shared by every part of the backend (``backend.py`` and the modules beside it).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Mapping, TypeGuard

from pymongo.errors import BulkWriteError

from ...model import ClaimRef, DedupeMode, NewTask, TaskStatus
from ..primitives import Selection
from ..spi import storable_json, to_micros


DUPLICATE_KEY = 11000
# purge_dead works through large selections in chunks so one delete never carries a huge $in.
PURGE_CHUNK = 500
#: What a task event is built from (``_events_on_task``).
_EVENT_FIELDS = {"queue": 1, "handler": 1, "redrive_count": 1, "payload_json": 1, "last_error": 1,
                 "pending_events": 1, "event_no": 1, "incarnation": 1, "created_at_ms": 1}


def _new_task_doc(new: NewTask, now_ms: int) -> dict[str, Any]:
    if new.run_at is not None:  # the one instant a client may set with its own clock
        next_attempt_ms = _epoch_ms(new.run_at)
    else:
        next_attempt_ms = now_ms + _duration_ms(new.delay_seconds or 0.0)
    return {
        "_id": new.id,
        # A copy of _id for compound indexes and sorts: nx-27017 cannot index _id inside a
        # compound key (inserts then fail with "JSON path error near '_id'").
        "task_id": new.id,
        "queue": new.queue,
        "handler": new.handler,
        # JSON text, not BSON sub-documents: arbitrary keys ("$where", "a.b") survive untouched
        # and can never be read as query or update operators.
        "payload_json": storable_json(new.payload),
        "headers_json": storable_json(dict(new.headers or {})),
        "status": TaskStatus.PENDING.value,
        "attempt_count": 0,
        "redrive_count": 0,
        "attempt_seq": 0,
        # Random per task document: attempt rows carry it, so rows an interrupted purge left
        # behind never count as the history of a later task with the same id.
        "incarnation": uuid.uuid4().hex,
        "max_attempts": new.max_attempts,
        # Flow control: always present, so the claim's sort and the fair claim's groups see every
        # task ('' = no group: the server's distinct leaves nulls out).
        "priority": int(new.priority or 0),
        "concurrency_key": new.concurrency_key,
        "rate_key": new.rate_key,
        "group": new.group or "",
        "dedupe_key": new.dedupe_key,
        "backoff": new.backoff.to_dict() if new.backoff else None,
        "next_attempt_at_ms": next_attempt_ms,
        "created_at_ms": now_ms,
        "updated_at_ms": now_ms,
    }


def _dedupe_change(task: NewTask, match: Mapping[str, Any], now_ms: int) -> dict[str, Any]:
    """The fields a dedupe mode sets on a PENDING match (none for skip)."""
    if task.dedupe_mode is DedupeMode.REPLACE:
        return {"payload_json": storable_json(task.payload), "headers_json": storable_json(dict(task.headers or {})),
                "updated_at_ms": now_ms}
    if task.dedupe_mode is DedupeMode.DEBOUNCE:
        due = _new_task_doc(task, now_ms)["next_attempt_at_ms"]
        if task.dedupe_max_wait_seconds is not None:
            due = min(due, int(match["created_at_ms"]) + _duration_ms(task.dedupe_max_wait_seconds))
        return {"next_attempt_at_ms": due, "updated_at_ms": now_ms}
    return {}


def _document_id(kind: str, key: str) -> str:
    """An engine document's _id: kind and key cannot contain a space, so the join is unambiguous
    (nx-27017 cannot index _id inside a compound key, hence one string rather than a sub-document)."""
    return f"{kind} {key}"


def _held_by(ref: ClaimRef) -> dict[str, Any]:
    """The fencing filter: the task is IN_FLIGHT under exactly this claim token."""
    return {"_id": ref.task_id, "status": TaskStatus.IN_FLIGHT.value, "claim_token": ref.claim_token}


def _holds(doc: Mapping[str, Any] | None, claim_token: str) -> TypeGuard[Mapping[str, Any]]:
    return (
        doc is not None
        and doc.get("status") == TaskStatus.IN_FLIGHT.value
        and doc.get("claim_token") == claim_token
    )


def _selection_query(selection: Selection) -> dict[str, Any]:
    query: dict[str, Any] = {"queue": selection.queue, "status": selection.status.value}
    if selection.ids is not None:
        query["_id"] = {"$in": list(selection.ids)}
    if selection.error_type is not None:
        query["last_error.type"] = selection.error_type
    if selection.handler is not None:
        query["handler"] = selection.handler
    return query


def _keyset_after(order: str, tie: str, after: tuple[int, str]) -> dict[str, Any]:
    """The filter for positions strictly after ``after`` = (epoch micros, id) in the order
    ``(order, tie)`` ascending, where ``order`` holds epoch milliseconds. The range on ``order``
    bounds the index scan; the ``$or`` only skips the ties at its start."""
    micros, after_id = after
    if micros % 1000:  # between two milliseconds: no stored instant ties with it
        return {order: {"$gt": micros // 1000}}
    ms = micros // 1000
    return {order: {"$gte": ms}, "$or": [{order: {"$gt": ms}}, {tie: {"$gt": after_id}}]}


def _keyset_before(order: str, tie: str, before: tuple[int, str]) -> dict[str, Any]:
    """The filter for positions strictly before ``before`` = (epoch micros, id) (see
    ``_keyset_after``)."""
    micros, before_id = before
    if micros % 1000:
        return {order: {"$lte": micros // 1000}}
    ms = micros // 1000
    return {order: {"$lte": ms}, "$or": [{order: {"$lt": ms}}, {tie: {"$lt": before_id}}]}


def _carried_rows(doc: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The attempt rows a task document carries: committed, not yet seen recorded. Includes a
    schema 1 ``last_attempt`` (which lacks the incarnation of a task created since)."""
    if not doc:
        return []
    rows = [dict(row) for row in doc.get("pending_attempts") or ()]
    last = doc.get("last_attempt")
    if last and last.get("write_id") not in {row.get("write_id") for row in rows}:
        rows.insert(0, {**last, "incarnation": doc.get("incarnation")})
    return rows


def _merged_history(doc: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The task's rows from the attempts collection -- only its own incarnation's, never an
    earlier task's with the same id -- plus the rows the task still carries."""
    incarnation = doc.get("incarnation")
    by_number = {row["attempt_no"]: row for row in rows if row.get("incarnation") == incarnation}
    for row in _carried_rows(doc):
        by_number[row["attempt_no"]] = row
    return list(by_number.values())


def _duplicate_positions(exc: BulkWriteError) -> set[int]:
    """Positions that failed only as duplicate keys; anything else is re-raised."""
    errors = exc.details.get("writeErrors", [])
    if exc.details.get("writeConcernErrors") or any(e.get("code") != DUPLICATE_KEY for e in errors):
        raise exc
    return {e["index"] for e in errors}


def _epoch_ms(value: datetime) -> int:
    return to_micros(value) // 1000


def _duration_ms(seconds: float) -> int:
    return max(0, round(float(seconds) * 1000))
