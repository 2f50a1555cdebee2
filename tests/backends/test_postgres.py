"""PostgreSQL backend: what is about PostgreSQL itself -- schema, constraints, query plans, joining
a caller's transaction, the pool, session timeouts and the watchdog -- plus the
compliance kit, which holds every promise all backends share.

Needs a PostgreSQL 13+ server (``RDQ_TEST_PG_URL``, default the local trust-auth one). The
session creates a scratch database and drops it at the end; every test gets a fresh schema in
it, selected through the URL's ``search_path`` option (``tests/conftest.py``).
"""

from __future__ import annotations

import threading
import time
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest

psycopg = pytest.importorskip("psycopg")
from psycopg import errors as pg_errors  # noqa: E402 - after importorskip
from psycopg.rows import dict_row  # noqa: E402 - after importorskip

from rdq_core.compliance import Capabilities, StorageCompliance  # noqa: E402 - after importorskip
from rdq_testing.servers import pg_url_with_search_path  # noqa: E402 - after importorskip
from rdq_core.compliance.support import wait_until  # noqa: E402 - after importorskip
from rdq_core.errors import StorageUnavailable  # noqa: E402 - after importorskip
from rdq_core.model import NewTask, Outcome, Settlement, TaskFilter, TaskStatus  # noqa: E402 - after importorskip
from rdq_core.storage import open_storage  # noqa: E402 - after importorskip
from rdq_core.storage.core import Selection  # noqa: E402 - after importorskip
from rdq_core.storage.querytext import migrations  # noqa: E402 - after importorskip
from rdq_core.storage.postgres import (  # noqa: E402 - after importorskip
    CLAIM_SQL,
    FIND_EXPIRED_LEASES_SQL,
    QUERIES,
    PostgresStorage,
    page_statement,
)
from rdq_core.storage.postgres.backend import settle_document  # noqa: E402 - after importorskip


@pytest.fixture
def storage_url(fresh_pg_url):
    """A fresh, empty, not yet migrated store (its own schema) for one test."""
    yield fresh_pg_url


@pytest.fixture
def storage(storage_url):
    store = PostgresStorage(storage_url)
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def sql_conn(storage_url):
    """A plain autocommit connection to the same schema, for looking under the hood."""
    with psycopg.connect(storage_url, autocommit=True) as conn:
        yield conn


class TestPostgresCompliance(StorageCompliance):
    # stats: one statement, the queue's paused flag included.
    capabilities = Capabilities(
        round_trips={"enqueue": 1, "claim": 1, "extend": 1, "release": 1, "settle": 1, "find_expired": 1,
                     "get": 1, "list_dead": 1, "stats": 1, "redrive": 1},
        joins_transactions=True,
        holds_nul=False,
        unreachable_url="postgresql://postgres@127.0.0.1:{port}/nowhere?connect_timeout=2",
    )

    @pytest.fixture
    def storage_url(self, fresh_pg_url):
        yield fresh_pg_url


def new_tasks(count: int, queue: str = "q", prefix: str = "t", **fields) -> list[NewTask]:
    return [NewTask(id=f"{prefix}{i:05d}", queue=queue, handler="h", payload={"n": i}, **fields) for i in range(count)]


def settle_one(storage, claimed, outcome: Outcome, status: TaskStatus, **fields) -> None:
    storage.settle([Settlement(claimed.task.id, claimed.claim_token, outcome, status, **fields)])


# -- lifecycle and schema -----------------------------------------------------------------------

def test_open_storage_routes_both_schemes(storage_url):
    for url in (storage_url, storage_url.replace("postgresql://", "postgres://", 1)):
        store = open_storage(url)
        try:
            assert isinstance(store, PostgresStorage)
        finally:
            store.close()


def test_migrate_twice_is_a_no_op(storage_url, sql_conn):
    store = PostgresStorage(storage_url)
    try:
        store.migrate()
        store.enqueue(new_tasks(1))
        store.migrate()
        versions = sql_conn.execute("SELECT version FROM rdq_schema_version ORDER BY version").fetchall()
        assert versions == [(m.version,) for m in migrations("rdq_core.storage.postgres")]
        assert store.get("t00000") is not None
    finally:
        store.close()


