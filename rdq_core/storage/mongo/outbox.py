"""Lifecycle events in MongoDB: written onto the task document by the change itself, then moved
into the outbox collection, where deliverers lease and acknowledge them.
"""

from __future__ import annotations

import abc
import json
import uuid
from typing import Any, Mapping, Sequence

from pymongo import ASCENDING, UpdateOne
from pymongo.errors import BulkWriteError

from ...events import task_event_id
from ..spi import storable_json
from .connection import MongoConnection
from .shapes import _duplicate_positions, _duration_ms, _epoch_ms


class MongoOutbox(MongoConnection, abc.ABC):
    """Task events on their documents, and the outbox primitives."""

    def _events_on_task(self, doc: Mapping[str, Any], kind: str, attempt_no: int, error: Any, now_ms: int,
                        events_write: str) -> dict[str, Any]:
        """The ``$set`` fields that put one task event on the task document (after any its last
        write left there unmoved). ``events_write`` names the write, so only the mover of this
        write's events clears them; ``event_no`` orders one task's events within a millisecond."""
        event_no = int(doc.get("event_no") or 0) + 1
        number = doc.get("redrive_count", 0) + 1 if kind == "redriven" else attempt_no
        detail = {"handler": doc.get("handler"), "attempt": attempt_no,
                  "redrive_count": int(doc.get("redrive_count") or 0) + (1 if kind == "redriven" else 0),
                  "error": None if kind == "succeeded" else error,
                  "payload": json.loads(doc["payload_json"]) if self.events.include_payload and doc.get("payload_json") else None}
        # Named by the document's incarnation too, so a task id reused after a purge names new
        # events (created_at is only milliseconds here; a document older than the incarnation
        # field falls back to it).
        incarnation = doc.get("incarnation") or int(doc.get("created_at_ms") or 0) * 1000
        event_id = task_event_id(doc["_id"], kind, number, incarnation)
        event = {"_id": event_id, "type": f"rdq.task.{kind}", "queue": doc.get("queue"),
                 "task_id": doc["_id"], "at_ms": now_ms, "event_no": event_no, "detail_json": storable_json(detail),
                 "leased_until_ms": 0}
        return {"pending_events": [*(doc.get("pending_events") or []), event], "events_write": events_write,
                "event_no": event_no}

    def _move_events(self, task_ids: Sequence[str], events_write: str | None) -> None:
        """Copy the events waiting on these tasks into the outbox (an id already there is kept),
        then clear them from each task whose events are still the ones copied. A crash between
        the two steps copies them again on the next take: nothing is lost, nothing doubled."""
        if not task_ids:
            return
        query: dict[str, Any] = {"_id": {"$in": list(task_ids)}}
        query["events_write"] = events_write if events_write is not None else {"$exists": True}
        docs = list(self._tasks.find(query, {"pending_events": 1, "events_write": 1}))
        events = [event for d in docs for event in (d.get("pending_events") or [])]
        if events:
            try:
                self._outbox.insert_many(events, ordered=False)
            except BulkWriteError as exc:
                _duplicate_positions(exc)  # already moved: kept as it is
        self._at_crash_point("events:moved")
        if docs:
            self._tasks.bulk_write([UpdateOne({"_id": d["_id"], "events_write": d["events_write"]},
                                              {"$unset": {"pending_events": "", "events_write": ""}}) for d in docs],
                                   ordered=False)

    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        now_ms = _epoch_ms(self._server_now())
        docs = [{"_id": e["id"], "type": e["type"], "queue": e["queue"], "task_id": e["task_id"], "at_ms": now_ms,
                 "event_no": 0, "detail_json": e["detail"], "leased_until_ms": 0} for e in events]
        try:
            self._outbox.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            _duplicate_positions(exc)

    def _outbox_take(self, limit: int, lease_seconds: float) -> list[dict[str, Any]]:
        # Events a crashed settle or redrive left on their tasks first (an index probe when none).
        stranded = [d["_id"] for d in self._tasks.find({"events_write": {"$exists": True}}, {"_id": 1}, limit=200)]
        self._move_events(stranded, None)
        now_ms = _epoch_ms(self._server_now())
        order = [("at_ms", ASCENDING), ("event_no", ASCENDING), ("_id", ASCENDING)]
        ids = [d["_id"] for d in self._outbox.find({"leased_until_ms": {"$lte": now_ms}}, {"_id": 1}, sort=order,
                                                    limit=limit, batch_size=limit)]
        if not ids:
            return []
        # Leased under a fresh token, each only if no one leased it meanwhile; what carries the
        # token is what this call took.
        lease = uuid.uuid4().hex
        self._outbox.update_many({"_id": {"$in": ids}, "leased_until_ms": {"$lte": now_ms}},
                                 {"$set": {"leased_until_ms": now_ms + _duration_ms(lease_seconds), "lease": lease}})
        taken = self._outbox.find({"_id": {"$in": ids}, "lease": lease}, sort=order)
        return [{"id": d["_id"], "type": d["type"], "queue": d["queue"], "task_id": d.get("task_id"),
                 "at": d["at_ms"], "detail": d["detail_json"]} for d in taken]

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        return int(self._outbox.delete_many({"_id": {"$in": list(ids)}}).deleted_count)
