"""PostgreSQL backend: schema, SQL-level guarantees and round-trip budgets, plus the kit.

Needs a PostgreSQL 13+ server (``RDQ_TEST_PG_URL``, default the local trust-auth one). The
session creates a scratch database ``rdq_test_<random>`` and drops it at the end; every test
gets a fresh schema in it, selected through the URL's ``search_path`` option.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import Counter
from datetime import timedelta
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest

psycopg = pytest.importorskip("psycopg")
from psycopg import errors as pg_errors  # noqa: E402
from psycopg import sql  # noqa: E402

from rdq_core.compliance import StorageCompliance  # noqa: E402
from rdq_core.errors import InvalidCursor, InvalidInput, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound  # noqa: E402
from rdq_core.model import (  # noqa: E402
    DeadFilter,
    ErrorInfo,
    NewTask,
    Outcome,
    Settlement,
    TaskStatus,
)
from rdq_core.storage import open_storage  # noqa: E402
from rdq_core.storage.postgres import CLAIM_SQL, FIND_EXPIRED_LEASES_SQL, PostgresStorage  # noqa: E402

BASE_URL = os.environ.get("RDQ_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def url_with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


def url_with_search_path(url: str, schema: str) -> str:
    """Adds ``options=-csearch_path=<schema>`` (libpq's own way to set a session GUC)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    option = f"-csearch_path={schema}"
    query["options"] = f"{query['options']} {option}" if "options" in query else option
    return urlunsplit(parts._replace(query=urlencode(query)))


@pytest.fixture(scope="session")
def pg_database_url():
    """A scratch database for the session, dropped at the end (only the one we created)."""
    try:
        admin = psycopg.connect(BASE_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        message = f"PostgreSQL is not reachable at {BASE_URL} (set RDQ_TEST_PG_URL): {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    database = f"rdq_test_{secrets.token_hex(6)}"
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        yield url_with_database(BASE_URL, database)
    finally:
        with psycopg.connect(BASE_URL, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))


def fresh_schema_url(database_url: str) -> str:
    schema = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    return url_with_search_path(database_url, schema)


@pytest.fixture
def storage_url(pg_database_url):
    """A fresh, empty, not yet migrated store (its own schema) for one test."""
    yield fresh_schema_url(pg_database_url)


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
    @pytest.fixture
    def storage_url(self, pg_database_url):
        yield fresh_schema_url(pg_database_url)


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
        versions = sql_conn.execute("SELECT version FROM rdq_schema_version").fetchall()
        assert versions == [(1,)]
        assert store.get("t00000") is not None
    finally:
        store.close()


def test_concurrent_migrations_are_serialised(storage_url, sql_conn):
    stores = [PostgresStorage(storage_url) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def run(store):
        barrier.wait()
        try:
            store.migrate()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store in stores:
        store.close()
    assert errors == []
    assert sql_conn.execute("SELECT count(*) FROM rdq_schema_version").fetchone() == (1,)


def test_objects_live_in_the_search_path_schema(storage, sql_conn):
    schema = sql_conn.execute("SELECT current_schema()").fetchone()[0]
    tables = {
        row[0]
        for row in sql_conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        )
    }
    assert {"rdq_tasks", "rdq_attempts", "rdq_schema_version"} <= tables


def test_constraints_reject_bad_rows(storage, sql_conn):
    storage.enqueue(new_tasks(1))
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute("UPDATE rdq_tasks SET status = 'BOGUS' WHERE id = 't00000'")
    # IN_FLIGHT without a claim token would defeat fencing.
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute("UPDATE rdq_tasks SET status = 'IN_FLIGHT' WHERE id = 't00000'")
    insert_attempt = "INSERT INTO rdq_attempts (task_id, attempt_no, outcome) VALUES (%s, %s, %s)"
    sql_conn.execute(insert_attempt, ("t00000", 1, "SUCCESS"))
    with pytest.raises(pg_errors.UniqueViolation):
        sql_conn.execute(insert_attempt, ("t00000", 1, "RETRYABLE_FAILURE"))
    with pytest.raises(pg_errors.CheckViolation):
        sql_conn.execute(insert_attempt, ("t00000", 2, "MAYBE"))
    with pytest.raises(pg_errors.ForeignKeyViolation):
        sql_conn.execute(insert_attempt, ("no-such-task", 1, "SUCCESS"))
    sql_conn.execute("DELETE FROM rdq_tasks WHERE id = 't00000'")
    assert sql_conn.execute("SELECT count(*) FROM rdq_attempts").fetchone() == (0,)


# -- claims -----------------------------------------------------------------------------------

def test_concurrent_claims_never_return_a_task_twice(storage):
    storage.enqueue(new_tasks(400))
    claimers = 8
    barrier = threading.Barrier(claimers)
    claimed_ids: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claim_until_empty():
        barrier.wait()
        try:
            while True:
                batch = storage.claim("q", 7, 60)
                if not batch:
                    return
                with lock:
                    claimed_ids.extend(c.task.id for c in batch)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim_until_empty) for _ in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    duplicates = [task_id for task_id, n in Counter(claimed_ids).items() if n > 1]
    assert duplicates == []
    assert len(claimed_ids) == 400
    assert storage.stats("q").in_flight == 400