def test_objects_live_in_the_search_path_schema(storage, sql_conn):
    schema = sql_conn.execute("SELECT current_schema()").fetchone()[0]
    tables = {
        row[0]
        for row in sql_conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        )
    }
    assert {"rdq_tasks", "rdq_schema_version"} <= tables
    assert "rdq_attempts" not in tables  # the history is in the task row since schema 8


def test_constraints_reject_bad_rows(storage, sql_conn):
    storage.enqueue(new_tasks(1))
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute("UPDATE rdq_tasks SET status = 'BOGUS' WHERE id = 't00000'")
    # IN_FLIGHT without a claim token would defeat fencing.
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute("UPDATE rdq_tasks SET status = 'IN_FLIGHT' WHERE id = 't00000'")
    # The history in the row is numbered 1..n with no gap or repeat (the settle appends last + 1).
    set_history = "UPDATE rdq_tasks SET attempts = %s::jsonb WHERE id = 't00000'"
    sql_conn.execute(set_history, ('[{"attempt_no": 1, "outcome": "SUCCESS"}]',))
    for bad in ('[{"attempt_no": 2, "outcome": "SUCCESS"}]',
                '[{"attempt_no": 1, "outcome": "SUCCESS"}, {"attempt_no": 1, "outcome": "SUCCESS"}]',
                '[{"attempt_no": 1}, {"attempt_no": 3}]', '{"attempt_no": 1}', 'null'):
        with pytest.raises((pg_errors.CheckViolation, pg_errors.NotNullViolation)):
            sql_conn.execute(set_history, (bad,))
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute("INSERT INTO rdq_audit_log (id, actor, action, queue, selection, count)"
                         " VALUES ('a1', 'local', 'redrive', 'q', '{}', -1)")


# -- query plans ------------------------------------------------------------------------------

def test_claim_plan_uses_the_pending_index_over_a_backlog(storage, sql_conn):
    # A backlog that dwarfs the batch: many finished tasks, other queues, future tasks.
    sql_conn.execute(
        """
        INSERT INTO rdq_tasks (id, queue, handler, status, next_attempt_at, payload)
        SELECT 'b' || g,
               CASE WHEN g % 4 = 0 THEN 'hot' ELSE 'q' || (g % 7) END,
               'h',
               CASE WHEN g % 3 = 0 THEN 'PENDING' ELSE 'SUCCEEDED' END,
               now() - (g || ' seconds')::interval,
               '{}'::jsonb
        FROM generate_series(1, 20000) AS g
        """
    )
    sql_conn.execute("ANALYZE rdq_tasks")
    claim_plan = "\n".join(
        row[0]
        for row in sql_conn.execute(
            "EXPLAIN " + CLAIM_SQL, {"queue": "hot", "limit": 100, "lease_seconds": 30.0, "worker": "host:1"}
        )
    )
    assert "rdq_tasks_pending_claim_idx" in claim_plan, claim_plan
    # The paused check is uncorrelated: evaluated once per statement, above the index scan, never
    # per task.
    assert "rdq_paused_queues" in claim_plan and "One-Time Filter" in claim_plan, claim_plan
    reap_plan = "\n".join(
        row[0] for row in sql_conn.execute("EXPLAIN " + FIND_EXPIRED_LEASES_SQL, {"limit": 100, "queue": None})
    )
    assert "rdq_tasks_lease_expiry_idx" in reap_plan and "Seq Scan" not in reap_plan, reap_plan
    reap_one_plan = _plan(sql_conn, QUERIES["find_expired_leases_in_queue"], {"limit": 100, "queue": "hot"})
    assert "rdq_tasks_lease_expiry_idx" in reap_one_plan and "Sort" not in reap_one_plan, reap_one_plan
    assert len(storage.claim("hot", 100, 30)) == 100


def _plan(conn, sql: str, params) -> str:
    return "\n".join(row[0] for row in conn.execute("EXPLAIN " + sql, params))


