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
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...errors import ConfigurationError, StorageUnavailable, UnsupportedOperation
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
from ..codec import Record, RecordCodec, epoch_micros
from ..core import InsertedRecord, QueueCounts, Selection, StorageCore, dedupe_states_of
from ..querytext import migrations, named_queries
from ..spi import from_micros, storable_json, to_micros

#: Seconds a writer waits for SQLite's write lock before the call fails as StorageUnavailable.
DEFAULT_BUSY_TIMEOUT = 30.0
#: The URL may lower or raise the busy timeout, but never make it unbounded.
MAX_BUSY_TIMEOUT = 300.0

# SQLite result codes that mean "the store cannot serve this right now" (another process holds
# the lock, the disk failed or filled up) rather than a bug in a statement.
_UNAVAILABLE_CODES = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_FULL", "SQLITE_PROTOCOL")

_PACKAGE = __name__.rpartition(".")[0]
_QUERIES = named_queries(_PACKAGE, "queries.sql")
_Q = {name: text.replace("{task_columns}", _QUERIES["task_columns"].strip()) for name, text in _QUERIES.items()}
_Q["claim"] = _Q["claim"].replace("{due_of_priority}", " UNION ALL ".join(
    _Q["due_of_priority"].strip().replace("{priority}", str(p)) for p in PRIORITIES))
MIGRATIONS = migrations(_PACKAGE)
#: ``PRAGMA user_version`` of a database that has every migration.
SCHEMA_VERSION = MIGRATIONS[-1].version

# Ids per IN list: SQLite builds before 3.32 bind at most 999 parameters per statement.
_ID_CHUNK = 500