def test_claim_takes_oldest_due_first_and_stamps_a_lease(storage):
    storage.enqueue([NewTask(id="later", queue="q", handler="h", delay_seconds=3600)])
    storage.enqueue([NewTask(id="first", queue="q", handler="h")])
    storage.enqueue([NewTask(id="second", queue="q", handler="h")])
    storage.enqueue([NewTask(id="other-queue", queue="other", handler="h")])
    before = storage.now()
    claimed = storage.claim("q", 10, 30)
    assert [c.task.id for c in claimed] == ["first", "second"]
    for c in claimed:
        assert c.task.status is TaskStatus.IN_FLIGHT
        assert c.claimed_at >= before
        assert 29 <= (c.lease_expires_at - c.claimed_at).total_seconds() <= 31
    assert len({c.claim_token for c in claimed}) == 2


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
    sql_conn.execute("ANALYZE rdq_attempts")
    claim_plan = "\n".join(
        row[0]
        for row in sql_conn.execute(
            "EXPLAIN " + CLAIM_SQL, {"queue": "hot", "limit": 100, "lease_seconds": 30.0}
        )
    )
    assert "rdq_tasks_pending_due_idx" in claim_plan, claim_plan
    reap_plan = "\n".join(
        row[0] for row in sql_conn.execute("EXPLAIN " + FIND_EXPIRED_LEASES_SQL, {"limit": 100, "queue": None})
    )
    assert "rdq_tasks_lease_expiry_idx" in reap_plan, reap_plan
    assert len(storage.claim("hot", 100, 30)) == 100


# -- round trips --------------------------------------------------------------------------------

def test_round_trips_per_batch_are_constant(storage):
    trips = storage.round_trips
    storage.enqueue(new_tasks(100))
    assert storage.round_trips - trips == 1

    trips = storage.round_trips
    claimed = storage.claim("q", 100, 60)
    assert len(claimed) == 100
    assert storage.round_trips - trips == 1

    trips = storage.round_trips
    storage.extend_leases([c.ref for c in claimed], 120)
    assert storage.round_trips - trips == 1

    trips = storage.round_trips
    storage.release([c.ref for c in claimed[:10]])
    assert storage.round_trips - trips == 1

    trips = storage.round_trips
    storage.settle(
        [
            Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"ok": i})
            if i % 2
            else Settlement(
                c.task.id, c.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                retry_delay_seconds=5, error=ErrorInfo("Boom", "boom"),
            )
            for i, c in enumerate(claimed[10:])
        ]
    )
    assert storage.round_trips - trips == 1

    trips = storage.round_trips
    dead_page = storage.list_dead("q", limit=50)
    task = storage.get(claimed[11].task.id)
    assert storage.round_trips - trips == 2
    assert dead_page.tasks == ()
    assert task.status is TaskStatus.SUCCEEDED and task.result == {"ok": 1}
    assert [a.attempt_no for a in task.attempts] == [1]


# -- fencing ------------------------------------------------------------------------------------