def test_hot_plans_hold_without_statistics(storage, sql_conn):
    """A table never analyzed (new, or a queue that was empty when it last was): the claim still
    walks the claim index and the fenced writes still probe the primary key. Before schema 8
    the claim took (queue, status) and sorted the whole backlog, and the settle read the whole
    IN_FLIGHT index for id = ANY(...)."""
    sql_conn.execute(
        "INSERT INTO rdq_tasks (id, queue, handler, status, next_attempt_at, payload)"
        " SELECT 'b' || lpad(g::text, 6, '0'), 'q', 'h', 'PENDING', now() - interval '1 minute', '{}'::jsonb"
        " FROM generate_series(1, 20000) AS g")
    claimed = storage.claim("q", 100, 30)
    assert len(claimed) == 100
    claim_plan = _plan(sql_conn, CLAIM_SQL, {"queue": "q", "limit": 100, "lease_seconds": 30.0, "worker": "host:1"})
    assert "rdq_tasks_pending_claim_idx" in claim_plan and "rdq_tasks_queue_idx" not in claim_plan, claim_plan
    fenced = {"task_ids": [c.task.id for c in claimed], "claim_tokens": [c.claim_token for c in claimed]}
    settle_params = {"settlements": settle_document([
        Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed]),
        "event_statuses": [], "with_payload": False}
    for name, params in (("settle", settle_params), ("extend_leases", {**fenced, "lease_seconds": 30.0}),
                         ("release", fenced)):
        plan = _plan(sql_conn, QUERIES[name], params)
        # (The row-lock probe may still be a sequential scan on a table this small: a costed
        # choice bounded by the table's size, unlike a partial index estimated at one row.)
        assert "rdq_tasks_pkey" in plan, (name, plan)
        assert "rdq_tasks_lease_expiry_idx" not in plan, (name, plan)


def test_the_reaper_walks_the_lease_index_queue_by_queue(storage, sql_conn):
    # 50 queues with tasks in flight, some leases expired; many finished tasks around them.
    sql_conn.execute(
        """
        INSERT INTO rdq_tasks (id, queue, handler, status, next_attempt_at, claim_token, claimed_at, lease_expires_at)
        SELECT 'b' || g, 'q' || (g % 50), 'h', s, now(),
               CASE WHEN s = 'IN_FLIGHT' THEN 'token' END, CASE WHEN s = 'IN_FLIGHT' THEN now() END,
               CASE WHEN s = 'IN_FLIGHT' THEN now() + (CASE WHEN g % 3 = 0 THEN -g ELSE g END) * interval '1 second' END
        FROM generate_series(1, 30000) AS g,
             LATERAL (SELECT CASE WHEN g % 4 = 0 THEN 'IN_FLIGHT' ELSE 'SUCCEEDED' END AS s) AS x
        """
    )
    sql_conn.execute("ANALYZE rdq_tasks")
    plan = _plan(sql_conn, FIND_EXPIRED_LEASES_SQL, {"limit": 100})
    # The skip scan probes the IN_FLIGHT index only: the (queue, status) index would walk the
    # finished rows of a queue to find none in flight.
    assert "rdq_tasks_lease_expiry_idx" in plan, plan
    assert "rdq_tasks_queue_status_idx" not in plan and "Seq Scan" not in plan, plan
    # Across queues, the oldest expiries first.
    expected = [row[0] for row in sql_conn.execute(
        "SELECT id FROM rdq_tasks WHERE status = 'IN_FLIGHT' AND lease_expires_at <= now()"
        " ORDER BY lease_expires_at, id LIMIT 100")]
    assert [item.task.id for item in storage.find_expired_leases(100)] == expected
    expected_q7 = [row[0] for row in sql_conn.execute(
        "SELECT id FROM rdq_tasks WHERE queue = 'q7' AND status = 'IN_FLIGHT' AND lease_expires_at <= now()"
        " ORDER BY lease_expires_at, id LIMIT 20")]
    assert [item.task.id for item in storage.find_expired_leases(20, queue="q7")] == expected_q7


