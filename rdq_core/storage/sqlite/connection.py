"""The SQLite file a backend instance works on: the URL and busy timeout, one connection per
thread in WAL mode, the write lock every write takes (``BEGIN IMMEDIATE``, the clock read under
it), the statements of ``queries.sql``, the migrations, and the row helpers the backend's parts
share (composed in ``backend.py``)."""

from __future__ import annotations

import abc
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...errors import ConfigurationError, StorageUnavailable
from ...flow import PRIORITIES
from ..codec import RecordCodec, epoch_micros
from ..core import StorageCore
from ..querytext import migrations, named_queries
from ..spi import from_micros

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


class SQLiteConnection(StorageCore, abc.ABC):
    """The file, its connections and its write lock, under every part of the SQLite backend."""

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

    def _now(self) -> datetime:
        return from_micros(_now_micros())


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)



def _now_micros() -> int:
    return time.time_ns() // 1000



def _fill(text: str, **parts: str) -> str:
    for name, part in parts.items():
        text = text.replace("{" + name + "}", part)
    return text



def _marks(n: int) -> str:
    return ",".join("?" * n)



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
