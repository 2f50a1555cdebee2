"""Connections for the PostgreSQL backend: a small pool of autocommit connections, and the
settings and watchdog that bound every call in time.

Every call is bounded (the SPI's promise): ``connect_timeout`` (10 s), TCP keepalives and
``tcp_user_timeout``, and the session settings ``statement_timeout`` (30 s), ``lock_timeout``
(10 s) and ``idle_in_transaction_session_timeout`` (60 s) -- and ``TimeZone`` UTC, which spares
a conversion per timestamp read -- each added only when the URL does not set it
(``?options=-c%20statement_timeout%3D5s``; with ``?rdq_session_timeouts=off`` none is sent, for
poolers that refuse startup options). ``RDQ_PG_STATEMENT_TIMEOUT`` changes the default
``statement_timeout`` for a process: the API function's is 10 s, below its own timeout. The
server's own timeout needs the server to hear about the statement, so a client-side watchdog
also drops a connection whose statement has not answered a little after ``statement_timeout``: a
half-open connection raises ``StorageUnavailable`` instead of hanging a claim loop.
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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import pq
from psycopg.adapt import AdaptersMap
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.types.json import set_json_loads

from ...errors import ConfigurationError, StorageUnavailable
from ..codec import json_text

log = logging.getLogger(__name__)

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
#: Environment variable bounding the connections one storage instance opens at once (unset or 0:
#: no bound). The Lambda worker sets 1 (template.yaml): its claim loops, settle threads and slot
#: calls then share one connection, one short statement after another.
MAX_CONNECTIONS_ENV = "RDQ_PG_MAX_CONNECTIONS"
#: Seconds a call waits for a connection under that bound when no statement deadline is set.
CONNECTION_WAIT_SECONDS = 30.0
#: Dropped-connection notices closer together than this belong to one incident: logged once.
DROPPED_CONNECTIONS_LOG_INTERVAL = 10.0

_QUOTED_URL = re.compile(r"postgres(?:ql)?://\S*", re.IGNORECASE)
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
        assert seconds is not None, "the default statement_timeout parses"
    if seconds == 0:
        return None
    share, low, high = CLIENT_DEADLINE_GRACE
    return seconds + min(high, max(low, seconds * share))


#: How PgBouncer (and poolers like it) refuse the startup ``options`` rdq's session settings travel in.
_REFUSED_OPTIONS = re.compile(r"unsupported startup parameter:\s*options", re.IGNORECASE)


#: URL parameter (rdq's own, removed before libpq sees the URL): ``off`` sends no session
#: settings at connect, for poolers that refuse the startup ``options`` parameter (PgBouncer
#: without ``ignore_startup_parameters = options``). The client-side deadline still applies.
SESSION_TIMEOUTS_PARAM = "rdq_session_timeouts"


#: Environment variable that lowers the default ``statement_timeout`` for one process: the API
#: function sets it below its own timeout, itself below API Gateway's 29 s (template.yaml).
STATEMENT_TIMEOUT_ENV = "RDQ_PG_STATEMENT_TIMEOUT"


#: The session time zone unless the URL sets one: timestamps then arrive in UTC, which the
#: codec takes as they are (any other zone costs a conversion per timestamp, seven per claimed
#: task); what is stored does not depend on it.
DEFAULT_SESSION_TIME_ZONE = {"timezone": "UTC"}


def _default_session_settings() -> dict[str, str]:
    value = os.environ.get(STATEMENT_TIMEOUT_ENV, "").strip()
    timeouts = {**DEFAULT_SESSION_TIMEOUTS, "statement_timeout": value} if value else DEFAULT_SESSION_TIMEOUTS
    return {**timeouts, **DEFAULT_SESSION_TIME_ZONE}


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
    defaults = _default_session_settings()
    added = [f"-c {name}={value}" for name, value in defaults.items() if name not in present]
    if added and send_session_settings:
        kwargs["options"] = " ".join(([options] if options.strip() else []) + added)
    statement_timeout = present.get("statement_timeout", defaults["statement_timeout"])
    return conninfo, kwargs, _client_deadline(statement_timeout)


class _Watch:
    __slots__ = ("active", "conn", "deadline", "fired", "seconds")

    def __init__(self, conn: psycopg.Connection, seconds: float) -> None:
        self.conn: psycopg.Connection | None = conn  # None once done: a finished watch holds nothing
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.active, self.fired = True, False


class Watchdog:
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
            # Woken only when this deadline is now the first: otherwise the thread already
            # wakes earlier than this watch needs (every call watches for the same time, so
            # that is nearly always). Not waking it per call spares a thread switch per call;
            # the finished watches it would have popped wait in the heap until they come up.
            if self._heap[0][2] is watch:
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
            watch.conn = None
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
                if watch.conn is not None:  # always, for an active watch
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


WATCHDOG = Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WATCHDOG._reset)


class ConnectionPool:
    """Idle autocommit connections in a list under a lock.

    A caller takes one for the duration of a call and gives it back; a connection that broke,
    or was left inside a transaction, is closed instead of being reused, so the next call
    reconnects.
    """

    def __init__(self, conninfo: str, max_idle: int, max_open: int = 0) -> None:
        try:
            self._conninfo, self._connect_kwargs, self.statement_deadline = _bounded_connect_kwargs(conninfo)
        except (ValueError, psycopg.ProgrammingError) as exc:
            # libpq quotes the URL it could not read: never echo it, it may hold a password.
            detail = _QUOTED_URL.sub("<the URL>", str(exc).strip())
            raise ConfigurationError(f"malformed PostgreSQL URL: {detail}") from None
        self._max_idle = max_idle
        #: The most connections open at once (in use or idle); 0: no bound. A caller beyond it
        #: waits for one to be given back, so a process's calls share that many connections.
        self.max_open = max(0, max_open)
        #: Connections of this pool open now, and the most ever open at once (tests read them).
        self.open_count = 0
        self.peak_open = 0
        self._adapters = json_adapters()
        self._idle: list[psycopg.Connection] = []
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._closed = False
        self._last_drop_logged = -math.inf

    def acquire(self) -> psycopg.Connection:
        with self._lock:
            if self._closed:
                raise StorageUnavailable("the PostgreSQL storage has been closed")
            if self.max_open:
                # Calls beyond the bound wait their turn: each lasts one short statement or
                # transaction, and the statement deadline bounds the wait.
                waited_until = time.monotonic() + (self.statement_deadline or CONNECTION_WAIT_SECONDS)
                while not self._idle and self.open_count >= self.max_open:
                    left = waited_until - time.monotonic()
                    if self._closed or left <= 0:
                        raise StorageUnavailable(
                            f"no PostgreSQL connection came free within the bound of {self.max_open}")
                    self._returned.wait(left)
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
                self.open_count -= len(dead)
                # One INFO line per incident (a restart or a kill drops several connections over a
                # few seconds); nothing failed yet: if the server is gone, the caller's error says so.
                now = time.monotonic()
                quiet = now - self._last_drop_logged < DROPPED_CONNECTIONS_LOG_INTERVAL
                if not quiet:
                    self._last_drop_logged = now
                (log.debug if quiet else log.info)(
                    "dropped %d idle PostgreSQL connection(s) the server had closed; reconnecting", len(dead))
            # Counted before connecting, so that concurrent callers respect the bound meanwhile.
            self.open_count += 1
            self.peak_open = max(self.peak_open, self.open_count)
        try:
            return self.connect()
        except BaseException:
            self._forget(None)
            raise

    def _forget(self, conn: psycopg.Connection | None) -> None:
        """A pooled connection is gone (closed here, or never opened): its place is free."""
        if conn is not None:
            conn.close()
        with self._lock:
            self.open_count -= 1
            self._returned.notify()

    def connect(self) -> psycopg.Connection:
        """A new autocommit connection with this pool's settings, not counted in the pool."""
        try:
            # No server-side prepared statements: they break behind PgBouncer in transaction
            # mode and pin sessions in RDS Proxy, the usual fronts for Lambda fleets.
            return psycopg.connect(
                self._conninfo, autocommit=True, prepare_threshold=None, context=self._adapters,
                **self._connect_kwargs
            )
        except psycopg.OperationalError as exc:
            if _REFUSED_OPTIONS.search(str(exc)):
                raise ConfigurationError(self._refused_options_message()) from None
            raise StorageUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc

    def _refused_options_message(self) -> str:
        """The fix for a pooler that refuses startup ``options``: they carry rdq's session
        settings (unless the URL turned them off) and any ``options=`` of the URL itself."""
        fixes = []
        if "options" in self._connect_kwargs:
            joiner = "&" if urlsplit(self._conninfo).query else "?"
            fixes.append(f"Add {joiner}{SESSION_TIMEOUTS_PARAM}=off&listen=off to the storage URL (no session settings at "
                         "connect, and workers poll instead of LISTENing, which a transaction pooler cannot carry)")
        if "options" in conninfo_to_dict(self._conninfo):
            fixes.append(("drop" if fixes else "Drop")
                         + " the URL's own options= (set those on the server the pooler connects to)")
        return ("the server refused the startup parameter 'options': this is a connection pooler such as PgBouncer "
                f"in transaction mode. {'; '.join(fixes)}. docs/scaling-out.md has the details")

    @contextmanager
    def session(self) -> Iterator[psycopg.Connection]:
        """A connection for one call, watched for the statement deadline; given back after,
        unless it broke or the watchdog cut it off."""
        conn = self.acquire()
        deadline = self.statement_deadline
        watch = WATCHDOG.watch(conn, deadline) if deadline is not None else None
        cut_off = False
        try:
            yield conn
        except psycopg.OperationalError as exc:
            cut_off = watch is not None and WATCHDOG.done(watch)
            if cut_off:
                raise StorageUnavailable(f"PostgreSQL did not answer within {deadline:g}s; connection dropped") from exc
            raise
        finally:
            if watch is not None:
                cut_off = WATCHDOG.done(watch) or cut_off
            if cut_off:
                self._forget(conn)  # its socket is shut down: never hand it out again
            else:
                self.give_back(conn)

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
                    self._returned.notify()
                    return
        self._forget(conn)

    def close_idle(self) -> int:
        """Close the idle connections (those in use are kept); how many were closed."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.open_count -= len(idle)
            self._returned.notify_all()
        for conn in idle:
            conn.close()
        return len(idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self.open_count -= len(idle)
            self._returned.notify_all()
        for conn in idle:
            conn.close()


def _json_from_server(data: str | bytes) -> Any:
    """A json/jsonb value as the server sends it: UTF-8 text. ``json.loads`` on bytes first
    guesses their encoding, twice per claimed task (payload, headers)."""
    return json_text(data.decode("utf-8") if isinstance(data, bytes) else data)


def json_adapters() -> AdaptersMap:
    """psycopg's adapters, as they are when called, with JSON read by ``_json_from_server``."""
    adapters = AdaptersMap(psycopg.adapters)
    set_json_loads(_json_from_server, adapters)
    return adapters


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
