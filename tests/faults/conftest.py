"""Fixtures for the fault suite: servers the tests own, scratch stores on the shared servers,
and the rule that a missing server fails under CI and skips elsewhere."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import uuid

import pytest

from .servers import PG_BIN, OwnedMongoWire, OwnedPostgres, OwnedRedis

SHARED_PG_URL = os.environ.get("RDQ_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SHARED_REDIS_URL = os.environ.get("RDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def fail_or_skip(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _owned(factory, needs: str):
    if not shutil.which(needs) and not os.path.exists(needs):
        fail_or_skip(f"{needs} is not installed; the fault suite needs it to own a server")
    server = factory()
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001
        server.destroy()
        fail_or_skip(f"could not start an owned {factory.__name__}: {exc}")
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def owned_postgres():
    pytest.importorskip("psycopg")
    yield from _owned(OwnedPostgres, str(PG_BIN / "initdb"))


@pytest.fixture(scope="session")
def owned_redis():
    pytest.importorskip("redis")
    yield from _owned(OwnedRedis, "redis-server")


@pytest.fixture(scope="session")
def owned_mongo():
    pytest.importorskip("pymongo")
    yield from _owned(OwnedMongoWire, "nx-27017")


def fresh_pg_database(server_url: str) -> tuple[str, callable]:
    """A new database on ``server_url``; returns its URL and a function that drops it."""
    import psycopg
    from psycopg import sql

    name = f"rdq_fault_{secrets.token_hex(5)}"
    try:
        with psycopg.connect(server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.OperationalError as exc:
        fail_or_skip(f"PostgreSQL is not reachable at {server_url}: {exc}")
    url = server_url.rsplit("/", 1)[0] + f"/{name}"

    def drop() -> None:
        with psycopg.connect(server_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    return url, drop


@pytest.fixture
def shared_pg_database():
    """A scratch database on the shared PostgreSQL, dropped afterwards (only the one we made)."""
    pytest.importorskip("psycopg")
    url, drop = fresh_pg_database(SHARED_PG_URL)
    yield url
    drop()


@pytest.fixture
def shared_redis_prefix():
    """A key prefix of our own on the shared Redis; exactly its keys are deleted afterwards."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(SHARED_REDIS_URL, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        fail_or_skip(f"Redis is not reachable at {SHARED_REDIS_URL}: {exc}")
    prefix = f"rdq-fault-{uuid.uuid4().hex}"
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])
    client.close()


@pytest.fixture(autouse=True)
def rdq_logs_reach_caplog():
    """These tests read the engine's incident lines through caplog. Importing the Lambda host
    (other test packages do) points the ``rdq`` loggers at Powertools' stdout handler, without
    propagation and at the Powertools level; undo that for the duration of each test."""
    rdq_logger = logging.getLogger("rdq")
    saved = (rdq_logger.handlers[:], rdq_logger.propagate, rdq_logger.level)
    rdq_logger.handlers, rdq_logger.propagate, rdq_logger.level = [], True, logging.NOTSET
    yield
    rdq_logger.handlers, rdq_logger.propagate, rdq_logger.level = saved
