"""PostgreSQL backend (psycopg 3).

Every hot path is one SQL statement, so one round trip per call whatever the batch size:

* claim   -- ``FOR UPDATE SKIP LOCKED`` picks due rows, the same statement flips them to
             IN_FLIGHT with a fresh ``gen_random_uuid()`` token and a lease from ``now()``;
* settle  -- the batch travels as parallel arrays (``unnest``); a data-modifying CTE updates
             only rows whose token still matches and appends the attempts, numbering them
             ``MAX(attempt_no) + 1`` from the history inside the same statement;
* enqueue, release, extend_leases -- the same array-batch shape.

Fenced batch writes lock their rows in id order first, so overlapping batches never deadlock.

The database clock (``now()``, ``clock_timestamp()``) is the only time authority; the worker
sends durations, never instants (except a user-chosen ``run_at``).

Connections are autocommit (each statement is its own transaction) and pooled per instance:
idle ones wait in a list under a lock, so an instance can serve many threads.

The URL is a plain libpq URL; ``?options=-csearch_path%3Dmyschema`` puts rdq's tables in a
schema of their own (migrations create objects in the current schema).

Every call is bounded in time (see ``_ConnectionPool``): ``connect_timeout`` (10 s), TCP
keepalives and ``tcp_user_timeout``, and the session settings ``statement_timeout`` (30 s),
``lock_timeout`` (10 s) and ``idle_in_transaction_session_timeout`` (60 s), each added only
when the URL does not set it (``?options=-c%20statement_timeout%3D5s``; with
``?rdq_session_timeouts=off`` none is sent, for poolers that refuse startup options). The
server's own timeout needs the server to hear about the statement, so a client-side watchdog
also drops a connection whose statement has not answered a little after
``statement_timeout``: a half-open connection raises ``StorageUnavailable`` instead of
hanging a claim loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import re
import select
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from ..errors import InvalidInput, SchemaMissing, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound
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
from .spi import Storage, decode_dead_cursor, encode_dead_cursor, from_micros, storable_json, storable_text

log = logging.getLogger(__name__)

SCHEMA_DIR = Path(__file__).parent / "postgres_schema"
_MIGRATION_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

#: Seconds to wait for a new connection unless the URL says otherwise (libpq waits forever).
DEFAULT_CONNECT_TIMEOUT = 10
#: Session settings sent at connect (startup ``options``) unless the URL's ``options`` set them.
#: Far above any statement rdq runs (milliseconds), low enough that nothing waits forever.
DEFAULT_SESSION_TIMEOUTS = {
    "statement_timeout": "30s",
    "lock_timeout": "10s",
    "idle_in_transaction_session_timeout": "60s",
}
#: libpq TCP settings unless the URL sets them: a peer that vanished (host down, NAT state
#: dropped) is detected within about a minute instead of the kernel's two hours.
DEFAULT_TCP_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
}
#: Milliseconds sent data may stay unacknowledged before the kernel drops the connection
#: (libpq 12+; ignored on Unix sockets).
DEFAULT_TCP_USER_TIMEOUT_MS = 30_000
#: The client gives up on a statement this long after the server should have (statement_timeout):
#: a quarter of it, between 1 and 5 seconds.
CLIENT_DEADLINE_GRACE = (0.25, 1.0, 5.0)
#: Idle connections kept per instance; more concurrent callers get extra, short-lived ones.
MAX_IDLE_CONNECTIONS = 16
#: Dropped-connection notices closer together than this belong to one incident: logged once.
DROPPED_CONNECTIONS_LOG_INTERVAL = 10.0
#: First key of the two-key advisory lock that serialises migrations (second: the schema).
MIGRATION_LOCK_NAMESPACE = 0x72647100  # "rdq\0"

# -- SQL ----------------------------------------------------------------------------------------

TASK_COLUMNS = (
    "id", "queue", "handler", "payload", "headers", "status", "attempt_count", "redrive_count",
    "max_attempts", "backoff", "next_attempt_at", "lease_expires_at", "created_at",
    "updated_at", "dead_at", "result", "last_error", "claim_token", "claimed_at",
)


def _columns(alias: str) -> str:
    return ", ".join(f"{alias}.{column}" for column in TASK_COLUMNS)


def _attempts_of(alias: str) -> str:
    """A correlated subquery: the task's history as a jsonb array ordered by attempt_no, so a
    task and its attempts come back in one round trip (served by the unique index)."""
    return f"""(
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt_no', a.attempt_no, 'outcome', a.outcome,
                   'started_at', a.started_at, 'finished_at', a.finished_at,
                   'error', a.error) ORDER BY a.attempt_no), '[]'::jsonb)
        FROM rdq_attempts AS a WHERE a.task_id = {alias}.id
    ) AS attempts"""


CREATE_VERSION_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS rdq_schema_version (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""

# Keyed by schema so installations in different schemas of one database never wait for each
# other. current_schema() is NULL when no search_path schema exists; the CREATE then fails.
MIGRATION_LOCK_SQL = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(current_schema()))"

APPLIED_VERSIONS_SQL = "SELECT version FROM rdq_schema_version"

RECORD_VERSION_SQL = "INSERT INTO rdq_schema_version (version, name) VALUES (%(version)s, %(name)s)"

NOW_SQL = "SELECT now()"

# DISTINCT ON keeps the first occurrence of an id repeated inside the batch. The main query's
# snapshot predates the INSERT, so the second branch sees only rows that existed before it:
# each input row comes back once, either freshly inserted or as the pre-existing task.
ENQUEUE_SQL = f"""
WITH request AS (
    SELECT *
    FROM unnest(
        %(ids)s::text[], %(queues)s::text[], %(handlers)s::text[], %(payloads)s::text[],
        %(headers)s::text[], %(max_attempts)s::int[], %(backoffs)s::text[],
        %(delays)s::float8[], %(run_ats)s::timestamptz[]
    ) WITH ORDINALITY AS r(id, queue, handler, payload, headers, max_attempts, backoff,
                           delay_seconds, run_at, ord)
),
inserted AS (
    INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, max_attempts,
                           backoff, next_attempt_at)
    SELECT DISTINCT ON (r.id)
           r.id, r.queue, r.handler, r.payload::jsonb, r.headers::jsonb, 'PENDING',
           r.max_attempts, r.backoff::jsonb,
           coalesce(r.run_at, now() + r.delay_seconds * interval '1 second')
    FROM request AS r
    ORDER BY r.id, r.ord
    ON CONFLICT (id) DO NOTHING
    RETURNING *
)
SELECT r.ord, true AS inserted, {_columns("i")}, '[]'::jsonb AS attempts
FROM request AS r JOIN inserted AS i ON i.id = r.id
UNION ALL
SELECT r.ord, false AS inserted, {_columns("t")}, {_attempts_of("t")}
FROM request AS r JOIN rdq_tasks AS t ON t.id = r.id
WHERE t.id = ANY(%(ids)s::text[])
ORDER BY ord
"""

# The classic "UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n)", with the
# locking subquery as an uncorrelated ARRAY(...): it runs exactly once (an IN subquery may be
# re-scanned by some plans, and SKIP LOCKED is not repeatable), and "id = ANY(array)" makes the
# update probe the primary key per claimed row instead of joining against the whole table.
CLAIM_SQL = f"""
WITH claimed AS (
    UPDATE rdq_tasks
    SET status = 'IN_FLIGHT',
        claim_token = gen_random_uuid()::text,
        claimed_at = now(),
        lease_expires_at = now() + %(lease_seconds)s * interval '1 second',
        updated_at = now()
    WHERE id = ANY (ARRAY(
        SELECT id
        FROM rdq_tasks
        WHERE queue = %(queue)s AND status = 'PENDING' AND next_attempt_at <= now()
        ORDER BY next_attempt_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING *
)
SELECT {_columns("c")}
FROM claimed AS c
ORDER BY c.next_attempt_at, c.id
"""

# Fenced batch writes lock their rows up front, in id order, inside an uncorrelated ARRAY(...)
# that runs before the update: two batches overlapping in a different order (a late worker and
# a reaper, two racing reapers) then queue behind each other instead of deadlocking. It also
# lets the update probe the primary key for the batch rather than hash-joining the whole table
# (the planner cannot see how many rows unnest() yields).
LOCK_BATCH_IN_ID_ORDER = """t.id = ANY (ARRAY(
        SELECT id FROM rdq_tasks WHERE id = ANY(%(task_ids)s::text[]) ORDER BY id FOR UPDATE
    ))"""

_FENCE_INPUT = """
WITH ref AS (
    SELECT *
    FROM unnest(%(task_ids)s::text[], %(claim_tokens)s::text[])
         WITH ORDINALITY AS ref(task_id, claim_token, ord)
)"""

# A ref is honoured only while its token still owns an IN_FLIGHT task (fencing). GREATEST: an
# extension never moves an expiry earlier (a short heartbeat must not hand a long-leased task to
# the reaper); RETURNING reports the expiry as stored.
EXTEND_LEASES_SQL = _FENCE_INPUT + f"""
UPDATE rdq_tasks AS t
SET lease_expires_at = GREATEST(t.lease_expires_at, now() + %(lease_seconds)s * interval '1 second'),
    updated_at = now()
FROM ref
WHERE {LOCK_BATCH_IN_ID_ORDER}
  AND t.id = ref.task_id AND t.claim_token = ref.claim_token AND t.status = 'IN_FLIGHT'
RETURNING ref.ord, t.id, t.lease_expires_at
"""

# Back to PENDING without an attempt: budget and next_attempt_at are left as they were.
RELEASE_SQL = _FENCE_INPUT + f"""
UPDATE rdq_tasks AS t
SET status = 'PENDING', claim_token = NULL, lease_expires_at = NULL, updated_at = now()
FROM ref
WHERE {LOCK_BATCH_IN_ID_ORDER}
  AND t.id = ref.task_id AND t.claim_token = ref.claim_token AND t.status = 'IN_FLIGHT'
RETURNING ref.ord
"""

# One statement for the whole batch. The row lock serialises racing settles of one task; a
# loser re-checks the fence against the committed row, finds the token cleared and
# matches nothing. The attempt number is read from the history (MAX + 1) in the same
# statement -- never from attempt_count, which redrive resets. claimed_at is kept on the task
# so it can become the attempt's started_at. dead_at uses clock_timestamp() so tasks
# dead-lettered by one statement still get distinct, ordered DLQ positions.
SETTLE_SQL = f"""
WITH decision AS (
    SELECT *
    FROM unnest(
        %(task_ids)s::text[], %(claim_tokens)s::text[], %(outcomes)s::text[],
        %(statuses)s::text[], %(retry_delays)s::float8[], %(errors)s::text[],
        %(results)s::text[]
    ) WITH ORDINALITY AS d(task_id, claim_token, outcome, status, retry_delay_seconds,
                           error, result, ord)
),
settled AS (
    UPDATE rdq_tasks AS t
    SET status = d.status,
        attempt_count = t.attempt_count + 1,
        next_attempt_at = CASE WHEN d.status = 'PENDING'
                               THEN now() + d.retry_delay_seconds * interval '1 second'
                               ELSE t.next_attempt_at END,
        dead_at = CASE WHEN d.status = 'DEAD' THEN clock_timestamp() END,
        result = CASE WHEN d.status = 'SUCCEEDED' THEN d.result::jsonb ELSE t.result END,
        last_error = CASE WHEN d.outcome = 'SUCCESS' THEN t.last_error
                          ELSE coalesce(d.error::jsonb, t.last_error) END,
        claim_token = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    FROM decision AS d
    WHERE {LOCK_BATCH_IN_ID_ORDER}
      AND t.id = d.task_id
      AND t.claim_token = d.claim_token
      AND t.status = 'IN_FLIGHT'
      AND (d.outcome <> 'LEASE_EXPIRED' OR t.lease_expires_at <= now())
    RETURNING d.ord, t.id, d.outcome, d.error, t.claimed_at
),
recorded AS (
    INSERT INTO rdq_attempts (task_id, attempt_no, outcome, started_at, finished_at, error)
    SELECT s.id,
           coalesce((SELECT max(a.attempt_no) FROM rdq_attempts AS a WHERE a.task_id = s.id), 0) + 1,
           s.outcome, s.claimed_at, now(), s.error::jsonb
    FROM settled AS s
)
SELECT ord FROM settled
"""

FIND_EXPIRED_LEASES_SQL = f"""
SELECT {_columns("t")}
FROM rdq_tasks AS t
WHERE t.status = 'IN_FLIGHT' AND t.lease_expires_at <= now()
  AND (%(queue)s::text IS NULL OR t.queue = %(queue)s::text)
ORDER BY t.lease_expires_at
LIMIT %(limit)s
"""

GET_SQL = f"""
SELECT {_columns("t")}, {_attempts_of("t")}
FROM rdq_tasks AS t
WHERE t.id = %(task_id)s
"""

CANCEL_SQL = f"""
WITH cancelled AS (
    UPDATE rdq_tasks
    SET status = 'CANCELLED', updated_at = now()
    WHERE id = %(task_id)s AND status = 'PENDING'
    RETURNING *
)
SELECT {_columns("c")}, {_attempts_of("c")}
FROM cancelled AS c
"""

# list_dead / redrive / purge_dead share this selection; optional filters are appended from
# the fragments below (values always travel as bind parameters).
DEAD_SELECTION = "t.queue = %(queue)s AND t.status = 'DEAD'"
DEAD_FILTER_IDS = " AND t.id = ANY(%(ids)s::text[])"
DEAD_FILTER_ERROR_TYPE = " AND t.last_error->>'type' = %(error_type)s"
DEAD_FILTER_HANDLER = " AND t.handler = %(handler)s"
DEAD_AFTER_CURSOR = " AND (t.dead_at, t.id) > (%(after_dead_at)s, %(after_id)s)"

LIST_DEAD_SQL = f"""
SELECT {_columns("t")}, {_attempts_of("t")}
FROM rdq_tasks AS t
WHERE {{where}}
ORDER BY t.dead_at, t.id
LIMIT %(limit)s
"""

REDRIVE_SQL = """
UPDATE rdq_tasks AS t
SET status = 'PENDING', attempt_count = 0, redrive_count = t.redrive_count + 1,
    next_attempt_at = now(), dead_at = NULL, updated_at = now()
WHERE {where}
"""

PURGE_DEAD_SQL = "DELETE FROM rdq_tasks AS t WHERE {where}"

STATS_SQL = """
SELECT count(*) FILTER (WHERE status = 'PENDING')   AS pending,
       count(*) FILTER (WHERE status = 'IN_FLIGHT') AS in_flight,
       count(*) FILTER (WHERE status = 'DEAD')      AS dead,
       count(*) FILTER (WHERE status = 'SUCCEEDED') AS succeeded,
       count(*) FILTER (WHERE status = 'CANCELLED') AS cancelled,
       coalesce((SELECT extract(epoch FROM now() - min(p.next_attempt_at))::float8
                 FROM rdq_tasks AS p
                 WHERE p.queue = %(queue)s AND p.status = 'PENDING'
                   AND p.next_attempt_at <= now()), 0) AS oldest_pending_age_seconds
FROM rdq_tasks
WHERE queue = %(queue)s
"""

# A skip scan over the (queue, status) index: one index probe per distinct queue, not a scan
# of every task.
LIST_QUEUES_SQL = """
WITH RECURSIVE queues AS (
    (SELECT queue FROM rdq_tasks ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM rdq_tasks AS t WHERE t.queue > q.queue ORDER BY t.queue LIMIT 1)
    FROM queues AS q
    WHERE q.queue IS NOT NULL
)
SELECT queue FROM queues WHERE queue IS NOT NULL
"""

# Bounded batch; SKIP LOCKED so two retention runs split the work instead of queueing.
PURGE_SUCCEEDED_SQL = """
DELETE FROM rdq_tasks
WHERE id IN (
    SELECT id
    FROM rdq_tasks
    WHERE status IN ('SUCCEEDED', 'CANCELLED')
      AND updated_at < now() - %(older_than_seconds)s * interval '1 second'
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
"""


# -- connections ------------------------------------------------------------------------------

_SESSION_OPTION = re.compile(r"^(?:-c|--)?([A-Za-z_][A-Za-z0-9_.-]*)=(.*)$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|min|h|d)?\s*$")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def _session_options(options: str) -> dict[str, str]:
    """``-c name=value`` / ``-cname=value`` / ``--name=value`` settings in a libpq ``options``
    string (whitespace-separated, backslash escapes a space), by lower-case name."""
    tokens, current, escaped = [], [], False
    for char in options:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char.isspace():
            if current:
                tokens.append("".join(current))
                current = []
        else:
            current.append(char)
    if current:
        tokens.append("".join(current))
    settings: dict[str, str] = {}
    for i, token in enumerate(tokens):
        if token == "-c":
            continue
        if not (token.startswith(("-c", "--")) or (i > 0 and tokens[i - 1] == "-c")):
            continue
        match = _SESSION_OPTION.match(token)
        if match:
            settings[match.group(1).lower().replace("-", "_")] = match.group(2)
    return settings


def _duration_seconds(value: str) -> float | None:
    """A PostgreSQL time setting (``"30s"``, ``"500ms"``, ``"5000"`` = ms) in seconds, or None."""
    match = _DURATION.match(value)
    if not match:
        return None
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "ms"]


def _client_deadline(statement_timeout: str) -> float | None:
    """Seconds the client waits for a statement before dropping the connection; None when the
    URL turned statement_timeout off (0) -- then only TCP settings bound a call."""
    seconds = _duration_seconds(statement_timeout)
    if seconds is None:  # a unit this parser does not know: the server validates it; use ours
        seconds = _duration_seconds(DEFAULT_SESSION_TIMEOUTS["statement_timeout"])
    if seconds == 0:
        return None
    share, low, high = CLIENT_DEADLINE_GRACE
    return seconds + min(high, max(low, seconds * share))


#: URL parameter (rdq's own, removed before libpq sees the URL): ``off`` sends no session
#: settings at connect, for poolers that refuse the startup ``options`` parameter (PgBouncer
#: without ``ignore_startup_parameters = options``). The client-side deadline still applies.
SESSION_TIMEOUTS_PARAM = "rdq_session_timeouts"


def _bounded_connect_kwargs(conninfo: str) -> tuple[str, dict[str, Any], float | None]:
    """The conninfo for libpq, the connect arguments that bound every call (only those the URL
    does not set itself), and the client-side statement deadline that goes with them."""
    send_session_settings = True
    parts = urlsplit(conninfo)
    if parts.scheme in ("postgresql", "postgres") and SESSION_TIMEOUTS_PARAM in parts.query:
        query = parse_qsl(parts.query, keep_blank_values=True)
        flags = [value.lower() for name, value in query if name == SESSION_TIMEOUTS_PARAM]
        send_session_settings = flags[-1] not in ("off", "0", "false", "no")
        rest = [(name, value) for name, value in query if name != SESSION_TIMEOUTS_PARAM]
        conninfo = urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote)))
    params = conninfo_to_dict(conninfo)
    kwargs: dict[str, Any] = {}
    if "connect_timeout" not in params:
        kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT
    for name, value in DEFAULT_TCP_SETTINGS.items():
        if name not in params:
            kwargs[name] = value
    if "tcp_user_timeout" not in params and pq.version() >= 120000:
        kwargs["tcp_user_timeout"] = DEFAULT_TCP_USER_TIMEOUT_MS
    options = str(params.get("options") or "")
    present = _session_options(options)
    added = [f"-c {name}={value}" for name, value in DEFAULT_SESSION_TIMEOUTS.items() if name not in present]
    if added and send_session_settings:
        kwargs["options"] = " ".join(([options] if options.strip() else []) + added)
    statement_timeout = present.get("statement_timeout", DEFAULT_SESSION_TIMEOUTS["statement_timeout"])
    return conninfo, kwargs, _client_deadline(statement_timeout)


class _Watch:
    __slots__ = ("conn", "seconds", "deadline", "active", "fired")

    def __init__(self, conn: psycopg.Connection, seconds: float) -> None:
        self.conn, self.seconds = conn, seconds
        self.deadline = time.monotonic() + seconds
        self.active, self.fired = True, False


class _Watchdog:
    """One daemon thread that cuts off calls whose statement has not answered in time.

    ``statement_timeout`` only works when the server hears the statement: through a half-open
    connection (a NAT that dropped its state, a proxy or server host that froze) libpq would
    wait for a reply forever. Shutting the socket down makes libpq's pending read fail at once,
    psycopg raises OperationalError, and the backend reports StorageUnavailable.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also run in a forked child: the thread did not survive the fork, and its lock may
        # have been held at that instant.
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Watch]] = []
        self._order = itertools.count()
        self._by_conn: dict[int, _Watch] = {}
        self._thread: threading.Thread | None = None

    def watch(self, conn: psycopg.Connection, seconds: float) -> _Watch:
        watch = _Watch(conn, seconds)
        with self._cond:
            self._by_conn[id(conn)] = watch
            heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rdq-pg-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return watch

    def refresh(self, conn: psycopg.Connection) -> None:
        """A new statement on a watched connection gets the full deadline again (a call may run
        a few). Connections not watched (a caller's own) are left alone."""
        with self._cond:
            watch = self._by_conn.get(id(conn))
            if watch is not None and watch.active:
                watch.deadline = time.monotonic() + watch.seconds

    def done(self, watch: _Watch) -> bool:
        """Stop watching; True if the deadline had already cut the connection off."""
        with self._cond:
            watch.active = False
            if self._by_conn.get(id(watch.conn)) is watch:
                del self._by_conn[id(watch.conn)]
            return watch.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0][2].active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, watch = self._heap[0]
                now = time.monotonic()
                if due > now:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                if watch.deadline > now:  # refreshed since it was queued
                    heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
                    continue
                # Still under the lock: done() cannot return the connection (and its fd) meanwhile.
                watch.fired = True
                _shut_down_socket(watch.conn)


