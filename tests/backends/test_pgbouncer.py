"""PostgreSQL through PgBouncer in transaction mode (Debian's ``pgbouncer``, started by this
module on a loopback port and stopped by PID): the compliance kit and the chaos tests with every
worker, the reaper and the harness connecting through it, ``rdq dev`` (API, worker and reaper)
through it, migrations through it, and no prepared statement ever reaching a pooled server
connection.

Transaction mode hands each transaction a server connection of the pool's choosing: nothing of
a session survives between statements. rdq relies on none: every call is one autocommit
statement or one explicit transaction, migrations hold a transaction-scoped advisory lock
(``pg_advisory_xact_lock``), the pool turns server-side prepared statements off
(``prepare_threshold=None``), and the URL carries ``rdq_session_timeouts=off`` because pgbouncer
refuses the startup ``options`` the timeouts would travel in.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from rdq_core.compliance import StorageCompliance  # noqa: E402 - after importorskip
from rdq_testing.servers import SHARED_PG_URL, OwnedPgBouncer, pg_scratch_database  # noqa: E402 - see above
from rdq_core.model import NewTask, TaskStatus  # noqa: E402 - after importorskip
from rdq_core.storage import open_storage  # noqa: E402 - after importorskip
from rdq_core.storage.postgres import PostgresStorage  # noqa: E402 - after importorskip
from tests.backends import test_postgres  # noqa: E402 - after importorskip (the module, so its tests are not collected here)


@pytest.fixture(scope="module")
def bounced_database() -> Iterator[str]:
    """The module's scratch database (direct URL): each test's store is a schema in it."""
    with pg_scratch_database(SHARED_PG_URL, prefix="rdq_bounced_") as direct:
        yield direct


@pytest.fixture
def bounced_url(bouncer: OwnedPgBouncer, bounced_database: str) -> str:
    """A fresh, empty schema, reached through pgbouncer under a database name whose server
    connections select it (``search_path`` cannot travel in the startup options pgbouncer refuses)."""
    return bouncer.schema_url(bounced_database)


class TestPgBouncerCompliance(StorageCompliance):
    """The whole kit, every connection through pgbouncer in transaction mode: the budgets of a
    direct connection (the pooler adds no statement)."""

    capabilities = replace(
        test_postgres.TestPostgresCompliance.capabilities,
        unreachable_url="postgresql://postgres@127.0.0.1:{port}/nowhere?connect_timeout=2&rdq_session_timeouts=off",
    )

    @pytest.fixture
    def storage_url(self, bounced_url):
        yield bounced_url


def in_threads(work: Callable[[int], None], count: int) -> list[BaseException]:
    """Run ``work(i)`` for i in 0..count-1 on threads of their own; what they raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def test_concurrent_migrations_through_pgbouncer_apply_each_version_once(bounced_url):
    """The migration lock is transaction-scoped, so it holds in transaction mode (a session lock
    would be taken on one server connection and released on another, or never)."""
    stores = [PostgresStorage(bounced_url) for _ in range(6)]
    errors = in_threads(lambda i: stores[i].migrate(), len(stores))
    try:
        assert not errors, errors
        with psycopg.connect(bounced_url.split("?")[0], autocommit=True, prepare_threshold=None) as conn:
            versions = [row[0] for row in conn.execute("SELECT version FROM rdq_schema_version").fetchall()]
        assert versions and len(versions) == len(set(versions))
    finally:
        for store in stores:
            store.close()


def test_repeated_statements_never_prepare_on_a_pooled_server_connection(bouncer, bounced_url):
    """psycopg prepares a statement on the server after ``prepare_threshold`` (5) executions;
    in transaction mode the next execution may land on a server connection that never saw it
    (``prepared statement "_pg3_0" does not exist``). The pool turns preparing off: 200 calls of
    the same statements from 8 threads through the pooler succeed, and no server connection
    holds a prepared statement afterwards."""
    store = open_storage(bounced_url)
    store.migrate()
    store.enqueue([NewTask(id=f"p{i}", queue="q", handler="h", payload=None) for i in range(50)])

    def hammer(_: int) -> None:
        for _ in range(25):
            store.stats("q")
            store.get("p1")

    errors = in_threads(hammer, 8)
    try:
        assert not errors, errors[:3]
        # Every server connection pgbouncer holds for this database, asked in turn: none has a
        # prepared statement (pg_prepared_statements is per session).
        with psycopg.connect(bounced_url.split("?")[0], autocommit=True, prepare_threshold=None) as conn:
            for _ in range(bouncer.server_connections):
                assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 0
    finally:
        store.close()


def test_rdq_dev_api_worker_and_reaper_through_pgbouncer(bounced_url, tmp_path: Path):
    """The API, the worker and the reaper of ``rdq dev`` all reach PostgreSQL through pgbouncer."""
    from rdq_core.http_client import HttpClient
    from tests.rdq_servers import dev_server, status_of

    store = open_storage(bounced_url)
    store.migrate()
    store.close()
    with dev_server(tmp_path, storage_url=bounced_url) as dev:
        client = HttpClient(dev.url, retry_seconds=10)
        tasks = [client.enqueue("bounced", "greet", {"name": f"n{i}"}) for i in range(5)]
        for task in tasks:
            done = status_of(client, task.id, TaskStatus.SUCCEEDED)
            assert done.result["greeting"].startswith("hello, n")
        assert client.stats("bounced").succeeded == 5
