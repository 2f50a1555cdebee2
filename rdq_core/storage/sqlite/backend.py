"""The embedded default backend: one SQLite file, correct across threads and processes.

Every write runs inside ``BEGIN IMMEDIATE``, which takes SQLite's single write lock up front, so
a claim (``UPDATE … RETURNING`` over the oldest due rows) is atomic against every other writer
on the machine. The clock is read *while holding that lock*, which makes timestamps (and so the
DLQ order) monotonic in commit order. Times are stored as integer microseconds since the epoch.

WAL mode lets readers proceed during writes; the busy timeout makes writers queue instead of
failing, for a bounded time (``sqlite:///rdq.db?timeout=5``, seconds, default 30, at most 300):
past it a call raises ``StorageUnavailable`` like a network backend that cannot be reached, so
a writer stuck behind a held lock can never hang a claim loop. SQLite has no network, so
"round trips" here are statements, counted all the same.

Statements live in ``queries.sql``, schema steps in ``migrations/`` (``PRAGMA user_version`` is
the number of the last one applied); the shared behaviour is ``StorageCore``'s.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ...errors import StorageUnavailable, UnsupportedOperation
from ...flow import (
    MAX_GROUP_PROBES,
    PRIORITIES,
    Candidate,
    FlowPolicy,
    FlowState,
    candidate_count,
    choose_work_conserving,
)
from ...model import ClaimRef, NewTask, Settlement, TaskStatus
from ..codec import Record
from ..core import InsertedRecord, dedupe_states_of
from ..spi import storable_json, to_micros
from .connection import _Q as _Q  # the statements by name (tests read them from here)
from .connection import _marks, _now_micros, _records, _same_file, _tasks_by_id, _with_attempts
from .operator import SQLiteOperator


class SQLiteStorage(SQLiteOperator):
    """The SQLite store: enqueue, claim, extend, settle, release, the expired-lease scan, get,
    cancel and a handler's transaction here; the file, connections and write lock are
    ``connection.py``'s, the other primitives ``operator.py``'s."""

    # -- primitives ------------------------------------------------------------------------
    def _insert(self, tasks: Sequence[NewTask], connection: Any) -> Sequence[InsertedRecord]:
        if connection is not None:
            # The caller's transaction: run the statements, never commit or roll back.
            return self._insert_locked(self._joined(connection), _now_micros(), tasks)
        with self._write() as (conn, now):
            return self._insert_locked(conn, now, tasks)

    def _insert_locked(self, conn: sqlite3.Connection, now: int, tasks: Sequence[NewTask]) -> list[InsertedRecord]:
        # Inside the write lock nobody else can insert, so "exists" is decided once, here.
        existing = {r["id"]: r for r in _tasks_by_id(conn, [t.id for t in tasks])}
        self.round_trips += 1
        fresh: dict[str, dict[str, Any]] = {}
        for t in tasks:
            if t.id not in existing and t.id not in fresh:  # a repeat in the batch: its first
                fresh[t.id] = {
                    "id": t.id, "queue": t.queue, "handler": t.handler, "payload": storable_json(t.payload),
                    "headers": storable_json(dict(t.headers)), "status": TaskStatus.PENDING.value,
                    "max_attempts": t.max_attempts,
                    "backoff": storable_json(t.backoff.to_dict()) if t.backoff else None,
                    "next_attempt_at": _due_micros(t, now), "created_at": now, "updated_at": now,
                    "priority": t.priority, "concurrency_key": t.concurrency_key, "rate_key": t.rate_key,
                    "group": t.group, "dedupe_key": t.dedupe_key,
                }
        if fresh:
            self.round_trips += 1
            conn.executemany(_Q["insert"], [
                (r["id"], r["queue"], r["handler"], r["payload"], r["headers"], r["max_attempts"], r["backoff"],
                 r["next_attempt_at"], r["created_at"], r["updated_at"], r["priority"], r["concurrency_key"],
                 r["rate_key"], r["group"], r["dedupe_key"])
                for r in fresh.values()
            ])
        return [
            InsertedRecord(existing[t.id], False) if t.id in existing else InsertedRecord(fresh[t.id], True)
            for t in tasks
        ]

    def _insert_deduplicated(self, task: NewTask, connection: Any) -> InsertedRecord:
        # The write lock (BEGIN IMMEDIATE) serialises every enqueue: the match and the insert
        # below are one step to any other writer (in a caller's transaction: once it writes).
        if connection is not None:
            return self._dedupe_locked(self._joined(connection), _now_micros(), task)
        with self._write() as (conn, now):
            return self._dedupe_locked(conn, now, task)

    def _dedupe_locked(self, conn: sqlite3.Connection, now: int, task: NewTask) -> InsertedRecord:
        if (holder := _tasks_by_id(conn, [task.id])):
            return InsertedRecord(holder[0], False)
        since = None if task.dedupe_for_seconds is None else now - int(task.dedupe_for_seconds * 1_000_000)
        match = _records(self._execute(conn, _Q["dedupe_match"], {
            "queue": task.queue, "key": task.dedupe_key, "states": json.dumps(dedupe_states_of(task)),
            "since": since}))
        if not match:
            return self._insert_locked(conn, now, [task])[0]
        max_wait = task.dedupe_max_wait_seconds
        changed = _records(self._execute(conn, _Q["dedupe_apply"], {
            "id": match[0]["id"], "mode": task.dedupe_mode.value, "payload": storable_json(task.payload),
            "headers": storable_json(dict(task.headers)),
            "due": _due_micros(task, now), "now": now,
            "max_wait_us": None if max_wait is None else int(max_wait * 1_000_000)}))
        return InsertedRecord((changed or match)[0], False, deduplicated=True)

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy,
               worker: str) -> Sequence[Record]:
        with self._write() as (conn, now):
            lease_until = now + int(lease_seconds * 1_000_000)
            if flow.plain:
                records = _records(self._execute(conn, _Q["claim"], {
                    "queue": queue, "now": now, "lease_until": lease_until, "limit": limit, "worker": worker}))
            else:
                records = self._flow_claim(conn, queue, limit, now, lease_until, flow, worker)
        records.sort(key=lambda r: (r["priority"], r["next_attempt_at"], r["id"]))
        return records

    def _flow_claim(self, conn: sqlite3.Connection, queue: str, limit: int, now: int, lease_until: int,
                    flow: FlowPolicy, worker: str) -> list[dict[str, Any]]:
        """The claim under a flow policy: the write lock serialises it with every other claim, so
        what it reads (in-flight counts, the rate log, the fairness cursor) stays true until it
        commits; ``rdq_core.flow.choose`` decides."""
        if conn.execute(_Q["flow_paused"], {"queue": queue}).fetchone():
            return []
        state = self._flow_state(conn, queue, now, flow)

        def read(full_keys: list[str], full_rates: list[str]) -> list[Candidate]:
            params = {"queue": queue, "now": now, "full_keys": json.dumps(full_keys), "full_rates": json.dumps(full_rates)}
            if flow.fair_groups:
                return self._fair_candidates(conn, params, limit, state.last_group)
            candidates: list[Candidate] = []
            wanted = candidate_count(limit)
            for priority in PRIORITIES:
                # Without aging, the first priorities with due tasks fill the claim; with aging any
                # priority's oldest may rank first.
                if len(candidates) >= wanted and flow.priority_aging_seconds is None:
                    break
                candidates += _candidates(conn.execute(_Q["flow_candidates"], {**params, "priority": priority,
                                                                               "limit": wanted}))
            return candidates

        choice = choose_work_conserving(flow, state, read, limit)
        if not choice.ids:
            return []
        records = _records(self._execute(conn, _Q["flow_claim_ids"].replace("{marks}", _marks(len(choice.ids))),
                                         (now, worker, lease_until, now, *choice.ids)))
        if flow.rate_limit is not None:
            conn.executemany(_Q["flow_rate_log"], [(queue, r["rate_key"], now, r["id"]) for r in records if r["rate_key"]])
        if choice.served_group is not None:
            conn.execute(_Q["flow_served_group"], {"queue": queue, "group": choice.served_group})
        return records

    def _flow_state(self, conn: sqlite3.Connection, queue: str, now: int, flow: FlowPolicy) -> FlowState:
        in_flight_total, by_key = 0, {}
        if flow.limits_concurrency or flow.max_in_flight is not None:
            for row in conn.execute(_Q["flow_in_flight"], {"queue": queue}):
                in_flight_total += row[1]
                if row[0] is not None:
                    by_key[row[0]] = row[1]
        recent: dict[str, int] = {}
        if flow.rate_limit is not None:
            conn.execute(_Q["flow_rate_trim"], {"queue": queue, "since": now - int(flow.rate_limit.window_seconds * 1_000_000)})
            recent = {row[0]: row[1] for row in conn.execute(_Q["flow_rate_counts"], {"queue": queue})}
        last_group = None
        if flow.fair_groups:
            row = conn.execute(_Q["flow_last_group"], {"queue": queue}).fetchone()
            last_group = None if row is None else row[0]
        return FlowState(in_flight_total, by_key, recent, last_group)

    def _fair_candidates(self, conn: sqlite3.Connection, params: dict[str, Any], limit: int,
                         last_group: str | None) -> list[Candidate]:
        """Up to ``limit`` due tasks of each group, groups in name order from the one after
        ``last_group`` (wrapping round), until ``limit`` groups gave some; tasks without a group
        are one more group (''). A probe finds only a group with a due task whose keys are not
        known to be full, so groups of delayed or blocked tasks ahead cost a walk of their index
        entries, never a turn of the claim."""
        found: list[Candidate] = []
        groups = 0
        ungrouped = _candidates(conn.execute(_Q["flow_ungrouped_candidates"], {**params, "limit": limit}))
        if ungrouped:
            found += ungrouped
            groups += 1
        start = last_group or ""
        after, wrapped, probes = start, False, 0
        while groups < limit and probes < MAX_GROUP_PROBES:
            probes += 1
            row = conn.execute(_Q["flow_next_group"], {**params, "after": after}).fetchone()
            group = row[0] if row else None
            if group is None or (wrapped and group > start):
                if wrapped or not start:
                    break
                after, wrapped = "", True  # wrap round to the first group
                continue
            after = group
            batch = _candidates(conn.execute(_Q["flow_group_candidates"], {**params, "group": group, "limit": limit}))
            if batch:
                found += batch
                groups += 1
        return found

    def _extend(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, int]:
        extended: dict[str, int] = {}
        with self._write() as (conn, now):
            until = now + int(lease_seconds * 1_000_000)
            for ref in refs:
                row = self._execute(conn, _Q["extend_lease"], (until, now, ref.task_id, ref.claim_token)).fetchone()
                if row:
                    extended[ref.task_id] = row[0]
        return extended

    def _settle(self, settlements: Sequence[Settlement]) -> set[str]:
        with self._write() as (conn, now):
            return self._settle_locked(conn, now, settlements)

    def _settle_locked(self, conn: sqlite3.Connection, now: int, settlements: Sequence[Settlement]) -> set[str]:
        by_id: dict[str, dict[str, Any]] = {}
        for item in settlements:
            error_json = storable_json(item.error.to_dict()) if item.error else None
            by_id[item.task_id] = {
                "id": item.task_id, "token": item.claim_token, "status": item.status.value,
                "outcome": item.outcome.value, "delay_us": int(item.retry_delay_seconds * 1_000_000),
                "result": storable_json(item.result) if item.status is TaskStatus.SUCCEEDED else None,
                "error_type": item.error.type if item.error else None, "error": error_json,
                "started_us": int((item.started_after_seconds or 0.0) * 1_000_000),
            }
        rows = self._execute(conn, _Q["settle"], {"batch": storable_json(list(by_id.values())), "now": now}).fetchall()
        if rows:
            history = [
                {"id": task_id, "outcome": by_id[task_id]["outcome"],
                 "started_at": min(claimed_at + by_id[task_id]["started_us"], now),
                 "error": by_id[task_id]["error"]}
                for task_id, claimed_at in rows
            ]
            self._execute(conn, _Q["append_attempts"], {"applied": storable_json(history), "now": now})
            self._task_events(conn, now, [task_id for task_id, _ in rows], self.events.settled_statuses)
        return {task_id for task_id, _ in rows}

    # -- a task completed inside a transaction (rdq_core/engine/transactions.py) -------------------
    def _joined(self, connection: Any) -> sqlite3.Connection:
        """The caller's connection, once it is known to be open on this store's file."""
        if not isinstance(connection, sqlite3.Connection):
            raise UnsupportedOperation("connection must be a sqlite3.Connection to this store's file")
        files = [row[2] for row in connection.execute("PRAGMA database_list") if row[1] == "main"]
        if not files or not _same_file(files[0], self.path):
            raise UnsupportedOperation(f"connection is open on {files[0] if files else 'no file'!r}, "
                                       f"not on this store's file {self.path!r}")
        return connection

    def _begin(self, connection: Any) -> _HandlerTransaction:
        # The store's own: a connection of its own, so that the thread's connection (and any
        # store call the thread makes meanwhile) is not inside the handler's transaction.
        conn, owned = (self._connect(), True) if connection is None else (self._joined(connection), False)
        try:
            if conn.in_transaction:
                raise UnsupportedOperation("the connection is inside a transaction: commit or roll it back first "
                                           "(ctx.transaction() begins the transaction and commits it)")
            # The write lock up front, as every rdq write: the completion at the end cannot then
            # fail on a lock the transaction's own reads would have had to upgrade.
            conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            if owned:
                conn.close()
            raise
        return _HandlerTransaction(conn, owned)

    def _settle_on(self, connection: Any, settlements: Sequence[Settlement]) -> set[str]:
        if not isinstance(connection, sqlite3.Connection):
            raise UnsupportedOperation("connection must be a sqlite3.Connection to this store's file")
        return self._settle_locked(connection, _now_micros(), settlements)


    def _release(self, refs: Sequence[ClaimRef]) -> set[str]:
        released: set[str] = set()
        with self._write() as (conn, now):
            for ref in refs:
                row = self._execute(conn, _Q["release"], (now, ref.task_id, ref.claim_token)).fetchone()
                if row:
                    released.add(ref.task_id)
                    if row[2] is not None:
                        conn.execute(_Q["release_rate_log"], (row[1], row[2], row[3], row[0]))
        return released

    def _expired(self, limit: int, queue: str | None) -> Sequence[Record]:
        conn = self._conn()
        now = _now_micros()
        if queue is None:
            return _records(self._execute(conn, _Q["expired_leases"], (now, limit)))
        return _records(self._execute(conn, _Q["expired_leases_in_queue"], (now, queue, limit)))

    def _load(self, task_id: str) -> Record | None:
        conn = self._conn()
        found = _tasks_by_id(conn, [task_id])
        self.round_trips += 1
        return _with_attempts(conn, found)[0] if found else None

    def _cancel(self, task_id: str) -> tuple[Record | None, bool]:
        with self._write() as (conn, now):
            cancelled = _records(self._execute(conn, _Q["cancel"], (now, task_id)))
            if not cancelled:
                existing = _tasks_by_id(conn, [task_id])
                return (existing[0] if existing else None), False
        return _with_attempts(self._conn(), cancelled)[0], True


# -- helpers ------------------------------------------------------------------------------------

class _HandlerTransaction:
    """A handler's transaction (``Storage.begin_transaction``) on the caller's connection, or on
    one the store opened for it (``owned``: closed once the transaction is over). COMMIT and
    ROLLBACK are sent as statements: ``Connection.commit()`` does nothing in the sqlite3
    module's autocommit mode, where the BEGIN above still opened a transaction."""

    def __init__(self, connection: sqlite3.Connection, owned: bool) -> None:
        self.connection = connection
        self._owned = owned

    def commit(self) -> None:
        try:
            self.connection.execute("COMMIT")
        except sqlite3.Error as exc:
            self.rollback()
            raise StorageUnavailable(f"sqlite: commit failed: {exc}") from exc
        self._close()

    def rollback(self) -> None:
        try:
            if self.connection.in_transaction:
                self.connection.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # SQLite rolls back an unfinished transaction itself; nothing of it was committed
        finally:
            self._close()

    def _close(self) -> None:
        if self._owned:
            self._owned = False
            self.connection.close()


def _due_micros(task: NewTask, now: int) -> int:
    return to_micros(task.run_at) if task.run_at is not None else now + int(task.delay_seconds * 1_000_000)


def _candidates(cursor: sqlite3.Cursor) -> list[Candidate]:
    return [Candidate(**row) for row in _records(cursor)]


