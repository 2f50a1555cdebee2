"""Selections of one queue's tasks in MongoDB: keyset pages, counts, cancelling what a filter
selects, and the dead-letter queue's redrive and purge.
"""

from __future__ import annotations

import abc
import uuid
from typing import Any, Mapping, Sequence

from pymongo import ASCENDING, UpdateOne

from ...model import TaskStatus
from ..primitives import ORDER_FIELD, DeadSelection, Selection
from .connection import MongoConnection
from .history import MongoHistory
from .outbox import MongoOutbox
from .shapes import PURGE_CHUNK, _EVENT_FIELDS, _epoch_ms, _keyset_after, _selection_query


# A listing without history leaves out the attempt rows a task carries (codec reads none).
_WITHOUT_HISTORY = {"pending_attempts": 0, "last_attempt": 0, "pending_events": 0}
#: The stored key each status's tasks are listed by (the core's ORDER_FIELD, in this store's names).
_ORDER_KEY = {status: MongoConnection.codec.keys.get(field, field) for status, field in ORDER_FIELD.items()}


class MongoSelections(MongoHistory, MongoOutbox, abc.ABC):
    """The listing, browsing and DLQ primitives."""

    def _page(self, selection: Selection, limit: int, history: bool) -> Sequence[Mapping[str, Any]]:
        order = _ORDER_KEY[selection.status]
        query = _selection_query(selection)
        if selection.after is not None:
            query.update(_keyset_after(order, "task_id", selection.after))
        # The filter's equality on queue and status plus the sort walk the status's keyset index
        # (see the migrations) from the cursor on: the work follows the page size (plus what an
        # error-type or handler filter skips).
        docs = list(self._tasks.find(query, None if history else _WITHOUT_HISTORY,
                                     sort=[(order, ASCENDING), ("task_id", ASCENDING)],
                                     limit=limit, batch_size=limit))
        return self._with_histories(docs) if history else docs

    def _count(self, selection: Selection) -> int:
        return self._tasks.count_documents(_selection_query(selection))

    def _cancel_selected(self, selection: Selection) -> int:
        # One update_many: every document is matched and changed atomically on its own, its
        # filter (status PENDING) re-checked as it is written, so a task claimed meanwhile is
        # never cancelled. MongoDB has no atomic multi-document update without a transaction:
        # the selection is not cancelled as one step (a reader may see part of it cancelled, and
        # a task that becomes PENDING while the update runs may or may not be included).
        now_ms = _epoch_ms(self._server_now())
        query = {**_selection_query(selection), "status": TaskStatus.PENDING.value}
        result = self._tasks.update_many(
            query, {"$set": {"status": TaskStatus.CANCELLED.value, "updated_at_ms": now_ms}})
        return result.modified_count

    def _redrive(self, selection: DeadSelection) -> int:
        query = _selection_query(selection)
        now_ms = _epoch_ms(self._server_now())
        if self.events.redriven:
            return self._redrive_with_events(query, now_ms)
        result = self._tasks.update_many(
            query,
            {
                "$set": {
                    "status": TaskStatus.PENDING.value,
                    "attempt_count": 0,
                    "next_attempt_at_ms": now_ms,
                    "updated_at_ms": now_ms,
                },
                "$inc": {"redrive_count": 1},
                "$unset": {"dead_at_ms": ""},
            },
        )
        return result.modified_count

    def _redrive_with_events(self, query: Mapping[str, Any], now_ms: int) -> int:
        """Redrive with one rdq.task.redriven event per task on its document: each task is read
        and then written under a compare-and-set on its redrive count (an event names the count),
        in chunks; then the chunk's events are moved to the outbox."""
        redriven = 0
        while True:
            docs = list(self._tasks.find(query, {"_id": 1, "redrive_count": 1, "attempt_seq": 1, **_EVENT_FIELDS},
                                         limit=PURGE_CHUNK, batch_size=PURGE_CHUNK))
            if not docs:
                return redriven
            events_write = uuid.uuid4().hex
            operations = []
            for doc in docs:
                fields = self._events_on_task(doc, "redriven", int(doc.get("attempt_seq") or 0), doc.get("last_error"),
                                              now_ms, events_write)
                operations.append(UpdateOne(
                    {"_id": doc["_id"], "status": TaskStatus.DEAD.value, "redrive_count": doc.get("redrive_count", 0)},
                    {"$set": {"status": TaskStatus.PENDING.value, "attempt_count": 0, "next_attempt_at_ms": now_ms,
                              "updated_at_ms": now_ms, **fields},
                     "$inc": {"redrive_count": 1}, "$unset": {"dead_at_ms": ""}}))
            redriven += self._tasks.bulk_write(operations, ordered=False).modified_count
            self._at_crash_point("redrive:committed")
            self._move_events([d["_id"] for d in docs], events_write)
            if len(docs) < PURGE_CHUNK:
                return redriven

    def _purge_dead(self, selection: DeadSelection) -> int:
        query = _selection_query(selection)
        purged = 0
        while True:
            docs = list(self._tasks.find(query, {"_id": 1, "incarnation": 1}, limit=PURGE_CHUNK, batch_size=PURGE_CHUNK))
            if not docs:
                return purged
            purged += self._purge(docs, {"status": TaskStatus.DEAD.value}, "purge_dead")
            if len(docs) < PURGE_CHUNK:
                return purged