def test_each_status_is_paged_through_its_own_index(storage, sql_conn):
    # Big queues in every status, and a small one whose pages must not scan the rest.
    sql_conn.execute(
        """
        INSERT INTO rdq_tasks (id, queue, handler, status, next_attempt_at, claim_token, lease_expires_at,
                               dead_at, updated_at)
        SELECT 'b' || g, CASE WHEN g % 100 = 0 THEN 'small' ELSE 'big' || (g % 3) END, 'h', s,
               now() - (g || ' seconds')::interval,
               CASE WHEN s = 'IN_FLIGHT' THEN 'token' END,
               CASE WHEN s = 'IN_FLIGHT' THEN now() + (g || ' seconds')::interval END,
               CASE WHEN s = 'DEAD' THEN now() - (g || ' seconds')::interval END,
               now() - (g || ' seconds')::interval
        FROM generate_series(1, 50000) AS g,
             LATERAL (SELECT (ARRAY['PENDING', 'IN_FLIGHT', 'DEAD', 'SUCCEEDED', 'CANCELLED'])[1 + (g / 100) % 5] AS s) AS x
        """
    )
    sql_conn.execute("ANALYZE rdq_tasks")
    expected = {TaskStatus.PENDING: "rdq_tasks_pending_due_idx", TaskStatus.IN_FLIGHT: "rdq_tasks_lease_expiry_idx",
                TaskStatus.DEAD: "rdq_tasks_dead_idx", TaskStatus.SUCCEEDED: "rdq_tasks_finished_idx",
                TaskStatus.CANCELLED: "rdq_tasks_finished_idx"}
    for status, index in expected.items():
        for after in (None, (1_000_000, "b")):
            plan = _plan(sql_conn, *page_statement(Selection(queue="small", status=status, after=after), 51, False))
            assert index in plan and "Seq Scan" not in plan, plan
    # Each status's page returns its own tasks in (instant, id) order.
    for status in expected:
        selection = Selection(queue="small", status=status)
        with sql_conn.cursor(row_factory=dict_row) as cursor:
            rows = cursor.execute(*page_statement(selection, 1000, False)).fetchall()
        assert rows and {row["status"] for row in rows} == {status.value}
        keys = [(row[selection.order_field], row["id"]) for row in rows]
        assert keys == sorted(keys)


def test_audit_pages_walk_their_index_newest_first(storage, sql_conn):
    sql_conn.execute(
        "INSERT INTO rdq_audit_log (id, at, actor, action, queue, selection, count)"
        " SELECT 'a' || g, now() - (g || ' ms')::interval, 'local', 'redrive', 'q' || (g % 50), '{}', 1"
        " FROM generate_series(1, 20000) AS g"
    )
    sql_conn.execute("ANALYZE rdq_audit_log")
    last = sql_conn.execute("SELECT at FROM rdq_audit_log WHERE id = 'a100'").fetchone()[0]
    for queue, index in (("q7", "rdq_audit_log_queue_at_idx"), (None, "rdq_audit_log_at_idx")):
        for before_at, before_id in ((None, None), (last, "a100")):
            params = {"queue": queue, "limit": 51, "before_at": before_at, "before_id": before_id}
            plan = _plan(sql_conn, QUERIES["audit_page"], params)
            assert f"Index Scan Backward using {index}" in plan and "Sort" not in plan, plan
    assert [e.id for e in storage.list_audit(limit=3).entries] == ["a1", "a2", "a3"]


def test_cancel_selected_leaves_a_task_claimed_while_it_waited_for_the_row(storage, storage_url, sql_conn):
    storage.enqueue(new_tasks(3))
    outcome: dict[str, int] = {}
    with psycopg.connect(storage_url) as claimer:  # a claim in progress: the row is locked, not committed
        claimer.execute(
            "UPDATE rdq_tasks SET status = 'IN_FLIGHT', claim_token = 'token', claimed_at = now(),"
            " lease_expires_at = now() + interval '1 minute' WHERE id = 't00001'"
        )
        canceller = threading.Thread(target=lambda: outcome.update(n=storage.cancel_selected("q", TaskFilter())))
        canceller.start()
        wait_until(lambda: sql_conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%CANCELLED%'").fetchone()[0],
            what="cancel_selected to wait for the claimed row")
        claimer.commit()
        canceller.join(timeout=10)
    assert not canceller.is_alive()
    assert outcome == {"n": 2}
    statuses = dict(sql_conn.execute("SELECT id, status FROM rdq_tasks ORDER BY id").fetchall())
    assert statuses == {"t00000": "CANCELLED", "t00001": "IN_FLIGHT", "t00002": "CANCELLED"}


def test_a_claim_sees_a_pause_in_its_own_statement(storage, sql_conn):
    storage.enqueue(new_tasks(2))
    # The row alone stops the claim: no check outside the statement is involved.
    sql_conn.execute("INSERT INTO rdq_paused_queues (queue) VALUES ('q')")
    assert storage.claim("q", 10, 30) == []
    assert storage.paused_queues() == {"q"}
    storage.set_paused("q", False)
    assert len(storage.claim("q", 10, 30)) == 2


