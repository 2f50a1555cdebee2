"""The servers the benchmarks use, from the same provisioning module as the tests
(``rdq_testing.servers``), each scoped so cleanup touches only what we created.

* PostgreSQL: a database ``rdq_bench_<random>`` created here and dropped here (only that one).
* Redis: keys under our own prefix, deleted with SCAN + UNLINK (never FLUSHALL).
* MongoDB wire: an ``nx-27017 --db memory`` process on a free loopback port, verified to be the
  server answering there, stopped by PID.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from typing import Iterator

from rdq_testing import servers

PG_ADMIN_URL = os.environ.get("RDQ_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("RDQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def pg_url(database: str) -> str:
    return servers.pg_url_with_database(PG_ADMIN_URL, database)


@contextmanager
def pg_database(tag: str = "") -> Iterator[str]:
    with servers.pg_scratch_database(PG_ADMIN_URL, prefix=f"rdq_bench_{tag}") as url:
        yield url


def redis_client():
    import redis

    return redis.Redis.from_url(REDIS_URL)


def new_redis_prefix(tag: str = "rdqbench") -> str:
    return f"{tag}-{secrets.token_hex(4)}"


def redis_delete_prefix(prefix: str) -> int:
    """Delete every key starting with ``prefix`` (SCAN + UNLINK; never FLUSHALL); peers' keys
    need not have a colon after it."""
    return servers.redis_delete_prefix(REDIS_URL, prefix, match=f"{prefix}*")


def redis_storage_url(prefix: str) -> str:
    return servers.redis_url_with_prefix(REDIS_URL, prefix)


@contextmanager
def mongo_server() -> Iterator[str]:
    """nx-27017 (in memory) on a free loopback port, in a process group of its own (a Ctrl-C to
    the harness does not stop it before the harness's cleanup); stopped by PID on exit."""
    try:
        with servers.nx_27017(new_session=True) as server:
            yield server.url.rstrip("/")
    except servers.ServerStartError as exc:
        raise RuntimeError(str(exc)) from exc