def test_settle_with_stale_or_unknown_token_changes_nothing(storage):
    storage.enqueue(new_tasks(2))
    first, second = storage.claim("q", 2, 60)
    settle_one(storage, first, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING)
    (reclaimed,) = storage.claim("q", 1, 60)
    assert reclaimed.task.id == first.task.id and reclaimed.claim_token != first.claim_token
    snapshot = storage.get(first.task.id)

    with pytest.raises(StaleClaim) as stale:
        storage.settle(
            [
                Settlement(first.task.id, first.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                Settlement(second.task.id, "never-issued", Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                Settlement("no-such-task", "x", Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                Settlement(second.task.id, second.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
            ]
        )
    assert stale.value.task_ids == (first.task.id, second.task.id, "no-such-task")
    # The stale items changed nothing; the valid one was applied before the error.
    assert storage.get(first.task.id) == snapshot
    assert storage.get(second.task.id).status is TaskStatus.SUCCEEDED

    with pytest.raises(StaleClaim):
        storage.extend_leases([first.ref], 600)
    with pytest.raises(StaleClaim):
        storage.release([first.ref])
    assert storage.get(first.task.id) == snapshot


def test_racing_batch_settles_in_opposite_orders_neither_deadlock_nor_double_record(storage):
    # A late worker and a reaper (or two reapers) may settle overlapping batches in different
    # orders; rows are locked in id order, so they queue instead of deadlocking.
    storage.enqueue(new_tasks(200))
    claimed = storage.claim("q", 200, 60)
    orders = [claimed, claimed[::-1], claimed[100:] + claimed[:100], claimed[::2] + claimed[1::2]]
    barrier = threading.Barrier(len(orders))
    applied_per_racer: list[int] = []
    errors: list[BaseException] = []

    def settle_batch(batch):
        barrier.wait()
        try:
            storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in batch])
            applied_per_racer.append(len(batch))
        except StaleClaim as stale:
            applied_per_racer.append(len(batch) - len(stale.task_ids))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=settle_batch, args=(order,)) for order in orders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(applied_per_racer) == 200
    for c in claimed:
        assert [a.attempt_no for a in storage.get(c.task.id).attempts] == [1]


def test_lease_expired_settle_is_refused_before_expiry(storage):
    storage.enqueue(new_tasks(1))
    (held,) = storage.claim("q", 1, 60)
    assert storage.find_expired_leases(10) == []
    with pytest.raises(StaleClaim):
        settle_one(storage, held, Outcome.LEASE_EXPIRED, TaskStatus.PENDING)
    task = storage.get(held.task.id)
    assert task.status is TaskStatus.IN_FLIGHT and task.attempts == ()
    settle_one(storage, held, Outcome.SUCCESS, TaskStatus.SUCCEEDED)


def test_extending_in_time_keeps_the_task_from_the_reaper(storage):
    storage.enqueue(new_tasks(1))
    (held,) = storage.claim("q", 1, 0)
    (expired,) = storage.find_expired_leases(10)
    assert expired.claim_token == held.claim_token
    storage.extend_leases([held.ref], 60)
    with pytest.raises(StaleClaim):
        settle_one(storage, expired, Outcome.LEASE_EXPIRED, TaskStatus.PENDING)
    settle_one(storage, held, Outcome.SUCCESS, TaskStatus.SUCCEEDED)


# -- history ------------------------------------------------------------------------------------

def test_redrive_then_lease_expiry_numbers_after_all_earlier_attempts(storage):
    storage.enqueue(new_tasks(1, max_attempts=2))
    (c,) = storage.claim("q", 1, 60)
    settle_one(storage, c, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=ErrorInfo("Boom"))
    (c,) = storage.claim("q", 1, 60)
    settle_one(storage, c, Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD, error=ErrorInfo("Boom"))
    assert storage.redrive("q", DeadFilter()) == 1
    redriven = storage.get("t00000")
    assert (redriven.status, redriven.attempt_count, redriven.redrive_count) == (TaskStatus.PENDING, 0, 1)
    assert redriven.dead_at is None

    (c,) = storage.claim("q", 1, 0)  # the worker "dies": its lease is over at once
    (expired,) = storage.find_expired_leases(10, queue="q")
    settle_one(
        storage, expired, Outcome.LEASE_EXPIRED, TaskStatus.PENDING,
        retry_delay_seconds=0, error=ErrorInfo("LeaseExpired"),
    )
    task = storage.get("t00000")
    assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
        (1, Outcome.RETRYABLE_FAILURE),
        (2, Outcome.RETRYABLE_FAILURE),
        (3, Outcome.LEASE_EXPIRED),
    ]
    assert task.attempt_count == 1 and task.status is TaskStatus.PENDING
    assert task.attempts[2].started_at == c.claimed_at
    assert task.attempts[2].finished_at >= task.attempts[2].started_at


