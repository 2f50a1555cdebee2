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
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound
from ..model import (
    Attempt,
    Backoff,
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    ErrorInfo,
    NewTask,
    Outcome,
    QueueStats,
    Settlement,
    Task,
    TaskStatus,
)
from .spi import (
    Storage,
    decode_dead_cursor,
    encode_dead_cursor,
    from_micros,
    storable_error,
    storable_json,
    to_micros,
)

#: Seconds a writer waits for SQLite's write lock before the call fails as StorageUnavailable.
DEFAULT_BUSY_TIMEOUT = 30.0
#: The URL may lower or raise the busy timeout, but never make it unbounded.
MAX_BUSY_TIMEOUT = 300.0

# SQLite result codes that mean "the store cannot serve this right now" (another process holds
# the lock, the disk failed or filled up) rather than a bug in a statement.
_UNAVAILABLE_CODES = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_FULL", "SQLITE_PROTOCOL")

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _unavailable(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name:
        return name.startswith(_UNAVAILABLE_CODES)
    text = str(exc).lower()  # Python < 3.11 has no error names
    return "locked" in text or "busy" in text or "disk i/o" in text or "unable to open" in text


def _bounded(method: _Fn) -> _Fn:
    """Lock waits that ran out and I/O failures surface as the SPI's retryable StorageUnavailable."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except sqlite3.OperationalError as exc:
            if _unavailable(exc):
                raise StorageUnavailable(f"sqlite: {exc}") from exc
            raise

    return wrapper  # type: ignore[return-value]

MIGRATIONS: tuple[str, ...] = (
    # 1: tasks, attempts, and the partial indexes that keep claim/reap/DLQ cost per batch.
    """
    CREATE TABLE rdq_tasks (
        id               TEXT PRIMARY KEY,
        queue            TEXT NOT NULL,
        handler          TEXT NOT NULL,
        payload          TEXT NOT NULL,
        headers          TEXT NOT NULL,
        status           TEXT NOT NULL CHECK (status IN ('PENDING','IN_FLIGHT','SUCCEEDED','DEAD','CANCELLED')),
        attempt_count    INTEGER NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
        redrive_count    INTEGER NOT NULL DEFAULT 0 CHECK (redrive_count >= 0),
        max_attempts     INTEGER,
        backoff          TEXT,
        next_attempt_at  INTEGER NOT NULL,
        claim_token      TEXT,
        claimed_at       INTEGER,
        lease_expires_at INTEGER,
        created_at       INTEGER NOT NULL,
        updated_at       INTEGER NOT NULL,
        dead_at          INTEGER,
        result           TEXT,
        last_error_type  TEXT,
        last_error       TEXT,
        CHECK ((status = 'IN_FLIGHT') = (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
        CHECK ((status = 'DEAD') = (dead_at IS NOT NULL))
    );
    CREATE TABLE rdq_attempts (
        task_id     TEXT NOT NULL REFERENCES rdq_tasks(id) ON DELETE CASCADE,
        attempt_no  INTEGER NOT NULL CHECK (attempt_no >= 1),
        outcome     TEXT NOT NULL CHECK (outcome IN ('SUCCESS','RETRYABLE_FAILURE','PERMANENT_FAILURE','LEASE_EXPIRED')),
        started_at  INTEGER,
        finished_at INTEGER,
        error       TEXT,
        PRIMARY KEY (task_id, attempt_no)
    );
    CREATE INDEX rdq_tasks_due ON rdq_tasks (queue, next_attempt_at) WHERE status = 'PENDING';
    CREATE INDEX rdq_tasks_leases ON rdq_tasks (lease_expires_at) WHERE status = 'IN_FLIGHT';
    CREATE INDEX rdq_tasks_dead ON rdq_tasks (queue, dead_at, id) WHERE status = 'DEAD';
    CREATE INDEX rdq_tasks_finished ON rdq_tasks (updated_at) WHERE status IN ('SUCCEEDED','CANCELLED');
    CREATE INDEX rdq_tasks_queue_status ON rdq_tasks (queue, status);
    """,
)

_TASK_COLUMNS = (
    "id, queue, handler, payload, headers, status, attempt_count, redrive_count, max_attempts, backoff, "
    "next_attempt_at, lease_expires_at, created_at, updated_at, dead_at, result, last_error, claim_token, claimed_at"
)

_CLAIM = f"""
UPDATE rdq_tasks
   SET status = 'IN_FLIGHT', claim_token = lower(hex(randomblob(16))), claimed_at = :now,
       lease_expires_at = :lease_until, updated_at = :now
 WHERE id IN (SELECT id FROM rdq_tasks
               WHERE queue = :queue AND status = 'PENDING' AND next_attempt_at <= :now
               ORDER BY next_attempt_at, id LIMIT :limit)
RETURNING {_TASK_COLUMNS}
"""

# A whole batch of settlements travels as one JSON array (json_each), so a settle costs two
# statements however many tasks it carries: one fenced UPDATE … FROM, one INSERT of the history.
_SETTLE_BATCH = """
UPDATE rdq_tasks AS t
   SET status = s.status, attempt_count = t.attempt_count + 1, claim_token = NULL,
       lease_expires_at = NULL, updated_at = :now,
       next_attempt_at = CASE WHEN s.status = 'PENDING' THEN :now + s.delay_us ELSE t.next_attempt_at END,
       dead_at = CASE WHEN s.status = 'DEAD' THEN :now ELSE NULL END,
       result = CASE WHEN s.status = 'SUCCEEDED' THEN s.result ELSE t.result END,
       last_error_type = COALESCE(s.error_type, t.last_error_type),
       last_error = COALESCE(s.error, t.last_error)
  FROM (SELECT value ->> '$.id' AS id, value ->> '$.token' AS token, value ->> '$.status' AS status,
               value ->> '$.outcome' AS outcome, value ->> '$.delay_us' AS delay_us,
               value ->> '$.result' AS result, value ->> '$.error_type' AS error_type,
               value ->> '$.error' AS error
          FROM json_each(:batch)) AS s
 WHERE t.id = s.id AND t.claim_token = s.token AND t.status = 'IN_FLIGHT'
   AND (s.outcome <> 'LEASE_EXPIRED' OR t.lease_expires_at <= :now)
RETURNING id, claimed_at
"""

# attempt_no comes from history (MAX + 1), never from attempt_count, which redrive resets.
# The applied ids are distinct, so each row's MAX is independent of the others in the batch.
_APPEND_ATTEMPTS = """
INSERT INTO rdq_attempts (task_id, attempt_no, outcome, started_at, finished_at, error)
SELECT a.value ->> '$.id',
       COALESCE((SELECT MAX(h.attempt_no) FROM rdq_attempts AS h WHERE h.task_id = a.value ->> '$.id'), 0) + 1,
       a.value ->> '$.outcome', a.value ->> '$.started_at', :now, a.value ->> '$.error'
  FROM json_each(:applied) AS a
"""


class SQLiteStorage(Storage):
    schemes = ("sqlite",)

    def __init__(self, url: str, *, busy_timeout_seconds: float = DEFAULT_BUSY_TIMEOUT) -> None:
        parts = urlsplit(url)
        path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
        if not path or path == ":memory:":
            raise ValueError("sqlite URL needs a file path: sqlite:///relative.db or sqlite:////absolute.db")
        self.path = path
        query = dict(parse_qsl(parts.query))
        if "timeout" in query:
            try:
                busy_timeout_seconds = float(query["timeout"])
            except ValueError:
                raise ValueError(f"sqlite URL: timeout must be seconds, got {query['timeout']!r}") from None
        if not (math.isfinite(busy_timeout_seconds) and 0 <= busy_timeout_seconds <= MAX_BUSY_TIMEOUT):
            raise ValueError(f"sqlite busy timeout must be between 0 and {MAX_BUSY_TIMEOUT:g} seconds")
        self.busy_timeout_seconds = busy_timeout_seconds
        self._local = threading.local()
        self._all_connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._schema_checked = False
        self.round_trips = 0

    # -- connections -----------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            directory = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(directory, exist_ok=True)
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_seconds, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
            with self._lock:
                self._all_connections.append(conn)
            if not self._schema_checked:
                # The embedded default promises zero setup: bring a new or old file up to date.
                self._schema_checked = True
                if conn.execute("PRAGMA user_version").fetchone()[0] < len(MIGRATIONS):
                    self.migrate()
        return conn

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
        except sqlite3.Error as exc:
            # A COMMIT that failed leaves the transaction open on this thread's connection:
            # roll it back so the next call can begin, and report the write as not done.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and _unavailable(exc):
                raise StorageUnavailable(f"sqlite: {exc}") from exc
            raise

    def _execute(self, conn: sqlite3.Connection, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self.round_trips += 1
        return conn.execute(sql, params)

    # -- lifecycle -------------------------------------------------------------------------
    @_bounded
    def migrate(self) -> None:
        with self._write() as (conn, _):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {number}")

    def close(self) -> None:
        with self._lock:
            for conn in self._all_connections:
                conn.close()
            self._all_connections.clear()
        self._local = threading.local()

    def now(self) -> datetime:
        return from_micros(_now_micros())

    # -- producer --------------------------------------------------------------------------
    @_bounded
    def enqueue(self, tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        if connection is not None:
            raise TypeError("the SQLite backend cannot join a caller's transaction")
        with self._write() as (conn, now):
            # Inside the write lock nobody else can insert, so "exists" is decided once, here.
            existing = {row[0]: _task_from_row(row) for row in _select_tasks(conn, [t.id for t in tasks])}
            self.round_trips += 1
            fresh = [t for t in tasks if t.id not in existing]
            rows = [
                (t.id, t.queue, t.handler, _dumps(t.payload), _dumps(dict(t.headers)), t.max_attempts,
                 _dumps(t.backoff.to_dict()) if t.backoff else None, _due_micros(t, now), now, now)
                for t in fresh
            ]
            if rows:
                self.round_trips += 1
                conn.executemany(
                    "INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, max_attempts, backoff,"
                    " next_attempt_at, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?)",
                    rows,
                )
        results = []
        for t in tasks:
            old = existing.get(t.id)
            if old is not None:
                results.append(EnqueueResult(task=old, created=False, conflict=old.queue != t.queue))
                continue
            at = from_micros(now)
            results.append(EnqueueResult(
                task=Task(
                    id=t.id, queue=t.queue, handler=t.handler, payload=t.payload, headers=dict(t.headers),
                    status=TaskStatus.PENDING, max_attempts=t.max_attempts, backoff=t.backoff,
                    next_attempt_at=from_micros(_due_micros(t, now)), created_at=at, updated_at=at,
                ),
                created=True,
            ))
        return results

    # -- worker ----------------------------------------------------------------------------
    @_bounded
    def claim(self, queue: str, limit: int, lease_seconds: float) -> list[ClaimedTask]:
        with self._write() as (conn, now):
            rows = self._execute(
                conn, _CLAIM,
                {"queue": queue, "now": now, "lease_until": now + int(lease_seconds * 1_000_000), "limit": limit},
            ).fetchall()
        rows.sort(key=lambda r: (r[10], r[0]))
        return [_claimed_from_row(row) for row in rows]

    @_bounded
    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        extended: dict[str, datetime] = {}
        with self._write() as (conn, now):
            until = now + int(lease_seconds * 1_000_000)
            for ref in refs:
                # MAX: an extension never moves an expiry earlier (a short heartbeat must not
                # hand a long-leased task to the reaper); the stored value is what we report.
                row = self._execute(
                    conn,
                    "UPDATE rdq_tasks SET lease_expires_at = MAX(lease_expires_at, ?), updated_at = ?"
                    " WHERE id = ? AND claim_token = ? AND status = 'IN_FLIGHT' RETURNING lease_expires_at",
                    (until, now, ref.task_id, ref.claim_token),
                ).fetchone()
                if row:
                    extended[ref.task_id] = from_micros(row[0])
        _raise_stale(refs, extended)
        return extended

    @_bounded
    def settle(self, settlements: Sequence[Settlement]) -> None:
        by_id: dict[str, dict[str, Any]] = {}
        for item in settlements:
            if item.task_id in by_id:
                continue  # one settle per claim: a repeat within the batch is refused below
            # Text is repaired (lone surrogates -> U+FFFD) before it reaches sqlite3, which would
            # otherwise fail the whole batch with a UnicodeEncodeError.
            error = storable_error(item.error)
            error_json = storable_json(error.to_dict()) if error else None
            by_id[item.task_id] = {
                "id": item.task_id, "token": item.claim_token, "status": item.status.value,
                "outcome": item.outcome.value, "delay_us": int(item.retry_delay_seconds * 1_000_000),
                "result": storable_json(item.result) if item.status is TaskStatus.SUCCEEDED else None,
                "error_type": error.type if error else None, "error": error_json,
            }
        applied: set[str] = set()
        if by_id:
            with self._write() as (conn, now):
                rows = self._execute(conn, _SETTLE_BATCH, {"batch": _dumps(list(by_id.values())), "now": now}).fetchall()
                if rows:
                    history = [
                        {"id": task_id, "outcome": by_id[task_id]["outcome"], "started_at": claimed_at,
                         "error": by_id[task_id]["error"]}
                        for task_id, claimed_at in rows
                    ]
                    self._execute(conn, _APPEND_ATTEMPTS, {"applied": _dumps(history), "now": now})
                applied = {task_id for task_id, _ in rows}
        # Refused: items whose claim did not hold, and any repeat of an id within the batch.
        refused: list[str] = []
        seen: set[str] = set()
        for s in settlements:
            if s.task_id not in applied or s.task_id in seen:
                refused.append(s.task_id)
            seen.add(s.task_id)
        if refused:
            raise StaleClaim(refused)

    @_bounded
    def release(self, refs: Sequence[ClaimRef]) -> None:
        released: set[str] = set()
        with self._write() as (conn, now):
            for ref in refs:
                row = self._execute(
                    conn,
                    "UPDATE rdq_tasks SET status = 'PENDING', claim_token = NULL,"
                    " lease_expires_at = NULL, updated_at = ? WHERE id = ? AND claim_token = ?"
                    " AND status = 'IN_FLIGHT' RETURNING id",
                    (now, ref.task_id, ref.claim_token),
                ).fetchone()
                if row:
                    released.add(ref.task_id)
        _raise_stale(refs, released)

    @_bounded
    def find_expired_leases(self, limit: int, queue: str | None = None) -> list[ClaimedTask]:
        conn = self._conn()
        now = _now_micros()
        sql = f"SELECT {_TASK_COLUMNS} FROM rdq_tasks WHERE status = 'IN_FLIGHT' AND lease_expires_at <= ?"
        params: list[Any] = [now]
        if queue is not None:
            sql += " AND queue = ?"
            params.append(queue)
        sql += " ORDER BY lease_expires_at LIMIT ?"
        params.append(limit)
        return [_claimed_from_row(row) for row in self._execute(conn, sql, params).fetchall()]

    # -- operator --------------------------------------------------------------------------
    @_bounded
    def get(self, task_id: str) -> Task | None:
        conn = self._conn()
        rows = _select_tasks(conn, [task_id])
        self.round_trips += 1
        if not rows:
            return None
        return _with_attempts(conn, [_task_from_row(rows[0])])[0]

    @_bounded
    def cancel(self, task_id: str) -> Task:
        with self._write() as (conn, now):
            row = self._execute(
                conn,
                "UPDATE rdq_tasks SET status = 'CANCELLED', updated_at = ? WHERE id = ? AND status = 'PENDING'"
                f" RETURNING {_TASK_COLUMNS}",
                (now, task_id),
            ).fetchone()
            if row is None:
                existing = _select_tasks(conn, [task_id])
                if not existing:
                    raise TaskNotFound(task_id)
                raise TaskConflict(f"task {task_id!r} is {existing[0][5]}, only PENDING tasks can be cancelled")
        return _with_attempts(self._conn(), [_task_from_row(row)])[0]

    @_bounded
    def list_dead(self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()) -> DeadPage:
        where, params = _dead_where(queue, filter)
        if cursor is not None:
            after_micros, after_id = decode_dead_cursor(queue, cursor)
            where += " AND (dead_at, id) > (?, ?)"
            params += [after_micros, after_id]
        conn = self._conn()
        rows = self._execute(
            conn, f"SELECT {_TASK_COLUMNS} FROM rdq_tasks WHERE {where} ORDER BY dead_at, id LIMIT ?", params + [limit + 1]
        ).fetchall()
        more = len(rows) > limit
        tasks = _with_attempts(conn, [_task_from_row(r) for r in rows[:limit]])
        next_cursor = None
        if more and tasks:
            last = tasks[-1]
            assert last.dead_at is not None
            next_cursor = encode_dead_cursor(queue, last.dead_at, last.id)
        return DeadPage(tuple(tasks), next_cursor)

    @_bounded
    def redrive(self, queue: str, filter: DeadFilter) -> int:
        where, params = _dead_where(queue, filter)
        with self._write() as (conn, now):
            cur = self._execute(
                conn,
                "UPDATE rdq_tasks SET status = 'PENDING', attempt_count = 0, redrive_count = redrive_count + 1,"
                f" next_attempt_at = ?, dead_at = NULL, updated_at = ? WHERE {where}",
                [now, now] + params,
            )
            return cur.rowcount

    @_bounded
    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        where, params = _dead_where(queue, filter)
        with self._write() as (conn, _):
            return self._execute(conn, f"DELETE FROM rdq_tasks WHERE {where}", params).rowcount

    @_bounded
    def stats(self, queue: str) -> QueueStats:
        conn = self._conn()
        now = _now_micros()
        counts = dict(
            self._execute(conn, "SELECT status, COUNT(*) FROM rdq_tasks WHERE queue = ? GROUP BY status", (queue,)).fetchall()
        )
        oldest = self._execute(
            conn,
            "SELECT MIN(next_attempt_at) FROM rdq_tasks WHERE queue = ? AND status = 'PENDING' AND next_attempt_at <= ?",
            (queue, now),
        ).fetchone()[0]
        return QueueStats(
            queue=queue,
            pending=counts.get("PENDING", 0),
            in_flight=counts.get("IN_FLIGHT", 0),
            dead=counts.get("DEAD", 0),
            succeeded=counts.get("SUCCEEDED", 0),
            cancelled=counts.get("CANCELLED", 0),
            oldest_pending_age_seconds=max(0.0, (now - oldest) / 1_000_000) if oldest is not None else 0.0,
        )

    @_bounded
    def list_queues(self) -> list[str]:
        rows = self._execute(self._conn(), "SELECT DISTINCT queue FROM rdq_tasks ORDER BY queue").fetchall()
        return [r[0] for r in rows]

    @_bounded
    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        with self._write() as (conn, now):
            cutoff = now - int(older_than_seconds * 1_000_000)
            return self._execute(
                conn,
                "DELETE FROM rdq_tasks WHERE id IN (SELECT id FROM rdq_tasks WHERE status IN ('SUCCEEDED','CANCELLED')"
                " AND updated_at < ? ORDER BY updated_at LIMIT ?)",
                (cutoff, limit),
            ).rowcount


# -- helpers ------------------------------------------------------------------------------------

def _now_micros() -> int:
    return time.time_ns() // 1000


def _due_micros(task: NewTask, now: int) -> int:
    return to_micros(task.run_at) if task.run_at is not None else now + int(task.delay_seconds * 1_000_000)


def _dumps(value: Any) -> str:
    # Repaired JSON text: sqlite3 encodes parameters as strict UTF-8.
    return storable_json(value)


def _select_tasks(conn: sqlite3.Connection, ids: Sequence[str]) -> list[tuple]:
    rows: list[tuple] = []
    for start in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
        chunk = ids[start:start + 500]
        marks = ",".join("?" * len(chunk))
        rows += conn.execute(f"SELECT {_TASK_COLUMNS} FROM rdq_tasks WHERE id IN ({marks})", chunk).fetchall()
    return rows


def _dead_where(queue: str, filter: DeadFilter) -> tuple[str, list[Any]]:
    where = "queue = ? AND status = 'DEAD'"
    params: list[Any] = [queue]
    if filter.ids is not None:
        where += f" AND id IN ({','.join('?' * len(filter.ids))})"
        params += list(filter.ids)
    if filter.error_type is not None:
        where += " AND last_error_type = ?"
        params.append(filter.error_type)
    if filter.handler is not None:
        where += " AND handler = ?"
        params.append(filter.handler)
    return where, params


def _time(value: int | None) -> datetime | None:
    return from_micros(value) if value is not None else None


def _task_from_row(row: tuple, attempts: tuple[Attempt, ...] = ()) -> Task:
    (id_, queue, handler, payload, headers, status, attempt_count, redrive_count, max_attempts, backoff,
     next_attempt_at, lease_expires_at, created_at, updated_at, dead_at, result, last_error, *_claim) = row
    return Task(
        id=id_, queue=queue, handler=handler, payload=json.loads(payload), headers=json.loads(headers),
        status=TaskStatus(status), attempt_count=attempt_count, redrive_count=redrive_count,
        max_attempts=max_attempts, backoff=Backoff.from_dict(json.loads(backoff)) if backoff else None,
        next_attempt_at=_time(next_attempt_at), lease_expires_at=_time(lease_expires_at),
        created_at=_time(created_at), updated_at=_time(updated_at), dead_at=_time(dead_at),
        result=json.loads(result) if result is not None else None,
        last_error=ErrorInfo.from_dict(json.loads(last_error)) if last_error else None,
        attempts=attempts,
    )


def _claimed_from_row(row: tuple) -> ClaimedTask:
    return ClaimedTask(
        task=_task_from_row(row), claim_token=row[17], claimed_at=from_micros(row[18]), lease_expires_at=from_micros(row[11])
    )


def _with_attempts(conn: sqlite3.Connection, tasks: list[Task]) -> list[Task]:
    if not tasks:
        return tasks
    marks = ",".join("?" * len(tasks))
    by_task: dict[str, list[Attempt]] = {t.id: [] for t in tasks}
    for task_id, attempt_no, outcome, started_at, finished_at, error in conn.execute(
        f"SELECT task_id, attempt_no, outcome, started_at, finished_at, error FROM rdq_attempts"
        f" WHERE task_id IN ({marks}) ORDER BY task_id, attempt_no",
        [t.id for t in tasks],
    ):
        by_task[task_id].append(Attempt(
            attempt_no=attempt_no, outcome=Outcome(outcome), started_at=_time(started_at),
            finished_at=_time(finished_at), error=ErrorInfo.from_dict(json.loads(error)) if error else None,
        ))
    from dataclasses import replace

    return [replace(t, attempts=tuple(by_task[t.id])) for t in tasks]


def _raise_stale(refs: Sequence[ClaimRef], applied: set[str] | dict[str, Any]) -> None:
    refused = [ref.task_id for ref in refs if ref.task_id not in applied]
    if refused:
        raise StaleClaim(refused)
