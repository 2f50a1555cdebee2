"""The PostgreSQL dialect of the storage core (psycopg 3).

Every hot path is one statement from ``queries.sql``, so one round trip per call whatever the
batch size: the claim is ``FOR UPDATE SKIP LOCKED``; settle, enqueue, release and extend send the
batch as parallel arrays (``unnest``), and fenced writes lock their rows in id order first, so
overlapping batches never deadlock. The database clock (``now()``, ``clock_timestamp()``) is the
only time authority; the worker sends durations, never instants (except a user-chosen ``run_at``).

Connections are autocommit (each statement is its own transaction), pooled per instance and
bounded in time (``pool.py``). Idle workers hear enqueues through LISTEN on one extra connection
(``enqueue_listener``; the NOTIFY comes from a trigger, migration 0007); ``?listen=off`` turns
that off for a URL that goes through a transaction pooler, where a LISTEN does not stay put.
The URL is a plain libpq URL; ``?options=-csearch_path%3Dmyschema``
puts rdq's tables in a schema of their own (migrations create objects in the current schema).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from collections.abc import Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg import sql
from psycopg.rows import dict_row

from ...errors import (
    ConfigurationError,
    InvalidInput,
    SchemaMissing,
    StorageUnavailable,
    UnsupportedOperation,
)
from ...flow import PRIORITIES, Candidate, FlowPolicy, FlowState, candidate_count, choose_work_conserving
from ...model import ClaimRef, ErrorInfo, NewTask, Settlement, TaskStatus
from ..codec import Record, RecordCodec, decoded, instant
from ..core import (LIVE_STATUSES, ORDER_FIELD, DeadSelection, InsertedRecord, QueueCounts, Selection, StorageCore,
                    dedupe_states_of)
from ..querytext import migrations, named_queries
from ..spi import from_micros, storable_json, to_micros
from .pool import MAX_CONNECTIONS_ENV, MAX_IDLE_CONNECTIONS, WATCHDOG, ConnectionPool

QUERIES = named_queries(__package__, "queries.sql")

#: First key of the two-key advisory lock that serialises migrations (second: the schema).
MIGRATION_LOCK_NAMESPACE = 0x72647100  # "rdq\0"
#: First key of the transaction-scoped advisory lock of a queue's flow-controlled claims
#: (second: a hash of the queue name; a collision only makes two queues take turns).
FLOW_LOCK_NAMESPACE = 0x72647101
#: First key of the two-key advisory lock that serialises enqueues of one queue and dedupe_key.
DEDUPE_LOCK_NAMESPACE = 0x72647164  # "rdqd"


class PostgresStorage(StorageCore):
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

    # -- plumbing ---------------------------------------------------------------------------
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

    # -- lifecycle --------------------------------------------------------------------------
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

    # -- primitives -------------------------------------------------------------------------
    def _now(self) -> datetime:
        now: datetime = self._fetch_all(QUERIES["now"])[0]["now"]
        return now

    def _insert(self, tasks: Sequence[NewTask], connection: Any) -> list[InsertedRecord]:
        if connection is not None and not isinstance(connection, psycopg.Connection):
            raise UnsupportedOperation("connection must be a psycopg (3) Connection")
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
            # A naive run_at is taken as UTC rather than as the session's time zone.
            "run_ats": [t.run_at.replace(tzinfo=UTC) if t.run_at and t.run_at.tzinfo is None else t.run_at
                        for t in tasks],
            "priorities": [t.priority for t in tasks],
            "concurrency_keys": [t.concurrency_key for t in tasks],
            "rate_keys": [t.rate_key for t in tasks],
            "groups": [t.group for t in tasks],
            "dedupe_keys": [t.dedupe_key for t in tasks],
        }
        try:
            if connection is not None:
                # The caller's transaction: run the statement, never commit or roll back.
                with _schema_required():
                    rows = self._insert_on(connection, tasks, params)
            else:
                with self._connection() as conn:
                    rows = self._insert_on(conn, tasks, params)
        except pg_errors.UntranslatableCharacter as exc:
            # jsonb cannot hold U+0000; that is bad input, not an unavailable store.
            raise InvalidInput(f"value not storable in PostgreSQL jsonb: {exc}", field="payload") from exc
        by_ord = {row["ord"]: row for row in rows}
        return [InsertedRecord(by_ord[ord_], by_ord[ord_]["inserted"]) for ord_ in range(1, len(tasks) + 1)]

    def _insert_deduplicated(self, task: NewTask, connection: Any) -> InsertedRecord:
        if connection is not None and not isinstance(connection, psycopg.Connection):
            raise UnsupportedOperation("connection must be a psycopg (3) Connection")
        if connection is not None:
            with _schema_required(), connection.transaction():  # a savepoint in the caller's transaction
                return self._dedupe_on(connection, task)
        with self._connection() as conn, conn.transaction():
            return self._dedupe_on(conn, task)

    def _dedupe_on(self, conn: psycopg.Connection[Any], task: NewTask) -> InsertedRecord:
        """Lock the key, then match (and apply the mode) or insert: three round trips at most."""
        self._execute(conn, QUERIES["dedupe_lock"], {
            "namespace": DEDUPE_LOCK_NAMESPACE, "queue": task.queue, "key": task.dedupe_key})
        run_at = task.run_at.replace(tzinfo=UTC) if task.run_at and task.run_at.tzinfo is None else task.run_at
        try:
            found = self._execute(conn, QUERIES["dedupe_match"], {
                "id": task.id, "queue": task.queue, "key": task.dedupe_key, "states": list(dedupe_states_of(task)),
                "window_seconds": task.dedupe_for_seconds, "mode": task.dedupe_mode.value,
                "payload": storable_json(task.payload), "headers": storable_json(dict(task.headers)),
                "run_at": run_at, "delay_seconds": float(task.delay_seconds),
                "max_wait_seconds": task.dedupe_max_wait_seconds,
            }).fetchall()
        except pg_errors.UntranslatableCharacter as exc:
            raise InvalidInput(f"value not storable in PostgreSQL jsonb: {exc}", field="payload") from exc
        if found:
            row = found[0]
            return InsertedRecord(row, False, deduplicated=bool(row["deduplicated"]))
        return self._insert([task], conn)[0]

    def _insert_on(
        self, conn: psycopg.Connection[Any], tasks: Sequence[NewTask], params: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rows = self._execute(conn, QUERIES["enqueue"], params).fetchall()
        returned = {row["ord"] for row in rows}
        missing = {ord_: t for ord_, t in enumerate(tasks, start=1) if ord_ not in returned}
        if not missing:
            return rows
        # An id inserted by a transaction that committed while ours ran is skipped by
        # ON CONFLICT but invisible to our statement's snapshot; read it back (rare, one extra
        # round trip, READ COMMITTED sees it now).
        found = {row["id"]: row for row in self._execute(
            conn, QUERIES["tasks_by_ids"], {"ids": [t.id for t in missing.values()]}).fetchall()}
        for ord_, request in missing.items():
            if request.id not in found:
                raise StorageUnavailable(f"task {request.id!r} is being written concurrently; retry")
            rows.append({**found[request.id], "ord": ord_, "inserted": False})
        return rows

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> list[dict[str, Any]]:
        if flow.plain:
            return self._fetch_all(QUERIES["claim"], {"queue": queue, "limit": limit, "lease_seconds": lease_seconds})
        with self._connection() as conn:
            try:
                return self._flow_claim(conn, queue, limit, lease_seconds, flow)
            finally:
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.rollback()  # an error left the transaction open: end it (and its lock)

    def _flow_claim(self, conn: psycopg.Connection[Any], queue: str, limit: int, lease_seconds: float,
                    flow: FlowPolicy) -> list[dict[str, Any]]:
        """The claim under a flow policy, one transaction in three round trips: (BEGIN, the
        queue's advisory lock, the state) pipelined; the candidates; (the claim, COMMIT)
        pipelined. The lock serialises the flow-controlled claims of the queue, so what the state
        says (in-flight counts, the rate log, the fairness cursor) stays true until COMMIT, and
        each statement's snapshot is taken after the lock is held; ``rdq_core.flow.choose``
        decides."""
        period = flow.rate_limit.window_seconds if flow.rate_limit is not None else None
        with conn.pipeline():
            self._execute(conn, "BEGIN")
            self._execute(conn, QUERIES["flow_lock"], {"namespace": FLOW_LOCK_NAMESPACE, "queue": queue})
            row = self._execute(conn, QUERIES["flow_state"], {
                "queue": queue, "read_in_flight": flow.limits_concurrency or flow.max_in_flight is not None,
                "rate_period": period, "fair": flow.fair_groups}).fetchone()
        self.round_trips -= 2  # the three statements went in one round trip
        assert row is not None
        now = row["now"]
        if row["paused"]:
            self._execute(conn, "COMMIT")
            return []
        in_flight: dict[str, int] = row["in_flight"]
        state = FlowState(
            in_flight=sum(in_flight.values()),
            in_flight_by_key={key: n for key, n in in_flight.items() if key},
            recent_claims=row["recent"], last_group=row["last_group"])

        def read(full_keys: list[str], full_rates: list[str]) -> list[Candidate]:
            params = {"queue": queue, "now": now, "full_keys": full_keys, "full_rates": full_rates}
            if flow.fair_groups:
                return [_micros_due(c) for c in self._fair_candidates(conn, params, limit, state.last_group)]
            wanted = candidate_count(limit)
            total = wanted * len(PRIORITIES) if flow.priority_aging_seconds is not None else wanted
            return [_micros_due(Candidate(**r)) for r in self._execute(
                conn, QUERIES["flow_candidates"], {**params, "limit": wanted, "total": total}).fetchall()]

        choice = choose_work_conserving(flow, state, read, limit)
        with conn.pipeline():
            rows = self._execute(conn, QUERIES["flow_claim"], {
                "queue": queue, "now": now, "lease_seconds": lease_seconds, "ids": list(choice.ids),
                "rate_period": period, "served_group": choice.served_group}).fetchall() if choice.ids else []
            self._execute(conn, "COMMIT")
        if choice.ids:
            self.round_trips -= 1
        return rows

    def _fair_candidates(self, conn: psycopg.Connection[Any], params: dict[str, Any], limit: int,
                         last_group: str | None) -> list[Candidate]:
        """Up to ``limit`` due tasks of each of up to ``limit`` groups after ``last_group`` and of
        the tasks without a group; then, wrapping round, of the groups up to ``last_group``."""
        found = [Candidate(**r) for r in self._execute(conn, QUERIES["flow_group_candidates"], {
            **params, "after": last_group or "", "until": None, "groups": limit, "limit": limit,
            "ungrouped": True}).fetchall()]
        if last_group is not None and len({c.group for c in found}) < limit:
            found += [Candidate(**r) for r in self._execute(conn, QUERIES["flow_group_candidates"], {
                **params, "after": "", "until": last_group, "groups": limit, "limit": limit,
                "ungrouped": False}).fetchall()]
        return found

    def _extend(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        rows = self._fetch_all(QUERIES["extend_leases"], {**_fence_params(refs), "lease_seconds": lease_seconds})
        return {row["id"]: row["lease_expires_at"] for row in rows}

    def _settle(self, settlements: Sequence[Settlement]) -> set[str]:
        with self._connection() as conn:
            return self._settled_on(conn, settlements)

    def _settled_on(self, conn: psycopg.Connection[Any], settlements: Sequence[Settlement]) -> set[str]:
        params = {
            "settlements": settle_document(settlements),
            # Lifecycle events written by the same statement (none when events are off).
            "event_statuses": list(self.events.settled_statuses),
            "with_payload": self.events.include_payload,
        }
        try:
            rows = self._execute(conn, QUERIES["settle"], params).fetchall()
        except (pg_errors.DataError, UnicodeEncodeError) as exc:
            # A value jsonb cannot hold (a NUL inside a result string): the single statement
            # wrote nothing. Classified, so the caller can tell bad input from a bug.
            raise InvalidInput(f"settlement not storable in PostgreSQL: {exc}") from exc
        return {settlements[row["ord"] - 1].task_id for row in rows}

    # -- a task completed inside a transaction (rdq_core/engine/transactions.py) -------------------
    def _begin(self, connection: Any) -> _HandlerTransaction:
        if connection is None:
            # One of the pool's connections, counted against its bound (RDQ_PG_MAX_CONNECTIONS):
            # under a bound the call waits its turn like any other, for a bounded time. Not
            # watched by the statement watchdog: the handler's own statements run on it in
            # between, and idle_in_transaction_session_timeout bounds a transaction left open.
            conn = self._pool.acquire()
            lent = True
        else:
            if not isinstance(connection, psycopg.Connection):
                raise UnsupportedOperation("connection must be a psycopg (3) Connection")
            conn, lent = connection, False
        try:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                raise UnsupportedOperation("the connection is inside a transaction: commit or roll it back first "
                                           "(ctx.transaction() begins the transaction and commits it)")
            if conn.autocommit:  # else psycopg begins it with the first statement
                self._execute(conn, "BEGIN")
        except BaseException:
            if lent:
                self._pool.give_back(conn)
            raise
        return _HandlerTransaction(conn, self._pool if lent else None)

    def _settle_on(self, connection: Any, settlements: Sequence[Settlement]) -> set[str]:
        if not isinstance(connection, psycopg.Connection):
            raise UnsupportedOperation("connection must be a psycopg (3) Connection")
        with _schema_required():
            return self._settled_on(connection, settlements)

    def _release(self, refs: Sequence[ClaimRef]) -> set[str]:
        rows = self._fetch_all(QUERIES["release"], _fence_params(refs))
        return {refs[row["ord"] - 1].task_id for row in rows}

    def _expired(self, limit: int, queue: str | None) -> list[dict[str, Any]]:
        if queue is None:
            return self._fetch_all(QUERIES["find_expired_leases"], {"limit": limit})
        return self._fetch_all(QUERIES["find_expired_leases_in_queue"], {"limit": limit, "queue": queue})

    def _load(self, task_id: str) -> Record | None:
        rows = self._fetch_all(QUERIES["get"], {"task_id": task_id})
        return rows[0] if rows else None

    def _cancel(self, task_id: str) -> tuple[Record | None, bool]:
        rows = self._fetch_all(QUERIES["cancel"], {"task_id": task_id})
        if rows:
            return rows[0], True
        # Only the refusal path pays a second round trip, to say why.
        return self._load(task_id), False

    def _page(self, selection: Selection, limit: int, history: bool) -> list[dict[str, Any]]:
        return self._fetch_all(*page_statement(selection, limit, history))

    def _count(self, selection: Selection) -> int:
        where, params = _where(selection)
        count: int = self._fetch_all(_spliced(QUERIES["count"], selection, where), params)[0]["n"]
        return count

    def _cancel_selected(self, selection: Selection) -> int:
        where, params = _where(selection)
        return self._rowcount(_spliced(QUERIES["cancel_selected"], selection, where), params)

    def _redrive(self, selection: DeadSelection) -> int:
        where, params = _where(selection)
        params.update(redriven_events=self.events.redriven, with_payload=self.events.include_payload)
        redriven: int = self._fetch_all(_spliced(QUERIES["redrive"], selection, where), params)[0]["n"]
        return redriven

    def _purge_dead(self, selection: DeadSelection) -> int:
        where, params = _where(selection)
        return self._rowcount(_spliced(QUERIES["purge_dead"], selection, where), params)

    def _stats(self, queue: str) -> QueueCounts:
        row = self._fetch_all(QUERIES["stats"], {"queue": queue})[0]
        counts = {status.value: row[status.value.lower()] for status in TaskStatus}
        return QueueCounts(counts=counts, oldest_due_age_seconds=row["oldest_pending_age_seconds"], paused=row["paused"])

    def _live_stats(self, queue: str) -> QueueCounts:
        row = self._fetch_all(QUERIES["live_stats"], {"queue": queue})[0]
        counts = {status.value: row[status.value.lower()] for status in LIVE_STATUSES}
        return QueueCounts(counts=counts, oldest_due_age_seconds=row["oldest_pending_age_seconds"], paused=row["paused"])

    def _queues(self) -> list[str]:
        return [row["queue"] for row in self._fetch_all(QUERIES["list_queues"])]

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        return self._rowcount(QUERIES["purge_succeeded"], {"older_than_seconds": older_than_seconds, "limit": limit})

    def _set_paused(self, queue: str, paused: bool) -> None:
        # Committed when this returns (autocommit): every claim that starts later sees it.
        self._rowcount(QUERIES["pause" if paused else "resume"], {"queue": _text(queue)})

    def _paused(self) -> list[str]:
        return [row["queue"] for row in self._fetch_all(QUERIES["paused"])]

    # The outbox: each call is one autocommit statement.
    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        self._rowcount(QUERIES["outbox_put"], {
            "ids": [e["id"] for e in events], "types": [e["type"] for e in events],
            "queues": [_text(e["queue"]) for e in events], "task_ids": [e["task_id"] for e in events],
            "details": [e["detail"] for e in events]})

    def _outbox_take(self, limit: int, lease_seconds: float) -> list[dict[str, Any]]:
        rows = self._fetch_all(QUERIES["outbox_take"], {"limit": limit, "lease_seconds": lease_seconds})
        return sorted(rows, key=lambda row: row["seq"])

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        return self._rowcount(QUERIES["outbox_ack"], {"ids": list(ids)})

    # Engine documents: each call is one autocommit statement on rdq_documents' primary key.
    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        rows = self._fetch_all(QUERIES["doc_get"], {"kind": kind, "key": key})
        return None if not rows else (int(rows[0]["version"]), str(rows[0]["body"]))

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        if expected is None:
            rows = self._fetch_all(QUERIES["doc_insert"], {"kind": kind, "key": key, "body": body})
        else:
            rows = self._fetch_all(QUERIES["doc_replace"], {"kind": kind, "key": key, "body": body, "expected": expected})
        return None if not rows else int(rows[0]["version"])

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        return self._rowcount(QUERIES["doc_delete"], {"kind": kind, "key": key, "expected": expected}) == 1

    def _doc_page(self, kind: str, after: str | None, limit: int) -> list[tuple[str, int, str]]:
        rows = self._fetch_all(QUERIES["doc_page"], {"kind": kind, "after": after or "", "limit": limit})
        return [(str(row["key"]), int(row["version"]), str(row["body"])) for row in rows]

    def _audit_append(self, entry: Mapping[str, Any]) -> datetime:
        params = {"id": entry["id"], "actor": _text(entry["actor"]), "action": _text(entry["action"]),
                  "queue": _text(entry["queue"]), "selection": _text(entry["selection"]), "count": entry["count"]}
        at: datetime = self._fetch_all(QUERIES["audit_append"], params)[0]["at"]
        return at

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> list[dict[str, Any]]:
        params = {"queue": None if queue is None else _text(queue), "limit": limit,
                  "before_at": None if before is None else from_micros(before[0]),
                  "before_id": None if before is None else before[1]}
        return self._fetch_all(QUERIES["audit_page"], params)


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


class _HandlerTransaction:
    """A handler's transaction (``Storage.begin_transaction``) on the caller's connection, or on
    one lent by the pool (``pool``), which gets it back once the transaction is over."""

    def __init__(self, connection: psycopg.Connection[Any], pool: ConnectionPool | None) -> None:
        self.connection = connection
        self._pool = pool

    def commit(self) -> None:
        try:
            self.connection.commit()
        except psycopg.OperationalError as exc:
            raise StorageUnavailable(f"PostgreSQL commit failed: {exc}") from exc
        finally:
            self._give_back()

    def rollback(self) -> None:
        try:
            if not (self.connection.closed or self.connection.broken):
                self.connection.rollback()
        except psycopg.Error:
            pass  # a broken connection rolled back with the session; the pool drops it below
        finally:
            self._give_back()

    def _give_back(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.give_back(self.connection)  # closed instead if still inside a transaction


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


#: The column each status is listed by, as it may be spliced into a statement: a fixed table,
#: checked against the core's order when the module loads.
_ORDER_COLUMN = {TaskStatus.PENDING: "next_attempt_at", TaskStatus.IN_FLIGHT: "lease_expires_at",
                 TaskStatus.DEAD: "dead_at", TaskStatus.SUCCEEDED: "updated_at", TaskStatus.CANCELLED: "updated_at"}
assert _ORDER_COLUMN == dict(ORDER_FIELD), "every status is ordered by a column of rdq_tasks"


def page_statement(selection: Selection, limit: int, history: bool) -> tuple[str, dict[str, Any]]:
    """The statement and parameters of one keyset page (also what plan checks ``EXPLAIN``)."""
    where, params = _where(selection)
    if selection.after is not None:
        where += " " + QUERIES["after_cursor"]
        params.update(after_time=selection.after_time, after_id=selection.after_id)
    params["limit"] = limit
    return _spliced(QUERIES["page_with_history" if history else "page"], selection, where), params


def _where(selection: Selection) -> tuple[str, dict[str, Any]]:
    """The WHERE text and parameters of a selection (fragments from queries.sql); its status and
    order column are spliced in by ``_spliced``."""
    where = QUERIES["selection"]
    params: dict[str, Any] = {"queue": selection.queue}
    if selection.ids is not None:
        where += " " + QUERIES["filter_ids"]
        params["ids"] = list(selection.ids)
    if selection.error_type is not None:
        where += " " + QUERIES["filter_error_type"]
        params["error_type"] = selection.error_type
    if selection.handler is not None:
        where += " " + QUERIES["filter_handler"]
        params["handler"] = selection.handler
    return where, params


def _spliced(statement: str, selection: Selection, where: str) -> str:
    """``statement`` with its selection in place. The status goes in as a literal (a bind
    parameter would hide from the planner which partial index the statement may use); it and the
    order column come from ``TaskStatus`` and ``_ORDER_COLUMN``, never from request text."""
    status = TaskStatus(selection.status)
    return (statement.replace("{where}", where).replace("{status}", status.value)
            .replace("{order}", _ORDER_COLUMN[status]))


def _text(value: str) -> str:
    """Text PostgreSQL can hold: U+0000 becomes U+FFFD (no text column can store it)."""
    return value.replace("\x00", "\ufffd")


def settle_document(settlements: Sequence[Settlement]) -> str:
    """The settle statement's batch: one JSON array, an item per settlement (see queries.sql)."""
    return json.dumps([
        [s.task_id, s.claim_token, s.outcome.value, s.status.value,
         float(s.retry_delay_seconds or 0.0), _error_json(s.error), storable_json(s.result), s.started_after_seconds]
        for s in settlements
    ], separators=(",", ":"), ensure_ascii=False)


def _error_json(error: ErrorInfo | None) -> str | None:
    """jsonb cannot hold U+0000; an error text carrying one must not sink the whole settle batch,
    so it becomes U+FFFD (the text is diagnostic; the core already repaired lone surrogates)."""
    if error is None:
        return None
    return storable_json({key: value.replace("\x00", "\ufffd") if isinstance(value, str) else value
                          for key, value in error.to_dict().items()})


def _fence_params(refs: Sequence[ClaimRef]) -> dict[str, list[str]]:
    return {"task_ids": [ref.task_id for ref in refs], "claim_tokens": [ref.claim_token for ref in refs]}


def _micros_due(candidate: Candidate) -> Candidate:
    """A candidate as ``choose`` ranks it: its due instant in epoch microseconds."""
    due: Any = candidate.due
    return replace(candidate, due=to_micros(due)) if isinstance(due, datetime) else candidate


def _max_connections_from_env() -> int:
    value = os.environ.get(MAX_CONNECTIONS_ENV, "").strip()
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        raise ConfigurationError(f"{MAX_CONNECTIONS_ENV} must be a whole number, not {value!r}") from None
