"""The application's side of an exactly-once test: a table of effects in the store's own database
(PostgreSQL or SQLite), and connections to it of the kind ``enqueue(connection=)`` accepts. The
kit's exactly-once tests and the exactly-once chaos driver both write and count its rows."""

from __future__ import annotations

import sqlite3
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

#: rdq's own URL parameters, which the application's driver does not know.
_RDQ_URL_PARAMS = {"listen", "rdq_session_timeouts", "timeout"}


class AppDatabase:
    """The application's side: a table of effects in the store's own database (PostgreSQL or
    SQLite), and connections to it of the kind ``enqueue(connection=)`` accepts."""

    table = "app_effects"

    def __init__(self, storage_url: str) -> None:
        parts = urlsplit(storage_url)
        self.kind = "sqlite" if parts.scheme == "sqlite" else "postgresql"
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                           if k not in _RDQ_URL_PARAMS])
        self.url = urlunsplit(parts._replace(query=query))
        self.path = unquote(parts.path.removeprefix("/"))
        self.mark = "?" if self.kind == "sqlite" else "%s"
        with self.session() as conn:
            conn.execute(f"CREATE TABLE {self.table} (task_id TEXT NOT NULL, attempt INTEGER NOT NULL)")

    def connect(self) -> Any:
        """A new connection as an application would open it (driver defaults: not autocommit)."""
        if self.kind == "sqlite":
            return sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        import psycopg

        return psycopg.connect(self.url)

    def session(self) -> Any:
        conn = self.connect()
        return _Committing(conn)

    def insert(self, conn: Any, task_id: str, attempt: int) -> None:
        conn.execute(f"INSERT INTO {self.table} (task_id, attempt) VALUES ({self.mark}, {self.mark})",
                     (task_id, attempt))

    def rows(self, task_id: str) -> int:
        with self.session() as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.table} WHERE task_id = {self.mark}", (task_id,)).fetchone()
            return int(row[0])


class _Committing:
    """``with``: the connection, committed and closed at the end."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def __enter__(self) -> Any:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        try:
            self.conn.commit()
        finally:
            self.conn.close()
