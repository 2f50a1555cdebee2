"""Suite-wide settings and the fixtures every test package shares.

Powertools reads its environment at import time, and any test package may be the first to
import the Lambda host, so the offline AWS settings live here, once.

Servers: every fixture below gets its server or its fresh store from
``rdq_testing.servers`` (the one place that starts, owns and stops them). A shared server
that does not answer fails the test under ``CI`` and skips it elsewhere.

A run stopped by SIGTERM or SIGHUP (``timeout``, a closed terminal) tears down as after Ctrl-C,
so every scratch database and owned server goes with it; the PostgreSQL scratch database of a run
killed outright is dropped by the next run (``sweep_stale_scratch_databases``).

The quick subset, ``python -m pytest -m "not slow"``, is ``tests/unit``: every other package (the
kit on four backends, chaos, faults, the serverless checks, the browser, the attacks) is ``slow``.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from rdq_testing import servers
from tests.loopback import rdq_settings
from tests.rdq_servers import scratch_database_prefix, sweep_stale_scratch_databases

for _name, _value in {
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "SAM_CLI_TELEMETRY": "0",
    "POWERTOOLS_TRACE_DISABLED": "1",
    "POWERTOOLS_METRICS_NAMESPACE": "rdq",
    "POWERTOOLS_SERVICE_NAME": "rdq",
    "POWERTOOLS_LOG_LEVEL": "WARNING",
}.items():
    os.environ[_name] = _value


TESTS = Path(__file__).resolve().parent
#: The packages of the quick subset; everything else is marked ``slow``.
QUICK_PACKAGES = frozenset({"unit"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            package = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (a plugin's own)
            continue
        if package not in QUICK_PACKAGES:
            item.add_marker(pytest.mark.slow)


def _stop_as_if_interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP end the run the way Ctrl-C does: pytest then runs every teardown."""
    if threading.current_thread() is not threading.main_thread():
        return
    for stop in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(stop) is signal.SIG_DFL:
            signal.signal(stop, _stop_as_if_interrupted)


@pytest.fixture
def no_rdq_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the host's ``RDQ_*`` settings from the caller's environment leaks into a test."""
    for name in rdq_settings(os.environ):
        monkeypatch.delenv(name, raising=False)


# -- PostgreSQL: a scratch database per session, a fresh schema per test ------------------------

@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    pytest.importorskip("psycopg")
    problem = servers.pg_reachable(servers.SHARED_PG_URL)
    if problem:
        servers.fail_or_skip(problem)
    swept = sweep_stale_scratch_databases(servers.SHARED_PG_URL)
    if swept:
        print(f"\ndropped {len(swept)} scratch database(s) of test runs that were killed: {', '.join(swept)}")
    with servers.pg_scratch_database(servers.SHARED_PG_URL, prefix=scratch_database_prefix()) as url:
        yield url


@pytest.fixture
def fresh_pg_url(pg_database_url: str) -> str:
    """A fresh, empty, not yet migrated store: a schema of its own, selected by the URL."""
    return servers.pg_fresh_schema(pg_database_url)


# -- Redis: the shared server, a key prefix of its own per test ---------------------------------

@pytest.fixture(scope="session")
def redis_server_url() -> str:
    pytest.importorskip("redis")
    problem = servers.redis_reachable(servers.SHARED_REDIS_URL)
    if problem:
        servers.fail_or_skip(problem)
    return servers.SHARED_REDIS_URL


@pytest.fixture(scope="session")
def redis_client(redis_server_url: str):
    """A plain client on the shared server, for looking under the hood (never for flushing)."""
    import redis

    client = redis.Redis.from_url(redis_server_url, decode_responses=True, socket_connect_timeout=5)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_server_url: str) -> Iterator[str]:
    """A key prefix of our own; exactly its keys are deleted afterwards (never a FLUSH)."""
    with servers.redis_fresh_prefix(redis_server_url) as prefix:
        yield prefix


@pytest.fixture
def fresh_redis_url(redis_server_url: str, redis_prefix: str) -> str:
    return servers.redis_url_with_prefix(redis_server_url, redis_prefix)


# -- MongoDB: nx-27017 started for the session (or RDQ_TEST_MONGO_URL), a database per test -------

@pytest.fixture(scope="session")
def mongo_server_url() -> Iterator[str]:
    pytest.importorskip("pymongo")
    if servers.CONFIGURED_MONGO_URL:
        if not servers.mongo_answers(servers.CONFIGURED_MONGO_URL, timeout_ms=5000):
            servers.fail_or_skip(f"RDQ_TEST_MONGO_URL={servers.CONFIGURED_MONGO_URL} does not answer")
        yield servers.CONFIGURED_MONGO_URL
        return
    try:
        with servers.nx_27017() as server:
            yield server.url
    except servers.ServerStartError as exc:
        servers.fail_or_skip(str(exc))


@pytest.fixture
def fresh_mongo_url(mongo_server_url: str) -> Iterator[str]:
    """A URL naming a database no one has used; dropped after the test."""
    with servers.mongo_fresh_database(mongo_server_url) as url:
        yield url


# -- any backend ---------------------------------------------------------------------------------

STORE_KINDS = ("sqlite", "postgresql", "redis", "mongodb")


@pytest.fixture
def fresh_store_url(request: pytest.FixtureRequest, tmp_path) -> Callable[[str], str]:
    """``fresh_store_url(kind)``: the URL of a fresh, empty store of that kind (not migrated); one
    per kind per test, except SQLite (a new file each call)."""
    made = iter(range(1_000_000))

    def make(kind: str) -> str:
        if kind == "sqlite":
            return f"sqlite:///{tmp_path}/store-{next(made)}.db"
        if kind == "postgresql":
            return request.getfixturevalue("fresh_pg_url")
        if kind == "redis":
            return request.getfixturevalue("fresh_redis_url")
        if kind == "mongodb":
            return request.getfixturevalue("fresh_mongo_url")
        raise ValueError(f"unknown store kind {kind!r}; known: {STORE_KINDS}")

    return make