# -- joining the caller's transaction ----------------------------------------------------------

def test_enqueue_joins_the_callers_transaction(storage, storage_url):
    with psycopg.connect(storage_url) as conn:  # not autocommit: a transaction is open
        storage.enqueue([NewTask(id="rolled-back", queue="q", handler="h")], connection=conn)
        assert storage.get("rolled-back") is None  # not visible outside before commit
        conn.rollback()
        assert storage.get("rolled-back") is None

        storage.enqueue([NewTask(id="committed", queue="q", handler="h")], connection=conn)
        assert storage.get("committed") is None
        conn.commit()
        assert storage.get("committed").status is TaskStatus.PENDING


def test_client_enqueue_commits_with_the_business_write_or_not_at_all(storage, storage_url):
    from rdq_core import Client

    client = Client(storage)
    with psycopg.connect(storage_url) as conn:
        conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        conn.commit()
        conn.execute("INSERT INTO orders VALUES ('o-1')")
        client.enqueue("emails", "send_email", {"order": "o-1"}, id="mail-o-1", connection=conn)
        conn.rollback()  # the business write failed: no task either
        assert storage.get("mail-o-1") is None
        conn.execute("INSERT INTO orders VALUES ('o-2')")
        client.enqueue("emails", "send_email", {"order": "o-2"}, id="mail-o-2", connection=conn)
        conn.commit()
    assert client.get("mail-o-2").payload == {"order": "o-2"}


# -- the pool ---------------------------------------------------------------------------------

def test_broken_connections_are_discarded(storage, pg_database_url):
    storage.enqueue(new_tasks(1))
    with psycopg.connect(pg_database_url, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()[0]
    assert killed >= 1
    time.sleep(0.1)
    failures = 0
    for _ in range(3):
        try:
            assert storage.get("t00000") is not None
            break
        except StorageUnavailable:
            failures += 1
    assert failures == 0  # the dead idle connection was spotted without a round trip


# -- every call is bounded in time --------------------------------------------------------------

def _through(proxy, url: str, **query: str) -> str:
    """``url`` re-aimed at the proxy's port, with extra query parameters."""
    parts = urlsplit(url)
    merged = dict(parse_qsl(parts.query))
    for name, value in query.items():
        merged[name] = f"{merged[name]} {value}" if name == "options" and name in merged else value
    # quote, not quote_plus: libpq does not read "+" as a space.
    return urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}",
                                     query=urlencode(merged, quote_via=quote)))


