"""SQLite primitives for what the operator, the console and the maintenance pass ask: keyset
pages and counts of a selection, cancel by filter, the DLQ's redrive and purge, counts per
status, retention, pausing, the audit trail, the outbox and the engine documents."""

from __future__ import annotations

import abc
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from ..codec import Record
from ..primitives import QueueCounts, Selection
from ..spi import storable_json
from .connection import _Q, SQLiteConnection, _fill, _marks, _now_micros, _records, _with_attempts


class SQLiteOperator(SQLiteConnection, abc.ABC):
    """Selections, counts, retention, pausing, audit, outbox and documents, one statement each."""

    def _task_events(self, conn: sqlite3.Connection, now: int, ids: Sequence[str], statuses: Sequence[str]) -> None:
        """The lifecycle events of the tasks just changed, in the caller's transaction (one more
        statement, only when events are on)."""
        if ids and statuses:
            self._execute(conn, _Q["task_events"], {"ids": storable_json(list(ids)), "statuses": storable_json(list(statuses)),
                                                    "now": now, "with_payload": int(self.events.include_payload)})

    def _page(self, selection: Selection, limit: int, history: bool) -> Sequence[Record]:
        where, params = _where(selection)
        if selection.after is not None:
            where += " " + _fill(_Q["page_after"], order=selection.order_field)
            params += list(selection.after)
        conn = self._conn()
        records = _records(self._execute(conn, _fill(_Q["page"], selection=where, order=selection.order_field),
                                         params + [limit]))
        return _with_attempts(conn, records) if history else records

    def _count(self, selection: Selection) -> int:
        where, params = _where(selection)
        return int(self._execute(self._conn(), _fill(_Q["count_selected"], selection=where), params).fetchone()[0])

    def _cancel_selected(self, selection: Selection) -> int:
        where, params = _where(selection)
        with self._write() as (conn, now):
            return self._execute(conn, _fill(_Q["cancel_selected"], selection=where), [now] + params).rowcount

    def _redrive(self, selection: Selection) -> int:
        where, params = _where(selection)
        with self._write() as (conn, now):
            ids = [row[0] for row in self._execute(conn, _fill(_Q["redrive"], selection=where), [now, now] + params)]
            self._task_events(conn, now, ids, ("PENDING",) if self.events.redriven else ())
        return len(ids)

    def _purge_dead(self, selection: Selection) -> int:
        where, params = _where(selection)
        with self._write() as (conn, _):
            return self._execute(conn, _fill(_Q["purge_dead"], selection=where), params).rowcount

    def _stats(self, queue: str, counting: str = "status_counts") -> QueueCounts:
        conn = self._conn()
        now = _now_micros()
        counts = dict(self._execute(conn, _Q[counting], (queue,)).fetchall())
        oldest, paused = self._execute(conn, _Q["oldest_due"], (queue, now)).fetchone()
        return QueueCounts(counts, (now - oldest) / 1_000_000 if oldest is not None else None, paused=bool(paused))

    def _live_stats(self, queue: str) -> QueueCounts:
        return self._stats(queue, "live_status_counts")

    def _queues(self) -> list[str]:
        return [r[0] for r in self._execute(self._conn(), _Q["queues"]).fetchall()]

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        with self._write() as (conn, now):
            cutoff = now - int(older_than_seconds * 1_000_000)
            return self._execute(conn, _Q["purge_finished"], (cutoff, limit)).rowcount

    def _set_paused(self, queue: str, paused: bool) -> None:
        with self._write() as (conn, now):
            if paused:
                self._execute(conn, _Q["pause"], (queue, now))
            else:
                self._execute(conn, _Q["resume"], (queue,))

    def _paused(self) -> list[str]:
        return [r[0] for r in self._execute(self._conn(), _Q["paused"]).fetchall()]

    def _audit_append(self, entry: Mapping[str, Any]) -> int:
        # Under the write lock: entries are stamped in commit order, so (at, id) pages are stable.
        with self._write() as (conn, now):
            self._execute(conn, _Q["audit_append"], {**entry, "at": now})
        return now

    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        with self._write() as (conn, now):
            self.round_trips += 1
            conn.executemany(_Q["outbox_put"], [(e["id"], e["type"], e["queue"], e["task_id"], now, e["detail"])
                                                for e in events])

    def _outbox_take(self, limit: int, lease_seconds: float) -> Sequence[Record]:
        with self._write() as (conn, now):
            records = _records(self._execute(conn, _Q["outbox_take"], {
                "now": now, "until": now + int(lease_seconds * 1_000_000), "limit": limit}))
        return sorted(records, key=lambda r: r["seq"])

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        with self._write() as (conn, _):
            return self._execute(conn, _fill(_Q["outbox_ack"], marks=_marks(len(ids))), list(ids)).rowcount

    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        row = self._execute(self._conn(), _Q["doc_get"], (kind, key)).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        with self._write() as (conn, _):
            if expected is None:
                row = self._execute(conn, _Q["doc_insert"], (kind, key, body)).fetchone()
            else:
                row = self._execute(conn, _Q["doc_replace"], (body, kind, key, expected)).fetchone()
        return None if row is None else int(row[0])

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        with self._write() as (conn, _):
            return self._execute(conn, _Q["doc_delete"], (kind, key, expected)).rowcount == 1

    def _doc_page(self, kind: str, after: str | None, limit: int) -> Sequence[tuple[str, int, str]]:
        rows = self._execute(self._conn(), _Q["doc_page"], (kind, after or "", limit)).fetchall()
        return [(str(k), int(v), str(b)) for k, v, b in rows]

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> Sequence[Record]:
        where: list[str] = [_Q["audit_any"]]
        params: list[Any] = []
        if queue is not None:
            where.append(_Q["audit_queue"])
            params.append(queue)
        if before is not None:
            where.append(_Q["audit_before"])
            params += list(before)
        return _records(self._execute(self._conn(), _fill(_Q["audit_page"], where=" ".join(where)), [*params, limit]))


def _where(selection: Selection) -> tuple[str, list[Any]]:
    where = [_Q["selected_queue"]]
    params: list[Any] = [selection.queue, selection.status.value]
    if selection.ids is not None:
        where.append(_fill(_Q["dead_ids"], marks=_marks(len(selection.ids))))
        params += selection.ids
    if selection.error_type is not None:
        where.append(_Q["dead_error_type"])
        params.append(selection.error_type)
    if selection.handler is not None:
        where.append(_Q["dead_handler"])
        params.append(selection.handler)
    return " ".join(where), params