def test_settle_applies_each_decision(storage):
    storage.enqueue(new_tasks(3))
    ok, retry, dead = storage.claim("q", 3, 60)
    before = storage.now()
    storage.settle(
        [
            Settlement(ok.task.id, ok.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=[1, 2]),
            Settlement(
                retry.task.id, retry.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                retry_delay_seconds=100, error=ErrorInfo("Flaky", "again"),
            ),
            Settlement(
                dead.task.id, dead.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                error=ErrorInfo("Fatal", "no", "stack"),
            ),
        ]
    )
    ok_task, retry_task, dead_task = (storage.get(t.task.id) for t in (ok, retry, dead))
    assert ok_task.status is TaskStatus.SUCCEEDED and ok_task.result == [1, 2]
    assert retry_task.status is TaskStatus.PENDING and retry_task.last_error == ErrorInfo("Flaky", "again")
    assert 99 <= (retry_task.next_attempt_at - before).total_seconds() <= 110
    assert dead_task.status is TaskStatus.DEAD and dead_task.dead_at >= before
    assert dead_task.attempts[0].error == ErrorInfo("Fatal", "no", "stack")
    for task in (ok_task, retry_task, dead_task):
        assert task.attempt_count == 1 and task.lease_expires_at is None
    assert storage.claim("q", 10, 60) == []  # the retry is not due yet


def test_error_text_with_nul_does_not_sink_the_settle(storage):
    storage.enqueue(new_tasks(1))
    (c,) = storage.claim("q", 1, 60)
    settle_one(storage, c, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=ErrorInfo("Bin", "a\x00b", "s\x00"))
    assert storage.get(c.task.id).last_error == ErrorInfo("Bin", "a\ufffdb", "s\ufffd")


def test_a_result_jsonb_cannot_hold_is_invalid_input_and_writes_nothing(storage):
    storage.enqueue(new_tasks(2))
    a, b = storage.claim("q", 2, 60)
    with pytest.raises(InvalidInput):
        storage.settle([Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result="ok"),
                        Settlement(b.task.id, b.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result="a\x00b")])
    assert {storage.get(c.task.id).status for c in (a, b)} == {TaskStatus.IN_FLIGHT}


def test_release_spends_no_attempt(storage):
    storage.enqueue(new_tasks(1))
    original = storage.get("t00000")
    (c,) = storage.claim("q", 1, 60)
    storage.release([c.ref])
    task = storage.get("t00000")
    assert task.status is TaskStatus.PENDING and task.attempts == () and task.attempt_count == 0
    assert task.next_attempt_at == original.next_attempt_at
    (again,) = storage.claim("q", 1, 60)
    assert again.claim_token != c.claim_token


# -- enqueue --------------------------------------------------------------------------------------

def test_enqueue_is_idempotent_and_detects_cross_queue_conflicts(storage):
    (first,) = storage.enqueue([NewTask(id="x", queue="q", handler="h", payload={"v": 1})])
    assert first.created and not first.conflict
    results = storage.enqueue(
        [
            NewTask(id="x", queue="q", handler="h", payload={"v": 2}),
            NewTask(id="x", queue="other", handler="h"),
            NewTask(id="y", queue="q", handler="h"),
            NewTask(id="y", queue="q", handler="h"),
        ]
    )
    assert [(r.created, r.conflict) for r in results] == [(False, False), (False, True), (True, False), (False, False)]
    assert results[0].task.payload == {"v": 1}
    assert results[1].task.queue == "q"
    assert storage.list_queues() == ["q"]


def test_enqueue_honours_run_at_and_delay(storage):
    now = storage.now()
    storage.enqueue(
        [
            NewTask(id="at", queue="q", handler="h", run_at=now + timedelta(hours=1)),
            NewTask(id="delayed", queue="q", handler="h", delay_seconds=60),
        ]
    )
    assert storage.get("at").next_attempt_at == now + timedelta(hours=1)
    assert 59 <= (storage.get("delayed").next_attempt_at - now).total_seconds() <= 70


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


def test_enqueue_of_a_value_jsonb_cannot_hold_is_invalid_input(storage):
    with pytest.raises(InvalidInput):
        storage.enqueue([NewTask(id="nul", queue="q", handler="h", payload={"s": "a\x00b"})])
    assert storage.get("nul") is None


def test_enqueue_rejects_foreign_connections(storage):
    with pytest.raises(TypeError):
        storage.enqueue(new_tasks(1), connection=object())