def test_session_timeouts_and_tcp_settings_default_and_yield_to_the_url(storage_url):
    store = PostgresStorage(storage_url)
    try:
        shown = {name: store._fetch_all(f"SHOW {name}")[0][name]
                 for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")}
        assert shown == {"statement_timeout": "30s", "lock_timeout": "10s", "idle_in_transaction_session_timeout": "1min"}
        with store._connection() as conn:
            params = conn.info.get_parameters()
        assert (params["keepalives"], params["keepalives_idle"], params["connect_timeout"]) == ("1", "30", "10")
        options = dict(parse_qsl(urlsplit(storage_url).query))["options"]
        assert store._fetch_all("SHOW search_path")[0]["search_path"] == options.split("=", 1)[1]
    finally:
        store.close()
    custom = pg_url_with_search_path(storage_url, "public").replace("options=", "options=-c%20statement_timeout%3D2s%20", 1)
    custom += "&keepalives_idle=7&connect_timeout=3"
    store = PostgresStorage(custom)
    try:
        assert store._fetch_all("SHOW statement_timeout")[0]["statement_timeout"] == "2s"
        with store._connection() as conn:
            params = conn.info.get_parameters()
        assert (params["keepalives_idle"], params["connect_timeout"]) == ("7", "3")
        assert store._pool.statement_deadline == 3.0  # 2 s + a quarter, at least 1 s
    finally:
        store.close()
    # For a pooler that refuses startup options: nothing sent, the client deadline stays.
    store = PostgresStorage(storage_url + "&rdq_session_timeouts=off")
    try:
        assert store._fetch_all("SHOW lock_timeout")[0]["lock_timeout"] == "0"
        assert store._pool.statement_deadline == 35.0
        assert "rdq_session_timeouts" not in store._pool._conninfo
    finally:
        store.close()


def test_a_half_open_connection_raises_storage_unavailable_within_the_statement_deadline(storage_url):
    from tests.backends.stall_proxy import StallingProxy

    with StallingProxy("127.0.0.1", urlsplit(storage_url).port or 5432) as proxy:
        store = PostgresStorage(_through(proxy, storage_url, options="-c statement_timeout=500ms", connect_timeout="1"))
        try:
            store.migrate()
            store.enqueue(new_tasks(1))
            proxy.stall()  # the pooled connection stays open; nothing answers any more
            started = time.monotonic()
            with pytest.raises(StorageUnavailable, match="did not answer"):
                store.claim("q", 1, 30)
            assert time.monotonic() - started < 5  # 0.5 s statement_timeout + 1 s grace
            # The cut-off connection was dropped; a new one cannot get through either.
            started = time.monotonic()
            with pytest.raises(StorageUnavailable, match="connect"):
                store.get("t00000")
            assert time.monotonic() - started < 6
        finally:
            proxy.close()  # first: closing the store must not wait on the stalled peer
            store.close()


def test_a_server_that_never_answers_the_handshake_is_storage_unavailable(storage_url):
    from tests.backends.stall_proxy import StallingProxy

    with StallingProxy("127.0.0.1", urlsplit(storage_url).port or 5432, stalled=True) as proxy:
        store = PostgresStorage(_through(proxy, storage_url, connect_timeout="1"))
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            store.stats("q")
        assert time.monotonic() - started < 6  # libpq may try twice (SSL, then plain)
        store.close()


def test_the_watchdog_never_cuts_off_a_statement_that_answers_in_time(storage):
    storage.enqueue(new_tasks(3))
    for _ in range(50):
        assert len(storage.claim("q", 3, 30)) in (0, 3)
    assert storage.stats("q").in_flight == 3
    idle = list(storage._pool._idle)
    assert idle and not any(conn.closed or conn.broken for conn in idle)  # reused, never cut off


def test_schema_8_moves_existing_history_into_the_task_row_and_numbering_goes_on(pg_database_url):
    """A store at schema 7 (history in rdq_attempts) upgraded by ``migrate``: every task keeps its
    history as it was, and the next attempt is numbered from it."""
    from rdq_testing.servers import pg_fresh_schema
    from rdq_core.storage.postgres import backend as pg_backend

    url = pg_fresh_schema(pg_database_url, prefix="upgrade_")
    earlier = [m for m in migrations("rdq_core.storage.postgres") if m.version <= 7]
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(pg_backend.QUERIES["create_version_table"])
            for migration in earlier:
                conn.execute(migration.text)
                conn.execute(pg_backend.QUERIES["record_version"],
                             {"version": migration.version, "name": migration.name})
        conn.execute(
            "INSERT INTO rdq_tasks (id, queue, handler, status, attempt_count, next_attempt_at, last_error)"
            " VALUES ('old', 'q', 'h', 'PENDING', 2, now(), '{\"type\": \"E\", \"message\": \"m\"}'),"
            "        ('fresh', 'q', 'h', 'PENDING', 0, now() + interval '1 hour', NULL)")
        conn.execute(
            "INSERT INTO rdq_attempts (task_id, attempt_no, outcome, started_at, finished_at, error) VALUES"
            " ('old', 2, 'LEASE_EXPIRED', now() - interval '1 minute', now(), NULL),"
            " ('old', 1, 'RETRYABLE_FAILURE', now() - interval '2 minutes', now() - interval '90 seconds',"
            "  '{\"type\": \"E\", \"message\": \"m\"}')")
    store = open_storage(url)
    try:
        store.migrate()
        old = store.get("old")
        assert [(a.attempt_no, a.outcome) for a in old.attempts] == [
            (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.LEASE_EXPIRED)]
        assert old.attempts[0].error is not None and old.attempts[0].error.type == "E"
        assert old.attempts[0].started_at < old.attempts[1].started_at
        assert store.get("fresh").attempts == ()
        (claimed,) = store.claim("q", 10, 30)
        settle_one(store, claimed, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
        assert [a.attempt_no for a in store.get("old").attempts] == [1, 2, 3]
    finally:
        store.close()
