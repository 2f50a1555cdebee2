"""Servers the backend tests own beyond the shared ones of ``tests/conftest.py``."""

from __future__ import annotations

from typing import Iterator

import pytest

from rdq_testing import servers

#: Server connections the owned pgbouncer may open per database (its pool).
PGBOUNCER_SERVER_CONNECTIONS = 20


@pytest.fixture(scope="module")
def bouncer() -> Iterator[servers.OwnedPgBouncer]:
    """A transaction-mode pgbouncer in front of the shared PostgreSQL, for one test module."""
    pytest.importorskip("psycopg")
    problem = servers.pg_reachable(servers.SHARED_PG_URL)
    if problem:
        servers.fail_or_skip(problem)
    try:
        owned = servers.pgbouncer(server_connections=PGBOUNCER_SERVER_CONNECTIONS)
        with owned as started:
            yield started
    except servers.ServerStartError as exc:
        servers.fail_or_skip(f"could not start pgbouncer: {exc}")
