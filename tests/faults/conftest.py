"""Fixtures for the fault suite: servers the tests own (crashed and restarted by them), scratch
stores on the shared servers, and the rule that a missing server fails under CI and skips
elsewhere. Every server comes from ``rdq_testing.servers``."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Iterator

import pytest

from rdq_testing import servers


def _owned(factory: Callable[[], object], needs: str) -> Iterator:
    if not shutil.which(needs) and not os.path.exists(needs):
        servers.fail_or_skip(f"{needs} is not installed; the fault suite needs it to own a server")
    server = None
    try:
        server = factory()
        server.start()
    except Exception as exc:  # noqa: BLE001 - reported as the failure or skip reason
        if server is not None:
            server.destroy()
        servers.fail_or_skip(f"could not start an owned {getattr(factory, '__name__', factory)}: {exc}")
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def owned_postgres():
    pytest.importorskip("psycopg")
    yield from _owned(servers.OwnedPostgres, str(servers.PG_BIN / "initdb"))


@pytest.fixture(scope="session")
def owned_redis():
    pytest.importorskip("redis")
    yield from _owned(servers.OwnedRedis, "redis-server")


@pytest.fixture(scope="session")
def owned_mongo():
    """nx-27017 over a file, so what it holds survives the restarts the tests make."""
    pytest.importorskip("pymongo")

    def durable_nx_27017() -> servers.OwnedNx27017:
        return servers.OwnedNx27017(durable=True, prefix="rdq-fault-mongo-")

    yield from _owned(durable_nx_27017, "nx-27017")


@pytest.fixture
def shared_pg_database() -> Iterator[str]:
    """A scratch database on the shared PostgreSQL, dropped afterwards (only the one we made)."""
    pytest.importorskip("psycopg")
    problem = servers.pg_reachable(servers.SHARED_PG_URL)
    if problem:
        servers.fail_or_skip(problem)
    with servers.pg_scratch_database(servers.SHARED_PG_URL, prefix="rdq_fault_") as url:
        yield url


@pytest.fixture
def shared_redis_prefix(redis_server_url: str) -> Iterator[str]:
    """A key prefix of our own on the shared Redis; exactly its keys are deleted afterwards."""
    with servers.redis_fresh_prefix(redis_server_url, tag="rdq-fault") as prefix:
        yield prefix


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
