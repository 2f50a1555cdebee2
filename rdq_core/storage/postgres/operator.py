"""PostgreSQL primitives for what the operator, the console and the maintenance pass ask:
keyset pages and counts of a selection (its status spliced in as a literal, so the planner
picks the status's partial index), cancel by filter, the DLQ's redrive and purge, counts,
retention, pausing, the outbox, engine documents and the audit trail: one statement each."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any


from ...model import TaskStatus
from ..primitives import LIVE_STATUSES, ORDER_FIELD, DeadSelection, QueueCounts, Selection
from ..spi import from_micros
from .connection import QUERIES, PostgresConnection, _text


class PostgresOperator(PostgresConnection, abc.ABC):
    """Selections, counts, retention, pausing, outbox, documents and audit."""

    def _page(self, selection: Selection, limit: int, history: bool) -> list[dict[str, Any]]:
        return self._fetch_all(*page_statement(selection, limit, history))

    def _count(self, selection: Selection) -> int:
        where, params = _where(selection)
        count: int = self._fetch_all(_spliced(QUERIES["count"], selection, where), params)[0]["n"]
        return count

    def _cancel_selected(self, selection: Selection) -> int:
        where, params = _where(selection)
        return self._rowcount(_spliced(QUERIES["cancel_selected"], selection, where), params)

    def _redrive(self, selection: DeadSelection) -> int:
        where, params = _where(selection)
        params.update(redriven_events=self.events.redriven, with_payload=self.events.include_payload)
        redriven: int = self._fetch_all(_spliced(QUERIES["redrive"], selection, where), params)[0]["n"]
        return redriven

    def _purge_dead(self, selection: DeadSelection) -> int:
        where, params = _where(selection)
        return self._rowcount(_spliced(QUERIES["purge_dead"], selection, where), params)

    def _stats(self, queue: str) -> QueueCounts:
        row = self._fetch_all(QUERIES["stats"], {"queue": queue})[0]
        counts = {status.value: row[status.value.lower()] for status in TaskStatus}
        return QueueCounts(counts=counts, oldest_due_age_seconds=row["oldest_pending_age_seconds"], paused=row["paused"])

    def _live_stats(self, queue: str) -> QueueCounts:
        row = self._fetch_all(QUERIES["live_stats"], {"queue": queue})[0]
        counts = {status.value: row[status.value.lower()] for status in LIVE_STATUSES}
        return QueueCounts(counts=counts, oldest_due_age_seconds=row["oldest_pending_age_seconds"], paused=row["paused"])

    def _queues(self) -> list[str]:
        return [row["queue"] for row in self._fetch_all(QUERIES["list_queues"])]

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        return self._rowcount(QUERIES["purge_succeeded"], {"older_than_seconds": older_than_seconds, "limit": limit})

    def _set_paused(self, queue: str, paused: bool) -> None:
        # Committed when this returns (autocommit): every claim that starts later sees it.
        self._rowcount(QUERIES["pause" if paused else "resume"], {"queue": _text(queue)})

    def _paused(self) -> list[str]:
        return [row["queue"] for row in self._fetch_all(QUERIES["paused"])]

    # The outbox: each call is one autocommit statement.
    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        self._rowcount(QUERIES["outbox_put"], {
            "ids": [e["id"] for e in events], "types": [e["type"] for e in events],
            "queues": [_text(e["queue"]) for e in events], "task_ids": [e["task_id"] for e in events],
            "details": [e["detail"] for e in events]})

    def _outbox_take(self, limit: int, lease_seconds: float) -> list[dict[str, Any]]:
        rows = self._fetch_all(QUERIES["outbox_take"], {"limit": limit, "lease_seconds": lease_seconds})
        return sorted(rows, key=lambda row: row["seq"])

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        return self._rowcount(QUERIES["outbox_ack"], {"ids": list(ids)})

    # Engine documents: each call is one autocommit statement on rdq_documents' primary key.
    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        rows = self._fetch_all(QUERIES["doc_get"], {"kind": kind, "key": key})
        return None if not rows else (int(rows[0]["version"]), str(rows[0]["body"]))

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        if expected is None:
            rows = self._fetch_all(QUERIES["doc_insert"], {"kind": kind, "key": key, "body": body})
        else:
            rows = self._fetch_all(QUERIES["doc_replace"], {"kind": kind, "key": key, "body": body, "expected": expected})
        return None if not rows else int(rows[0]["version"])

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        return self._rowcount(QUERIES["doc_delete"], {"kind": kind, "key": key, "expected": expected}) == 1

    def _doc_page(self, kind: str, after: str | None, limit: int) -> list[tuple[str, int, str]]:
        rows = self._fetch_all(QUERIES["doc_page"], {"kind": kind, "after": after or "", "limit": limit})
        return [(str(row["key"]), int(row["version"]), str(row["body"])) for row in rows]

    def _audit_append(self, entry: Mapping[str, Any]) -> datetime:
        params = {"id": entry["id"], "actor": _text(entry["actor"]), "action": _text(entry["action"]),
                  "queue": _text(entry["queue"]), "selection": _text(entry["selection"]), "count": entry["count"]}
        at: datetime = self._fetch_all(QUERIES["audit_append"], params)[0]["at"]
        return at

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> list[dict[str, Any]]:
        params = {"queue": None if queue is None else _text(queue), "limit": limit,
                  "before_at": None if before is None else from_micros(before[0]),
                  "before_id": None if before is None else before[1]}
        return self._fetch_all(QUERIES["audit_page"], params)


#: The column each status is listed by, as it may be spliced into a statement: a fixed table,
#: checked against the core's order when the module loads.
_ORDER_COLUMN = {TaskStatus.PENDING: "next_attempt_at", TaskStatus.IN_FLIGHT: "lease_expires_at",
                 TaskStatus.DEAD: "dead_at", TaskStatus.SUCCEEDED: "updated_at", TaskStatus.CANCELLED: "updated_at"}
assert _ORDER_COLUMN == dict(ORDER_FIELD), "every status is ordered by a column of rdq_tasks"


def page_statement(selection: Selection, limit: int, history: bool) -> tuple[str, dict[str, Any]]:
    """The statement and parameters of one keyset page (also what plan checks ``EXPLAIN``)."""
    where, params = _where(selection)
    if selection.after is not None:
        where += " " + QUERIES["after_cursor"]
        params.update(after_time=selection.after_time, after_id=selection.after_id)
    params["limit"] = limit
    return _spliced(QUERIES["page_with_history" if history else "page"], selection, where), params



def _where(selection: Selection) -> tuple[str, dict[str, Any]]:
    """The WHERE text and parameters of a selection (fragments from queries.sql); its status and
    order column are spliced in by ``_spliced``."""
    where = QUERIES["selection"]
    params: dict[str, Any] = {"queue": selection.queue}
    if selection.ids is not None:
        where += " " + QUERIES["filter_ids"]
        params["ids"] = list(selection.ids)
    if selection.error_type is not None:
        where += " " + QUERIES["filter_error_type"]
        params["error_type"] = selection.error_type
    if selection.handler is not None:
        where += " " + QUERIES["filter_handler"]
        params["handler"] = selection.handler
    return where, params



def _spliced(statement: str, selection: Selection, where: str) -> str:
    """``statement`` with its selection in place. The status goes in as a literal (a bind
    parameter would hide from the planner which partial index the statement may use); it and the
    order column come from ``TaskStatus`` and ``_ORDER_COLUMN``, never from request text."""
    status = TaskStatus(selection.status)
    return (statement.replace("{where}", where).replace("{status}", status.value)
            .replace("{order}", _ORDER_COLUMN[status]))