# -- operator side ------------------------------------------------------------------------------

def test_cancel(storage):
    storage.enqueue(new_tasks(2))
    assert storage.cancel("t00000").status is TaskStatus.CANCELLED
    with pytest.raises(TaskConflict):
        storage.cancel("t00000")
    with pytest.raises(TaskNotFound):
        storage.cancel("missing")


def test_dead_letter_paging_filters_redrive_and_purge(storage):
    storage.enqueue(new_tasks(7) + [NewTask(id="other", queue="q", handler="g")])
    claimed = storage.claim("q", 8, 60)
    # TypeA: t00000 t00002 t00004 t00006; TypeB: t00001 t00003 t00005 other
    error_types = {c.task.id: "TypeA" if c.task.id[-1] in "0246" else "TypeB" for c in claimed}
    storage.settle(
        [
            Settlement(
                c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                error=ErrorInfo(error_types[c.task.id]),
            )
            for c in claimed
        ]
    )
    seen, cursor = [], None
    while True:
        page = storage.list_dead("q", limit=3, cursor=cursor)
        seen.extend(page.tasks)
        # Tasks dying mid-paging must not disturb the walk.
        storage.enqueue([NewTask(id=f"late{len(seen)}", queue="q", handler="h")])
        for late in storage.claim("q", 1, 60):
            settle_one(storage, late, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo("Late"))
        cursor = page.next_cursor
        if cursor is None:
            break
    original = {c.task.id for c in claimed}
    seen_ids = [t.id for t in seen]
    assert len(seen_ids) == len(set(seen_ids))
    assert original <= set(seen_ids)
    assert [(t.dead_at, t.id) for t in seen] == sorted((t.dead_at, t.id) for t in seen)
    assert all(t.attempts for t in seen)

    with pytest.raises(InvalidCursor):
        storage.list_dead("elsewhere", limit=3, cursor=storage.list_dead("q", limit=1).next_cursor)

    by_type = storage.list_dead("q", limit=100, filter=DeadFilter(error_type="TypeA"))
    assert {t.last_error.type for t in by_type.tasks} == {"TypeA"} and len(by_type.tasks) == 4
    by_handler = storage.list_dead("q", limit=100, filter=DeadFilter(handler="g"))
    assert [t.id for t in by_handler.tasks] == ["other"]

    assert storage.redrive("q", DeadFilter(ids=("t00000", "t00001", "missing"))) == 2
    assert storage.redrive("q", DeadFilter(ids=())) == 0
    assert storage.purge_dead("q", DeadFilter(error_type="TypeB")) == 3  # t00001 was redriven
    assert storage.get("t00003") is None and storage.get("other") is None
    stats = storage.stats("q")
    assert stats.pending == 2


def test_stats_and_oldest_pending_age(storage):
    assert storage.stats("q").oldest_pending_age_seconds == 0
    storage.enqueue(new_tasks(3) + [NewTask(id="future", queue="q", handler="h", delay_seconds=600)])
    time.sleep(0.2)
    (c,) = storage.claim("q", 1, 60)
    settle_one(storage, c, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
    storage.cancel("t00001")
    stats = storage.stats("q")
    assert (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled) == (2, 0, 0, 1, 1)
    assert 0.2 <= stats.oldest_pending_age_seconds < 30


def test_purge_succeeded_is_bounded_and_cascades(storage, sql_conn):
    storage.enqueue(new_tasks(5))
    claimed = storage.claim("q", 5, 60)
    storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed])
    assert storage.purge_succeeded(3600, 10) == 0
    assert storage.purge_succeeded(0, 3) == 3
    assert storage.purge_succeeded(0, 10) == 2
    assert sql_conn.execute("SELECT count(*) FROM rdq_attempts").fetchone() == (0,)
    assert storage.list_queues() == []


# -- connection failures ------------------------------------------------------------------------

def test_unreachable_server_is_storage_unavailable():
    store = PostgresStorage("postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2")
    with pytest.raises(StorageUnavailable):
        store.stats("q")
    store.close()


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
        assert store._fetch_all("SHOW search_path")[0]["search_path"] == dict(parse_qsl(urlsplit(storage_url).query))["options"].split("=", 1)[1]
    finally:
        store.close()
    custom = url_with_search_path(storage_url, "public").replace("options=", "options=-c%20statement_timeout%3D2s%20", 1)
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
