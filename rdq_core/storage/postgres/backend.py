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
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from ...errors import InvalidInput, StorageUnavailable, UnsupportedOperation
from ...flow import PRIORITIES, Candidate, FlowPolicy, FlowState, candidate_count, choose_work_conserving
from ...model import ClaimRef, ErrorInfo, NewTask, Settlement
from ..codec import Record
from ..core import InsertedRecord, dedupe_states_of
from ..spi import storable_json, to_micros
from .connection import QUERIES as QUERIES  # the statements by name (tests and plan checks read them here)
from .connection import _schema_required
from .operator import PostgresOperator
from .operator import page_statement as page_statement
from .pool import ConnectionPool

#: First key of the transaction-scoped advisory lock of a queue's flow-controlled claims
#: (second: a hash of the queue name; a collision only makes two queues take turns).
FLOW_LOCK_NAMESPACE = 0x72647101
#: First key of the two-key advisory lock that serialises enqueues of one queue and dedupe_key.
DEDUPE_LOCK_NAMESPACE = 0x72647164  # "rdqd"


class PostgresStorage(PostgresOperator):
    """The PostgreSQL store: enqueue, claim, extend, settle, release, the expired-lease scan,
    get, cancel and a handler's transaction here; the pool, statements and clock are
    ``connection.py``'s, the other primitives ``operator.py``'s."""

    # -- primitives -------------------------------------------------------------------------
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

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy,
               worker: str) -> list[dict[str, Any]]:
        if flow.plain:
            return self._fetch_all(QUERIES["claim"], {"queue": queue, "limit": limit, "lease_seconds": lease_seconds,
                                                      "worker": worker})
        with self._connection() as conn:
            try:
                if flow.rate_limit is None and not flow.fair_groups:
                    return self._flow_claim_at_once(conn, queue, limit, lease_seconds, flow, worker)
                return self._flow_claim(conn, queue, limit, lease_seconds, flow, worker)
            finally:
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.rollback()  # an error left the transaction open: end it (and its lock)

    def _flow_claim_at_once(self, conn: psycopg.Connection[Any], queue: str, limit: int, lease_seconds: float,
                            flow: FlowPolicy, worker: str) -> list[dict[str, Any]]:
        """Concurrency limits (with max_in_flight and priority aging), one transaction in one
        round trip: BEGIN, one call of ``rdq_flow_claim_at_once`` (the queue's advisory lock,
        then the decision made in SQL the way ``rdq_core.flow.choose`` makes it, re-reading
        while a candidate window was cut short) and COMMIT, pipelined. The lock is held only
        while the function runs, and its plans are kept for the session."""
        wanted = candidate_count(limit)
        with conn.pipeline():
            self._execute(conn, "BEGIN")
            claimed = self._execute(conn, QUERIES["flow_claim_at_once"], {
                "queue": queue, "limit": limit, "lease_seconds": lease_seconds, "worker": worker,
                "key_limits": json.dumps(dict(flow.concurrency_overrides)), "default_limit": flow.concurrency_limit,
                "max_in_flight": flow.max_in_flight, "aging": flow.priority_aging_seconds,
                "candidates": wanted, "namespace": FLOW_LOCK_NAMESPACE,
                "total": wanted * len(PRIORITIES) if flow.priority_aging_seconds is not None else wanted})
            self._execute(conn, "COMMIT")
        self.round_trips -= 2  # the three statements went in one round trip
        return claimed.fetchall()

    def _flow_claim(self, conn: psycopg.Connection[Any], queue: str, limit: int, lease_seconds: float,
                    flow: FlowPolicy, worker: str) -> list[dict[str, Any]]:
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
                "rate_period": period, "served_group": choice.served_group,
                "worker": worker}).fetchall() if choice.ids else []
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


