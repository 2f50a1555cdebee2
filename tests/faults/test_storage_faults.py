"""Storage faults mid-flight, against real servers, with the real ``Worker`` and reaper.

* the worker's connections are killed between claim and settle (PostgreSQL
  ``pg_terminate_backend``, Redis ``CLIENT KILL``) -- on the shared servers, selecting only the
  connections this test tagged (``application_name`` / ``CLIENT SETNAME``);
* a settle statement is killed while it runs (PostgreSQL);
* the server crashes and restarts during a drain, and refuses connections for a while -- on a
  second instance the test owns (PostgreSQL, Redis, the MongoDB wire server).

After each: no task lost, none settled twice, gap-free attempt numbers, nothing stuck past one
lease, the worker backed off (bounded reconnect attempts) and logged one line per incident.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import pytest

from rdq_testing.servers import SHARED_REDIS_URL, pg_scratch_database
from rdq_core.compliance.support import wait_until
from rdq_core.storage import open_storage

from .harness import Executions, RunningHost, audit, enqueue_work, incident_lines, wait_for_drain, with_query

LEASE = 2.0


@pytest.fixture
def queue() -> str:
    """A queue of its own per test: nx-27017 keeps every logical database of a file in one store."""
    return f"faults-{secrets.token_hex(4)}"


@pytest.fixture(autouse=True)
def capture_rdq_logs(caplog):
    caplog.set_level(logging.INFO)
    yield caplog


def outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "rdq.worker" and r.levelno >= logging.ERROR and "storage unavailable" in r.getMessage()]


def recovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rdq.worker" and "reachable again" in r.getMessage()]


# -- 1a. connections killed between claim and settle (shared servers, tagged connections) --------

@dataclass
class TaggedStore:
    worker_url: str
    reaper_url: str
    kill_worker_connections: Callable[[], int]
    #: Lines the backend logs when it finds its idle connections killed: the PostgreSQL pool
    #: says so once; redis-py reconnects inside its own pool without telling rdq (see the docs).
    idle_kill_lines: int


def _pg_tagged(database_url: str) -> TaggedStore:
    import psycopg

    tag = f"rdq-fault-worker-{secrets.token_hex(4)}"

    def kill() -> int:
        with psycopg.connect(database_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()", (tag,)).fetchone()[0]
            wait_until(lambda: admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (tag,)).fetchone()[0] == 0,
                timeout=10, what="the killed backends to exit")
        return killed

    return TaggedStore(with_query(database_url, application_name=tag),
                       with_query(database_url, application_name="rdq-fault-reaper"), kill, 1)


def _redis_tagged(base_url: str, prefix: str) -> TaggedStore:
    import redis

    tag = f"rdq-fault-worker-{secrets.token_hex(4)}"

    def kill() -> int:
        admin = redis.Redis.from_url(base_url)
        try:
            ids = [c["id"] for c in admin.client_list() if c.get("name") == tag]
            for client_id in ids:
                admin.client_kill_filter(_id=client_id)
            return len(ids)
        finally:
            admin.close()

    return TaggedStore(with_query(base_url, prefix=prefix, client_name=tag),
                       with_query(base_url, prefix=prefix, client_name="rdq-fault-reaper"), kill, 0)


@pytest.fixture(params=["postgres", "redis"])
def tagged_store(request):
    if request.param == "postgres":
        return _pg_tagged(request.getfixturevalue("shared_pg_database"))
    return _redis_tagged(SHARED_REDIS_URL, request.getfixturevalue("shared_redis_prefix"))


def test_worker_connections_killed_between_claim_and_settle(tagged_store, queue, caplog):
    executions = Executions()
    with open_storage(tagged_store.reaper_url) as store:
        store.migrate()
        ids = enqueue_work(store, queue, 12, sleep=0.01, gated=1)
        with RunningHost(tagged_store.worker_url, tagged_store.reaper_url, queue, executions, lease_seconds=LEASE):
            assert executions.entered_gate.wait(15), "the worker never claimed the gated task"
            # The batch is claimed and its first handler is running: kill every connection of
            # this worker (and only of this worker) before anything is settled.
            assert tagged_store.kill_worker_connections() >= 1
            executions.gate.set()
            wait_for_drain(store, queue, 12, timeout=LEASE + 15, what="the drain after the kill")
        outcomes = audit(store, ids, executions)
    assert outcomes.get("LEASE_EXPIRED", 0) == 0, "a killed idle connection must not cost a lease"
    assert outage_lines(caplog) == [], "nothing failed, so the worker must not report an outage"
    # The idle connections' notices, and at most one retried write: the previous batch's settle,
    # written behind the claim (settle behind), may have been on a killed connection.
    lines = incident_lines(caplog.records)
    retried = [line for line in lines if "succeeded on attempt" in line]
    assert len(retried) <= 1, lines
    assert len(lines) - len(retried) == tagged_store.idle_kill_lines, lines


def test_settle_killed_while_in_flight_is_retried_on_a_new_connection(shared_pg_database, queue, caplog):
    """PostgreSQL: the settle statement itself dies (its backend is terminated while it waits
    on a row lock the test holds). The runner retries on a fresh connection; exactly one
    SUCCESS, and one outage line plus one recovery line."""
    import psycopg

    store_urls = _pg_tagged(shared_pg_database)
    executions = Executions()
    with open_storage(store_urls.reaper_url) as store, psycopg.connect(shared_pg_database) as locker:
        store.migrate()
        ids = enqueue_work(store, queue, 3, gated=1)
        tag = dict(p.split("=") for p in store_urls.worker_url.split("?")[1].split("&"))["application_name"]
        with RunningHost(store_urls.worker_url, store_urls.reaper_url, queue, executions,
                         lease_seconds=LEASE, batch_size=1):
            assert executions.entered_gate.wait(15)
            locker.execute("SELECT 1 FROM rdq_tasks WHERE id = %s FOR UPDATE", (ids[0],))  # opens a transaction
            executions.gate.set()
            with psycopg.connect(shared_pg_database, autocommit=True) as admin:
                # Only the settle (its statement opens with the decision CTE): the heartbeat's lease renewal may be
                # waiting on the same row lock, and killing it instead would test nothing.
                waiting = wait_until(lambda: admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'"
                    " AND query LIKE '%%WITH decision AS%%'",
                    (tag,)).fetchall(), timeout=10, what="the worker's settle to wait on the row lock")
                for (pid,) in waiting:
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            locker.rollback()
            wait_for_drain(store, queue, 3, timeout=LEASE + 15, what="the drain after the killed settle")
        outcomes = audit(store, ids, executions)
    assert outcomes == {"SUCCESS": 3}, "the retried settle must keep the outcome, not re-run the task"
    assert len(outage_lines(caplog)) <= 1
    assert any("succeeded on attempt" in r.getMessage() for r in caplog.records if r.name == "rdq.runner")


# -- 1b/1c. the server crashes / refuses connections (instances the test owns) ------------------

@dataclass
class OwnedStore:
    url: str
    crash: Callable[[], None]
    stop: Callable[[], None]
    start: Callable[[], None]


@pytest.fixture(params=["postgres", "redis", "mongo"])
def owned_store(request):
    if request.param == "postgres":
        server = request.getfixturevalue("owned_postgres")
        with pg_scratch_database(server.url, prefix="rdq_fault_") as url:
            yield OwnedStore(url, lambda: server.stop("immediate"), lambda: server.stop("fast"), server.start)
    elif request.param == "redis":
        server = request.getfixturevalue("owned_redis")
        yield OwnedStore(with_query(server.url, prefix=f"f{secrets.token_hex(4)}"), server.crash, server.stop, server.start)
    else:
        server = request.getfixturevalue("owned_mongo")
        # pymongo waits serverSelectionTimeoutMS (rdq's default 10 s) before reporting an outage.
        url = f"mongodb://127.0.0.1:{server.port}/f{secrets.token_hex(4)}?serverSelectionTimeoutMS=1000&connectTimeoutMS=1000"
        yield OwnedStore(url, server.crash, server.stop, server.start)


TASKS = 40


def _start_drain(store_urls: OwnedStore, queue: str):
    store = open_storage(store_urls.url)
    store.migrate()
    ids = enqueue_work(store, queue, TASKS, sleep=0.02)
    return store, ids


def test_server_crashes_and_restarts_during_a_drain(owned_store, queue, caplog):
    executions = Executions()
    store, ids = _start_drain(owned_store, queue)
    try:
        with RunningHost(owned_store.url, owned_store.url, queue, executions, lease_seconds=LEASE) as host:
            wait_until(lambda: sum(map(len, executions.by_task.values())) >= 8, timeout=15, what="the drain to start")
            owned_store.crash()
            owned_store.start()
            wait_for_drain(store, queue, TASKS, timeout=LEASE + 20, what="the drain after the restart")
            attempts = host.reconnect_attempts
        outcomes = audit(store, ids, executions)
    finally:
        store.close()
    # A crash may cost the batches in flight one lease each, never more than three batches' worth
    # (batch size 4: one settling behind, one running, and -- these tasks are quick -- the next
    # one claimed ahead).
    assert outcomes.get("LEASE_EXPIRED", 0) <= 12, outcomes
    assert attempts <= 6, f"{attempts} reconnect attempts for one restart: the worker is spinning"
    assert len(outage_lines(caplog)) <= 1, outage_lines(caplog)
    assert len(recovery_lines(caplog)) == len(outage_lines(caplog))
    # Start and end of the outage, a dropped-connections notice, and the settle written behind
    # the claim (settle behind) saying it got through on a retry; one more for the batch claimed
    # ahead, whose release or settle may need a retry too.
    assert len(incident_lines(caplog.records)) <= 5, incident_lines(caplog.records)


def test_connections_refused_for_a_while(owned_store, queue, caplog):
    executions = Executions()
    store, ids = _start_drain(owned_store, queue)
    try:
        with RunningHost(owned_store.url, owned_store.url, queue, executions, lease_seconds=LEASE) as host:
            wait_until(lambda: sum(map(len, executions.by_task.values())) >= 8, timeout=15, what="the drain to start")
            owned_store.stop()
            refused_at = time.monotonic()
            # Keep the door shut until the worker has tried three times (0.5 s, then 1 s backoff).
            wait_until(lambda: host.reconnect_attempts >= 3, timeout=20, what="three reconnect attempts")
            refused_for = time.monotonic() - refused_at
            attempts_while_down = host.reconnect_attempts
            owned_store.start()
            wait_for_drain(store, queue, TASKS, timeout=LEASE + 20, what="the drain after the outage")
        outcomes = audit(store, ids, executions)
    finally:
        store.close()
    assert refused_for >= 1.0, f"3 reconnect attempts in {refused_for:.2f}s: the worker does not back off"
    assert attempts_while_down <= 4
    assert outcomes.get("LEASE_EXPIRED", 0) <= 12, outcomes  # three batches' worth, as above
    assert len(outage_lines(caplog)) == 1, outage_lines(caplog)
    assert len(recovery_lines(caplog)) == 1
    # Start and end of the outage, at most one dropped-connections notice, and at most one
    # "could not settle" per batch whose outcomes the outage outlasted: three batches can be held
    # (one settling behind while the next one runs and, quick tasks, the one after claimed ahead).
    lines = incident_lines(caplog.records)
    assert sum("dropped" in line for line in lines) <= 1, lines
    assert sum("could not settle" in line for line in lines) <= 3, lines
    assert len(lines) <= 6, lines
