"""Attempt history in MongoDB: the attempts collection, the rows a task carries until they are
recorded, and purges that delete tasks before their rows (see the package doc for why).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Mapping, Sequence

from pymongo import ASCENDING
from pymongo.errors import BulkWriteError, PyMongoError

from .connection import MongoConnection
from .shapes import _carried_rows, _duplicate_positions, _merged_history


log = logging.getLogger(__name__)


class MongoHistory(MongoConnection, abc.ABC):
    """Reading, recording and purging attempt rows."""

    def _purge(self, docs: Sequence[Mapping[str, Any]], still: dict[str, Any], name: str) -> int:
        """Delete the tasks ``docs`` (those still matching ``still``), then the attempt rows of
        the ones really gone.

        Tasks go first: a task that is still visible always has its whole history. A purge that
        dies in between leaves orphan rows; they carry the purged task's incarnation, so a new
        task with the same id never shows them and a settle replaces one that blocks its number
        (see ``_record_attempts``). Rows are deleted by (id, incarnation) for the same reason: a
        task re-enqueued under the same id meanwhile keeps its own history.
        """
        ids = [d["_id"] for d in docs]
        incarnations = sorted({d.get("incarnation") for d in docs}, key=lambda v: (v is not None, v or ""))
        selection = {"_id": {"$in": ids}, "incarnation": {"$in": incarnations}, **still}
        deleted = self._tasks.delete_many(selection).deleted_count
        self._at_crash_point(f"{name}:tasks_deleted")
        gone = set(ids)
        if deleted < len(ids):  # one was redriven (or re-enqueued) meanwhile: it keeps its rows
            gone -= {d["_id"] for d in self._tasks.find({"_id": {"$in": ids}, "incarnation": {"$in": incarnations}}, {"_id": 1})}
        if gone:
            self._attempts.delete_many({"task_id": {"$in": sorted(gone)}, "incarnation": {"$in": incarnations}})
        return deleted

    def _with_histories(self, docs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``docs`` as records carrying their ``attempts``: the attempts collection merged with
        the rows each task still carries, in at most one find. Tasks whose every attempt is on
        the task (never had one, or only unrecorded ones) cost no query."""
        with_history = [d for d in docs if d.get("attempt_seq") or _carried_rows(d)]
        to_read = [d for d in with_history
                   if set(range(1, (d.get("attempt_seq") or 0) + 1)) - {r["attempt_no"] for r in _carried_rows(d)}]
        rows_by_task: dict[str, list[dict[str, Any]]] = {}
        if to_read:
            for row in self._attempts.find(
                {"task_id": {"$in": [d["_id"] for d in to_read]}},
                sort=[("task_id", ASCENDING), ("attempt_no", ASCENDING)],
                batch_size=1000,
            ):
                rows_by_task.setdefault(row["task_id"], []).append(row)
        return [{**d, "attempts": _merged_history(d, rows_by_task.get(d["_id"], []))} for d in docs]

    def _recorded(self, rows: Sequence[Mapping[str, Any]]) -> set[str]:
        """write_ids of ``rows`` that are in the attempts collection (one find, by the unique
        index; none when there is nothing to look for)."""
        if not rows:
            return set()
        found = self._attempts.find(
            {"task_id": {"$in": sorted({r["task_id"] for r in rows})},
             "attempt_no": {"$in": sorted({r["attempt_no"] for r in rows})}},
            {"task_id": 1, "attempt_no": 1, "write_id": 1},
        )
        present = {(f["task_id"], f["attempt_no"], f.get("write_id")) for f in found}
        return {r["write_id"] for r in rows if (r["task_id"], r["attempt_no"], r["write_id"]) in present}

    def _lost_settlements(self, rows: list[dict[str, Any]]) -> set[str]:
        """write_ids among ``rows`` whose fenced task update did not win.

        A row that won is on its task (pending) until a later settle saw it recorded, so: on
        the task, or in the attempts collection. The task is read first: a row that leaves it
        is already in the collection by then.
        """
        task_ids = sorted({row["task_id"] for row in rows})
        docs = {
            d["_id"]: d
            for d in self._tasks.find(
                {"_id": {"$in": task_ids}}, {"attempt_seq": 1, "pending_attempts": 1, "last_attempt": 1}
            )
        }
        lost: set[str] = set()
        to_check: list[dict[str, Any]] = []
        for row in rows:
            doc = docs.get(row["task_id"])
            if doc is not None and row["write_id"] in {r["write_id"] for r in _carried_rows(doc)}:
                continue
            if doc is None or (doc.get("attempt_seq") or 0) < row["attempt_no"]:
                lost.add(row["write_id"])  # never committed (or the task is gone)
            else:
                to_check.append(row)
        if to_check:
            recorded = self._recorded(to_check)
            lost.update(row["write_id"] for row in to_check if row["write_id"] not in recorded)
        return lost

    def _record_attempts_or_keep(self, rows: list[dict[str, Any]]) -> set[str]:
        """``_record_attempts``, but a failure is not the settle's failure: the rows are safe on
        their tasks (committed, or about to be carried by the commit) and a later settle
        records them. Raising here would report a committed settle as failed."""
        try:
            return self._record_attempts(rows)
        except PyMongoError as exc:
            log.warning("could not record %d attempt row(s) yet; kept on their tasks: %s", len(rows), exc)
            return set()

    def _record_attempts(self, rows: list[dict[str, Any]]) -> set[str]:
        """Insert committed rows; returns the write_ids now known to be recorded. A row already
        there (recorded by an earlier settle) is fine.

        A duplicate that is *another* row holding the number can only be an orphan of an earlier
        task with this id (another incarnation, left by a purge that died half way): it is
        deleted and ours inserted. Anything else stays on the task for a later settle.
        """
        if not rows:
            return set()
        try:
            self._attempts.insert_many([dict(row) for row in rows], ordered=False)
            return {row["write_id"] for row in rows}
        except BulkWriteError as exc:
            clashing = [rows[position] for position in sorted(_duplicate_positions(exc))]
        done = {row["write_id"] for row in rows} - {row["write_id"] for row in clashing}
        mine = {(r["task_id"], r["attempt_no"]): r for r in clashing}
        existing = self._attempts.find(
            {"task_id": {"$in": sorted({r["task_id"] for r in clashing})},
             "attempt_no": {"$in": sorted({r["attempt_no"] for r in clashing})}},
            {"task_id": 1, "attempt_no": 1, "write_id": 1, "incarnation": 1},
        )
        orphans: list[Any] = []
        replace: list[dict[str, Any]] = []
        for found in existing:
            row = mine.get((found["task_id"], found["attempt_no"]))
            if row is None:
                continue
            if found.get("write_id") == row["write_id"]:
                done.add(row["write_id"])
            elif found.get("incarnation") != row.get("incarnation"):
                orphans.append(found["_id"])
                replace.append(row)
            else:
                log.warning("attempt %s of task %s is recorded by another write; kept on the task",
                            row["attempt_no"], row["task_id"])
        if orphans:
            self._attempts.delete_many({"_id": {"$in": orphans}})
            try:
                self._attempts.insert_many([dict(row) for row in replace], ordered=False)
                done.update(row["write_id"] for row in replace)
            except BulkWriteError as exc:
                _duplicate_positions(exc)  # a concurrent settle recorded it first: checked next time
        return done
