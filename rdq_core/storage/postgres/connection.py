"""The PostgreSQL connection pool a backend instance holds, how a statement is sent (one round
trip, counted, under the pool's watchdog), the statements of ``queries.sql``, the migrations,
the database clock and the LISTEN connection that hears enqueues. The backend's parts derive
from ``PostgresConnection`` (composed in ``backend.py``)."""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.rows import dict_row

from ...errors import ConfigurationError, SchemaMissing
from ..codec import RecordCodec, decoded, instant
from ..core import StorageCore
from ..querytext import migrations, named_queries
from .pool import MAX_CONNECTIONS_ENV, MAX_IDLE_CONNECTIONS, WATCHDOG, ConnectionPool

QUERIES = named_queries(__package__, "queries.sql")

#: First key of the two-key advisory lock that serialises migrations (second: the schema).
MIGRATION_LOCK_NAMESPACE = 0x72647100  # "rdq\0"


class PostgresConnection(StorageCore, abc.ABC):
    """The pool, statements and clock under every part of the PostgreSQL backend."""

    schemes = ("postgresql", "postgres")
    store_name = "PostgreSQL"
    # Timestamps come back as aware datetimes, history timestamps as ISO text inside jsonb.
    codec = RecordCodec(time=instant, document=decoded)
    transient_errors = (psycopg.OperationalError,)
    joins_transactions = True

    def __init__(self, url: str, *, max_idle_connections: int = MAX_IDLE_CONNECTIONS) -> None:
        self.url = url
        self.round_trips = 0
        self._round_trip_lock = threading.Lock()
        url, self.listens = _without_listen_flag(url)
        self._pool = ConnectionPool(url, max_idle_connections, _max_connections_from_env())

    def close_idle_connections(self) -> int:
        return self._pool.close_idle()

    def enqueue_listener(self, queues: Sequence[str]) -> _NotifyListener | None:
        """LISTEN on this schema's channel on a connection of its own (not pooled: a LISTEN
        belongs to its session). All queues share the channel; the payload names the queue."""
        if not self.listens:
            return None
        conn = self._pool.connect()
        try:
            with _schema_required():
                channel = conn.execute(QUERIES["wake_channel"]).fetchone()
                assert channel is not None
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel[0])))
        except BaseException:
            conn.close()
            raise
        return _NotifyListener(conn)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self._pool.session() as conn, _schema_required():
            yield conn

    def _execute(
        self, conn: psycopg.Connection[Any], sql: str, params: Mapping[str, Any] | None = None
    ) -> psycopg.Cursor[dict[str, Any]]:
        """Send one statement (one round trip) and return its cursor, rows already fetched."""
        with self._round_trip_lock:
            self.round_trips += 1
        WATCHDOG.refresh(conn)
        cursor = conn.cursor(row_factory=dict_row)
        cursor.execute(sql, params)
        return cursor

    def _fetch_all(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._connection() as conn:
            return self._execute(conn, sql, params).fetchall()

    def _rowcount(self, sql: str, params: Mapping[str, Any]) -> int:
        with self._connection() as conn:
            return self._execute(conn, sql, params).rowcount

    def migrate(self) -> None:
        with self.translated_errors(), self._connection() as conn, conn.transaction():
            self._execute(conn, QUERIES["migration_lock"], {"namespace": MIGRATION_LOCK_NAMESPACE})
            self._execute(conn, QUERIES["create_version_table"])
            applied = {row["version"] for row in self._execute(conn, QUERIES["applied_versions"])}
            for migration in migrations(__package__):
                if migration.version not in applied:
                    self._execute(conn, migration.text)
                    self._execute(conn, QUERIES["record_version"], {"version": migration.version, "name": migration.name})

    def close(self) -> None:
        self._pool.close()

    def _now(self) -> datetime:
        now: datetime = self._fetch_all(QUERIES["now"])[0]["now"]
        return now


#: rdq's URL parameter (removed before libpq sees the URL): ``listen=off`` makes workers poll
#: instead of LISTENing, for a URL that goes through a transaction pooler (PgBouncer
#: ``pool_mode=transaction``, RDS Proxy), where a session's LISTEN is not kept.
LISTEN_PARAM = "listen"



def _without_listen_flag(url: str) -> tuple[str, bool]:
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or LISTEN_PARAM not in parts.query:
        return url, True
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [value.lower() for name, value in query if name == LISTEN_PARAM]
    if not flags:
        return url, True
    if flags[-1] not in ("on", "off", "1", "0", "true", "false", "yes", "no"):
        raise ConfigurationError(f"?{LISTEN_PARAM}= takes on or off, not {flags[-1]!r}")
    rest = [(name, value) for name, value in query if name != LISTEN_PARAM]
    return urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote))), flags[-1] in ("on", "1", "true", "yes")



class _NotifyListener:
    """The LISTENing connection of one worker (``enqueue_listener``)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def receive(self, timeout: float) -> list[str]:
        # Ends at the first notification (later ones wait for the next call) or at the timeout;
        # a connection the server closed raises OperationalError.
        return [notify.payload for notify in self.conn.notifies(timeout=timeout, stop_after=1)]

    def close(self) -> None:
        self.conn.close()



@contextmanager
def _schema_required() -> Iterator[None]:
    """A missing table or function means the schema was never migrated: say so."""
    try:
        yield
    except (pg_errors.UndefinedTable, pg_errors.UndefinedFunction) as exc:
        raise SchemaMissing(str(exc).splitlines()[0]) from None



def _text(value: str) -> str:
    """Text PostgreSQL can hold: U+0000 becomes U+FFFD (no text column can store it)."""
    return value.replace("\x00", "\ufffd")



def _max_connections_from_env() -> int:
    value = os.environ.get(MAX_CONNECTIONS_ENV, "").strip()
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        raise ConfigurationError(f"{MAX_CONNECTIONS_ENV} must be a whole number, not {value!r}") from None