def _shut_down_socket(conn: psycopg.Connection) -> None:
    try:
        duplicate = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError, psycopg.Error):
        return
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        duplicate.close()


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._reset)


class _ConnectionPool:
    """Idle autocommit connections in a list under a lock.

    A caller takes one for the duration of a call and gives it back; a connection that broke,
    or was left inside a transaction, is closed instead of being reused, so the next call
    reconnects.
    """

    def __init__(self, conninfo: str, max_idle: int) -> None:
        self._conninfo, self._connect_kwargs, self.statement_deadline = _bounded_connect_kwargs(conninfo)
        self._max_idle = max_idle
        self._idle: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._last_drop_logged = -math.inf

    def acquire(self) -> psycopg.Connection:
        with self._lock:
            if self._closed:
                raise StorageUnavailable("the PostgreSQL storage has been closed")
            while self._idle:
                conn = self._idle.pop()
                if _probably_alive(conn):
                    return conn
                # The server closed it (restart, pg_terminate_backend, idle timeout): its
                # siblings probably went the same way, so sweep them all now and say so once.
                dead = [conn] + [c for c in self._idle if not _probably_alive(c)]
                self._idle = [c for c in self._idle if c not in dead]
                for stale in dead:
                    stale.close()
                # One INFO line per incident (a restart or a kill drops several connections over a
                # few seconds); nothing failed yet: if the server is gone, the caller's error says so.
                now = time.monotonic()
                quiet = now - self._last_drop_logged < DROPPED_CONNECTIONS_LOG_INTERVAL
                if not quiet:
                    self._last_drop_logged = now
                (log.debug if quiet else log.info)(
                    "dropped %d idle PostgreSQL connection(s) the server had closed; reconnecting", len(dead))
        try:
            # No server-side prepared statements: they break behind PgBouncer in transaction
            # mode and pin sessions in RDS Proxy, the usual fronts for Lambda fleets.
            return psycopg.connect(
                self._conninfo, autocommit=True, prepare_threshold=None, **self._connect_kwargs
            )
        except psycopg.OperationalError as exc:
            raise StorageUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc

    def give_back(self, conn: psycopg.Connection) -> None:
        reusable = (
            not conn.closed
            and not conn.broken
            and conn.info.transaction_status == TransactionStatus.IDLE
        )
        if reusable:
            with self._lock:
                if not self._closed and len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _probably_alive(conn: psycopg.Connection) -> bool:
    """An idle autocommit connection has nothing to read; readable data means the server
    closed it (restart, idle timeout) or sent a notice. Checked without a round trip."""
    if conn.closed or conn.broken:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


