"""Operator reads and switches in MongoDB: per-queue counts, the queue list, retention, pausing,
the audit trail, and the engine documents (each one single-document command).
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

from pymongo import ASCENDING, DESCENDING
from pymongo.errors import DuplicateKeyError

from ...model import TaskStatus
from ..primitives import LIVE_STATUSES, QueueCounts
from .history import MongoHistory
from .shapes import _document_id, _duration_ms, _epoch_ms, _keyset_before


_RETAINED_STATUSES = [TaskStatus.SUCCEEDED.value, TaskStatus.CANCELLED.value]


class MongoOperator(MongoHistory, abc.ABC):
    """The counting, retention, pausing, audit and engine-document primitives."""

    def _stats(self, queue: str, statuses: Sequence[TaskStatus] = tuple(TaskStatus)) -> QueueCounts:
        now_ms = _epoch_ms(self._server_now())
        # Each count is a range of the (queue, status) index: only the statuses asked for are read.
        counts = {
            status.value: self._tasks.count_documents({"queue": queue, "status": status.value})
            for status in statuses
        }
        oldest_due = self._tasks.find_one(
            {"queue": queue, "status": TaskStatus.PENDING.value, "next_attempt_at_ms": {"$lte": now_ms}},
            {"next_attempt_at_ms": 1},
            sort=[("next_attempt_at_ms", ASCENDING), ("task_id", ASCENDING)],
        )
        oldest_age = None if oldest_due is None else (now_ms - oldest_due["next_attempt_at_ms"]) / 1000
        return QueueCounts(counts, oldest_age)

    def _live_stats(self, queue: str) -> QueueCounts:
        return self._stats(queue, LIVE_STATUSES)

    def _queues(self) -> list[str]:
        return [q for q in self._tasks.distinct("queue") if isinstance(q, str)]

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        cutoff_ms = _epoch_ms(self._server_now()) - _duration_ms(older_than_seconds)
        finished = {"status": {"$in": _RETAINED_STATUSES}, "updated_at_ms": {"$lt": cutoff_ms}}
        docs = list(self._tasks.find(finished, {"_id": 1, "incarnation": 1}, limit=limit, batch_size=limit))
        if not docs:
            return 0
        return self._purge(docs, {"status": {"$in": _RETAINED_STATUSES}}, "purge_succeeded")

    def _set_paused(self, queue: str, paused: bool) -> None:
        # One document per queue ever flagged; resuming keeps it with paused false.
        self._queue_flags.update_one({"_id": queue}, {"$set": {"paused": paused}}, upsert=True)

    def _paused(self) -> list[str]:
        return [d["_id"] for d in self._queue_flags.find({"paused": True}, {"_id": 1}) if isinstance(d["_id"], str)]

    def _audit_append(self, entry: Mapping[str, Any]) -> int:
        # An insert cannot stamp the server's clock itself without an update pipeline (which
        # nx-27017 rejects), so the time is read with hello first, as every other write does.
        at_ms = _epoch_ms(self._server_now())
        self._audit.insert_one({
            "_id": entry["id"],
            "entry_id": entry["id"],  # a copy of _id for the compound indexes (see _new_task_doc)
            "at_ms": at_ms,
            "actor": entry["actor"],
            "action": entry["action"],
            "queue": entry["queue"],
            "selection": entry["selection"],
            "count": int(entry["count"]),
        })
        return at_ms

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> list[Mapping[str, Any]]:
        query: dict[str, Any] = {} if queue is None else {"queue": queue}
        if before is not None:
            query.update(_keyset_before("at_ms", "entry_id", before))
        docs = self._audit.find(query, sort=[("at_ms", DESCENDING), ("entry_id", DESCENDING)],
                                limit=limit, batch_size=limit)
        return [{"id": d["_id"], "at": d["at_ms"], "actor": d["actor"], "action": d["action"], "queue": d["queue"],
                 "selection": d["selection"], "count": d["count"]} for d in docs]

    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        doc = self._documents.find_one({"_id": _document_id(kind, key)}, {"version": 1, "body": 1})
        return None if doc is None else (int(doc["version"]), str(doc["body"]))

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        if expected is None:
            # Insert if absent: the unique _id (and the unique (kind, key) index) refuses a second.
            try:
                self._documents.insert_one(
                    {"_id": _document_id(kind, key), "kind": kind, "key": key, "version": 1, "body": body})
            except DuplicateKeyError:
                return None
            return 1
        # Replace at a version: the filter is re-checked as the document is written, so of two
        # writers at the same version exactly one matches.
        result = self._documents.update_one(
            {"_id": _document_id(kind, key), "version": expected},
            {"$set": {"version": expected + 1, "body": body}},
        )
        return expected + 1 if result.matched_count == 1 else None

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        return self._documents.delete_one({"_id": _document_id(kind, key), "version": expected}).deleted_count == 1

    def _doc_page(self, kind: str, after: str | None, limit: int) -> Sequence[tuple[str, int, str]]:
        # Strings compare by their UTF-8 bytes (no collation), walking rdq_document_key.
        docs = self._documents.find({"kind": kind, "key": {"$gt": after or ""}}, {"key": 1, "version": 1, "body": 1},
                                    sort=[("key", ASCENDING)], limit=limit, batch_size=limit)
        return [(str(d["key"]), int(d["version"]), str(d["body"])) for d in docs]