class SQLiteStorage(StorageCore):
    schemes = ("sqlite",)
    store_name = "SQLite"
    # No cross-process push: an idle worker polls, often (an empty claim is a local read).
    # `rdq dev`'s API wakes its in-process worker itself (hosts.aws_lambda.invoker).
    idle_poll_seconds = 0.1
    codec = RecordCodec(time=epoch_micros)
    transient_errors = (sqlite3.OperationalError,)  # narrowed to the unavailable codes by is_transient
    # A sqlite3.Connection to this store's file: enqueue and a handler's transaction join it.
    joins_transactions = True

    def __init__(self, url: str, *, busy_timeout_seconds: float = DEFAULT_BUSY_TIMEOUT) -> None:
        parts = urlsplit(url)
        path = unquote(parts.path.removeprefix("/"))
        if not path or path == ":memory:":
            raise ConfigurationError("sqlite URL needs a file path: sqlite:///relative.db or sqlite:////absolute.db")
        self.path = path
        query = dict(parse_qsl(parts.query))
        if "timeout" in query:
            try:
                busy_timeout_seconds = float(query["timeout"])
            except ValueError:
                raise ConfigurationError(f"sqlite URL: timeout must be seconds, got {query['timeout']!r}") from None
        if not (math.isfinite(busy_timeout_seconds) and 0 <= busy_timeout_seconds <= MAX_BUSY_TIMEOUT):
            raise ConfigurationError(f"sqlite busy timeout must be between 0 and {MAX_BUSY_TIMEOUT:g} seconds")
        self.busy_timeout_seconds = busy_timeout_seconds
        self._local = threading.local()
        self._all_connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._schema_checked = False
        self.round_trips = 0

    def is_transient(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        name = getattr(exc, "sqlite_errorname", "") or ""
        if name:
            return name.startswith(_UNAVAILABLE_CODES)
        text = str(exc).lower()  # Python < 3.11 has no error names
        return "locked" in text or "busy" in text or "disk i/o" in text or "unable to open" in text

    # -- connections -----------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._lock:
                self._all_connections.append(conn)
            if not self._schema_checked:
                # The embedded default promises zero setup: bring a new or old file up to date.
                self._schema_checked = True
                if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                    self.migrate()
        return conn

    def _connect(self) -> sqlite3.Connection:
        """A new connection to the file with this store's settings (autocommit, WAL)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        conn = sqlite3.connect(
            self.path, timeout=self.busy_timeout_seconds, isolation_level=None, check_same_thread=False
        )
        try:
            self._enter_wal_mode(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return conn

    def _enter_wal_mode(self, conn: sqlite3.Connection) -> None:
        """Switch a file to WAL, waiting out other openers like any writer would.

        Switching needs the file to itself and SQLite answers "database is locked" at once
        instead of calling the busy handler, so processes opening a new file together (workers
        started at once, each auto-migrating) retry here, within the busy timeout. A file
        already in WAL mode (every one after its first opening) answers without a lock.
        """
        deadline = time.monotonic() + self.busy_timeout_seconds
        pause = 0.001
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not self.is_transient(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @contextmanager
    def _write(self) -> Iterator[tuple[sqlite3.Connection, int]]:
        """A write transaction holding the database write lock; yields (conn, now_micros)."""
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise StorageUnavailable(f"sqlite: {exc}") from exc
        try:
            yield conn, _now_micros()
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:
            # A COMMIT that failed leaves the transaction open on this thread's connection:
            # roll it back so the next call can begin, and report the write as not done.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _execute(self, conn: sqlite3.Connection, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self.round_trips += 1
        return conn.execute(sql, params)

    # -- lifecycle -------------------------------------------------------------------------
    def migrate(self) -> None:
        with self.translated_errors(), self._write() as (conn, _):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for migration in MIGRATIONS:
                if migration.version > version:
                    for statement in _statements(migration.text):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {migration.version}")

    def close(self) -> None:
        with self._lock:
            for conn in self._all_connections:
                conn.close()
            self._all_connections.clear()
        self._local = threading.local()

    # -- primitives ------------------------------------------------------------------------
    def _now(self) -> datetime:
        return from_micros(_now_micros())

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

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> Sequence[Record]:
        with self._write() as (conn, now):
            lease_until = now + int(lease_seconds * 1_000_000)
            if flow.plain:
                records = _records(self._execute(
                    conn, _Q["claim"], {"queue": queue, "now": now, "lease_until": lease_until, "limit": limit}))
            else:
                records = self._flow_claim(conn, queue, limit, now, lease_until, flow)
        records.sort(key=lambda r: (r["priority"], r["next_attempt_at"], r["id"]))
        return records

    def _flow_claim(self, conn: sqlite3.Connection, queue: str, limit: int, now: int, lease_until: int,
                    flow: FlowPolicy) -> list[dict[str, Any]]:
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
                                         (now, lease_until, now, *choice.ids)))
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

    def _task_events(self, conn: sqlite3.Connection, now: int, ids: Sequence[str], statuses: Sequence[str]) -> None:
        """The lifecycle events of the tasks just changed, in the caller's transaction (one more
        statement, only when events are on)."""
        if ids and statuses:
            self._execute(conn, _Q["task_events"], {"ids": storable_json(list(ids)), "statuses": storable_json(list(statuses)),
                                                    "now": now, "with_payload": int(self.events.include_payload)})

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


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _now_micros() -> int:
    return time.time_ns() // 1000


def _due_micros(task: NewTask, now: int) -> int:
    return to_micros(task.run_at) if task.run_at is not None else now + int(task.delay_seconds * 1_000_000)


def _fill(text: str, **parts: str) -> str:
    for name, part in parts.items():
        text = text.replace("{" + name + "}", part)
    return text


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _candidates(cursor: sqlite3.Cursor) -> list[Candidate]:
    return [Candidate(**row) for row in _records(cursor)]


def _records(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    rows = cursor.fetchall()
    if not rows:
        return []
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in rows]


def _tasks_by_id(conn: sqlite3.Connection, ids: Sequence[str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start:start + _ID_CHUNK]
        found += _records(conn.execute(_fill(_Q["tasks_by_id"], marks=_marks(len(chunk))), chunk))
    return found


def _with_attempts(conn: sqlite3.Connection, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records, each with its ``attempts``, read in one statement for all of them."""
    if not records:
        return records
    by_task: dict[str, list[dict[str, Any]]] = {r["id"]: [] for r in records}
    for attempt in _records(conn.execute(_fill(_Q["attempts_of"], marks=_marks(len(by_task))), list(by_task))):
        by_task[attempt["task_id"]].append(attempt)
    return [{**r, "attempts": by_task[r["id"]]} for r in records]


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


def _statements(script: str) -> Iterator[str]:
    """The statements of a migration file, one at a time (a ``;`` in a comment or string is not
    an end): they run one by one inside the migration's write transaction."""
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    leftover = [line for line in pending.splitlines() if line.strip() and not line.strip().startswith("--")]
    if leftover:
        raise RuntimeError(f"migration ends inside a statement: {leftover[0]!r}")