# -- the backend --------------------------------------------------------------------------------

class PostgresStorage(Storage):
    schemes = ("postgresql", "postgres")

    def __init__(self, url: str, *, max_idle_connections: int = MAX_IDLE_CONNECTIONS) -> None:
        self.url = url
        self.round_trips = 0
        self._round_trip_lock = threading.Lock()
        self._pool = _ConnectionPool(url, max_idle_connections)

    # -- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        conn = self._pool.acquire()
        deadline = self._pool.statement_deadline
        watch = _WATCHDOG.watch(conn, deadline) if deadline is not None else None
        cut_off = False
        try:
            yield conn
        except (pg_errors.UndefinedTable, pg_errors.UndefinedFunction) as exc:
            raise SchemaMissing(str(exc).splitlines()[0]) from None
        except psycopg.OperationalError as exc:
            cut_off = watch is not None and _WATCHDOG.done(watch)
            if cut_off:
                raise StorageUnavailable(
                    f"PostgreSQL did not answer within {deadline:g}s; connection dropped") from exc
            raise StorageUnavailable(f"PostgreSQL operation failed: {exc}") from exc
        finally:
            if watch is not None:
                cut_off = _WATCHDOG.done(watch) or cut_off
            if cut_off:
                conn.close()  # its socket is shut down: never hand it out again
            else:
                self._pool.give_back(conn)

    def _execute(self, conn: psycopg.Connection, sql: str, params: Mapping[str, Any] | None = None):
        """Send one statement (one round trip) and return its cursor, rows already fetched."""
        with self._round_trip_lock:
            self.round_trips += 1
        _WATCHDOG.refresh(conn)
        cursor = conn.cursor(row_factory=dict_row)
        cursor.execute(sql, params)
        return cursor

    def _fetch_all(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._connection() as conn:
            return self._execute(conn, sql, params).fetchall()

    def _rowcount(self, sql: str, params: Mapping[str, Any]) -> int:
        with self._connection() as conn:
            return self._execute(conn, sql, params).rowcount

    # -- lifecycle --------------------------------------------------------------------------
    def migrate(self) -> None:
        migrations = _load_migrations()
        with self._connection() as conn:
            with conn.transaction():
                self._execute(conn, MIGRATION_LOCK_SQL, {"namespace": MIGRATION_LOCK_NAMESPACE})
                self._execute(conn, CREATE_VERSION_TABLE_SQL)
                applied = {row["version"] for row in self._execute(conn, APPLIED_VERSIONS_SQL)}
                for version, name, sql in migrations:
                    if version in applied:
                        continue
                    self._execute(conn, sql)
                    self._execute(conn, RECORD_VERSION_SQL, {"version": version, "name": name})

    def close(self) -> None:
        self._pool.close()

    def now(self) -> datetime:
        return _utc(self._fetch_all(NOW_SQL)[0]["now"])

    # -- producer side ----------------------------------------------------------------------
    def enqueue(self, tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        if connection is not None and not isinstance(connection, psycopg.Connection):
            raise TypeError("connection must be a psycopg (3) Connection")
        if not tasks:
            return []
        params = {
            "ids": [t.id for t in tasks],
            "queues": [t.queue for t in tasks],
            "handlers": [t.handler for t in tasks],
            # JSON as UTF-8 text, lone surrogates repaired: jsonb rejects "\\ud800" escapes.
            "payloads": [storable_json(t.payload) for t in tasks],
            "headers": [storable_json(dict(t.headers)) for t in tasks],
            "max_attempts": [t.max_attempts for t in tasks],
            "backoffs": [storable_json(t.backoff.to_dict()) if t.backoff else None for t in tasks],
            "delays": [float(t.delay_seconds or 0.0) for t in tasks],
            "run_ats": [_as_utc(t.run_at) for t in tasks],
        }
        try:
            if connection is not None:
                # The caller's transaction: run the statement, never commit or roll back.
                try:
                    rows = self._execute(connection, ENQUEUE_SQL, params).fetchall()
                    rows += self._rows_lost_to_concurrent_inserts(connection, tasks, rows)
                except psycopg.OperationalError as exc:
                    raise StorageUnavailable(f"PostgreSQL operation failed: {exc}") from exc
                except pg_errors.UndefinedTable as exc:
                    raise SchemaMissing(str(exc).splitlines()[0]) from None
            else:
                with self._connection() as conn:
                    rows = self._execute(conn, ENQUEUE_SQL, params).fetchall()
                    rows += self._rows_lost_to_concurrent_inserts(conn, tasks, rows)
        except pg_errors.UntranslatableCharacter as exc:
            # jsonb cannot hold U+0000; that is bad input, not an unavailable store.
            raise InvalidInput(f"value not storable in PostgreSQL jsonb: {exc}", field="payload") from exc

        row_by_ord = {row["ord"]: row for row in rows}
        results: list[EnqueueResult] = []
        seen_ids: set[str] = set()
        for ord_, request in enumerate(tasks, start=1):
            row = row_by_ord[ord_]
            created = row["inserted"] and request.id not in seen_ids
            seen_ids.add(request.id)
            task = _task_from_row(row)
            conflict = not created and task.queue != request.queue
            results.append(EnqueueResult(task=task, created=created, conflict=conflict))
        return results

    def _rows_lost_to_concurrent_inserts(
        self, conn: psycopg.Connection, tasks: Sequence[NewTask], rows: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """An id inserted by a transaction that committed while ours ran is skipped by
        ON CONFLICT but invisible to our statement's snapshot; read it back (rare, one extra
        round trip, READ COMMITTED sees it now)."""
        returned = {row["ord"] for row in rows}
        missing = {ord_: t for ord_, t in enumerate(tasks, start=1) if ord_ not in returned}
        if not missing:
            return []
        found = {
            row["id"]: row
            for row in self._execute(
                conn,
                f"SELECT {_columns('t')}, {_attempts_of('t')} FROM rdq_tasks AS t"
                " WHERE t.id = ANY(%(ids)s::text[])",
                {"ids": [t.id for t in missing.values()]},
            ).fetchall()
        }
        recovered = []
        for ord_, request in missing.items():
            if request.id not in found:
                raise StorageUnavailable(f"task {request.id!r} is being written concurrently; retry")
            recovered.append({**found[request.id], "ord": ord_, "inserted": False})
        return recovered

    # -- worker side ------------------------------------------------------------------------
    def claim(self, queue: str, limit: int, lease_seconds: float) -> list[ClaimedTask]:
        if limit <= 0:
            return []
        rows = self._fetch_all(
            CLAIM_SQL, {"queue": queue, "limit": limit, "lease_seconds": float(lease_seconds)}
        )
        return [_claimed_from_row(row) for row in rows]

    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        if not refs:
            return {}
        params = {**_fence_params(refs), "lease_seconds": float(lease_seconds)}
        rows = self._fetch_all(EXTEND_LEASES_SQL, params)
        _raise_for_refused(refs, {row["ord"] for row in rows}, key=lambda ref: ref.task_id)
        return {row["id"]: _utc(row["lease_expires_at"]) for row in rows}

    def settle(self, settlements: Sequence[Settlement]) -> None:
        if not settlements:
            return
        params = {
            "task_ids": [s.task_id for s in settlements],
            "claim_tokens": [s.claim_token for s in settlements],
            "outcomes": [Outcome(s.outcome).value for s in settlements],
            "statuses": [TaskStatus(s.status).value for s in settlements],
            "retry_delays": [float(s.retry_delay_seconds or 0.0) for s in settlements],
            "errors": [_error_json(s.error) for s in settlements],
            "results": [storable_json(s.result) for s in settlements],
        }
        try:
            rows = self._fetch_all(SETTLE_SQL, params)
        except (pg_errors.DataError, UnicodeEncodeError) as exc:
            # A value jsonb cannot hold (a NUL inside a result string): the single statement
            # wrote nothing. Classified, so the caller can tell bad input from a bug.
            raise InvalidInput(f"settlement not storable in PostgreSQL: {exc}") from exc
        _raise_for_refused(settlements, {row["ord"] for row in rows}, key=lambda s: s.task_id)

    def release(self, refs: Sequence[ClaimRef]) -> None:
        if not refs:
            return
        rows = self._fetch_all(RELEASE_SQL, _fence_params(refs))
        _raise_for_refused(refs, {row["ord"] for row in rows}, key=lambda ref: ref.task_id)

    # -- reaper side ------------------------------------------------------------------------
    def find_expired_leases(self, limit: int, queue: str | None = None) -> list[ClaimedTask]:
        if limit <= 0:
            return []
        rows = self._fetch_all(FIND_EXPIRED_LEASES_SQL, {"limit": limit, "queue": queue})
        return [_claimed_from_row(row) for row in rows]

    # -- operator side ----------------------------------------------------------------------
    def get(self, task_id: str) -> Task | None:
        rows = self._fetch_all(GET_SQL, {"task_id": task_id})
        return _task_from_row(rows[0]) if rows else None

    def cancel(self, task_id: str) -> Task:
        rows = self._fetch_all(CANCEL_SQL, {"task_id": task_id})
        if rows:
            return _task_from_row(rows[0])
        # Only the refusal path pays a second round trip, to say why.
        existing = self.get(task_id)
        if existing is None:
            raise TaskNotFound(task_id)
        raise TaskConflict(f"task {task_id!r} is {existing.status.value}, only PENDING tasks can be cancelled")

    def list_dead(
        self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()
    ) -> DeadPage:
        where, params = _dead_selection(queue, filter)
        if cursor is not None:
            after_micros, after_id = decode_dead_cursor(queue, cursor)
            where += DEAD_AFTER_CURSOR
            params.update(after_dead_at=from_micros(after_micros), after_id=after_id)
        if limit <= 0:
            return DeadPage(tasks=(), next_cursor=cursor)
        # One row beyond the page tells whether another page exists.
        params["limit"] = limit + 1
        rows = self._fetch_all(LIST_DEAD_SQL.format(where=where), params)
        tasks = tuple(_task_from_row(row) for row in rows[:limit])
        next_cursor = None
        if len(rows) > limit:
            last = tasks[-1]
            next_cursor = encode_dead_cursor(queue, last.dead_at, last.id)
        return DeadPage(tasks=tasks, next_cursor=next_cursor)

    def redrive(self, queue: str, filter: DeadFilter) -> int:
        where, params = _dead_selection(queue, filter)
        return self._rowcount(REDRIVE_SQL.format(where=where), params)

    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        where, params = _dead_selection(queue, filter)
        return self._rowcount(PURGE_DEAD_SQL.format(where=where), params)

    def stats(self, queue: str) -> QueueStats:
        row = self._fetch_all(STATS_SQL, {"queue": queue})[0]
        return QueueStats(
            queue=queue,
            pending=row["pending"],
            in_flight=row["in_flight"],
            dead=row["dead"],
            succeeded=row["succeeded"],
            cancelled=row["cancelled"],
            oldest_pending_age_seconds=max(0.0, float(row["oldest_pending_age_seconds"])),
        )

    def list_queues(self) -> list[str]:
        return [row["queue"] for row in self._fetch_all(LIST_QUEUES_SQL)]

    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        if limit <= 0:
            return 0
        return self._rowcount(
            PURGE_SUCCEEDED_SQL, {"older_than_seconds": float(older_than_seconds), "limit": limit}
        )


# -- helpers ------------------------------------------------------------------------------------

def _load_migrations() -> list[tuple[int, str, str]]:
    """``(version, file name, sql)`` for every ``NNNN_name.sql`` file, in version order."""
    migrations = []
    for path in SCHEMA_DIR.iterdir():
        match = _MIGRATION_FILE.match(path.name)
        if match:
            migrations.append((int(match.group(1)), path.name, path.read_text(encoding="utf-8")))
    migrations.sort()
    versions = [version for version, _, _ in migrations]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {SCHEMA_DIR}")
    return migrations


def _dead_selection(queue: str, filter: DeadFilter) -> tuple[str, dict[str, Any]]:
    where = DEAD_SELECTION
    params: dict[str, Any] = {"queue": queue}
    if filter.ids is not None:
        where += DEAD_FILTER_IDS
        params["ids"] = list(filter.ids)
    if filter.error_type is not None:
        where += DEAD_FILTER_ERROR_TYPE
        params["error_type"] = filter.error_type
    if filter.handler is not None:
        where += DEAD_FILTER_HANDLER
        params["handler"] = filter.handler
    return where, params


def _error_json(error: ErrorInfo | None) -> str | None:
    """jsonb cannot hold U+0000 nor a lone surrogate ("\\ud800"); an error text carrying one must
    not sink the whole settle batch, so each becomes U+FFFD (the text is diagnostic). The JSON
    is sent as UTF-8 text (ensure_ascii off), so the repair sees the real code points."""
    if error is None:
        return None
    return storable_json(
        {key: storable_text(value).replace("\x00", "\ufffd") if isinstance(value, str) else value
         for key, value in error.to_dict().items()}
    )


def _fence_params(refs: Sequence[ClaimRef]) -> dict[str, list[str]]:
    return {
        "task_ids": [ref.task_id for ref in refs],
        "claim_tokens": [ref.claim_token for ref in refs],
    }


def _raise_for_refused(items: Sequence[Any], applied_ords: set[int], key) -> None:
    refused = [key(item) for ord_, item in enumerate(items, start=1) if ord_ not in applied_ords]
    if refused:
        raise StaleClaim(refused)


def _utc(value: datetime | None) -> datetime | None:
    return value.astimezone(timezone.utc) if value is not None else None


def _as_utc(value: datetime | None) -> datetime | None:
    """A naive run_at is taken as UTC rather than as the session's time zone."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def _parse_time(value: str | None) -> datetime | None:
    return _utc(datetime.fromisoformat(value)) if value else None


def _task_from_row(row: Mapping[str, Any]) -> Task:
    attempts = tuple(
        Attempt(
            attempt_no=a["attempt_no"],
            outcome=Outcome(a["outcome"]),
            started_at=_parse_time(a["started_at"]),
            finished_at=_parse_time(a["finished_at"]),
            error=ErrorInfo.from_dict(a["error"]),
        )
        for a in row.get("attempts") or ()
    )
    return Task(
        id=row["id"],
        queue=row["queue"],
        handler=row["handler"],
        payload=row["payload"],
        status=TaskStatus(row["status"]),
        headers=dict(row["headers"] or {}),
        attempt_count=row["attempt_count"],
        redrive_count=row["redrive_count"],
        max_attempts=row["max_attempts"],
        backoff=Backoff.from_dict(row["backoff"]),
        next_attempt_at=_utc(row["next_attempt_at"]),
        lease_expires_at=_utc(row["lease_expires_at"]),
        created_at=_utc(row["created_at"]),
        updated_at=_utc(row["updated_at"]),
        dead_at=_utc(row["dead_at"]),
        result=row["result"],
        last_error=ErrorInfo.from_dict(row["last_error"]),
        attempts=attempts,
    )


def _claimed_from_row(row: Mapping[str, Any]) -> ClaimedTask:
    return ClaimedTask(
        task=_task_from_row(row),
        claim_token=row["claim_token"],
        claimed_at=_utc(row["claimed_at"]),
        lease_expires_at=_utc(row["lease_expires_at"]),
    )
