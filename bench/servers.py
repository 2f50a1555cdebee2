"""The servers the benchmarks use, each scoped so cleanup touches only what we created.

* PostgreSQL: a database ``rdq_bench_<random>`` created here and dropped here (only that one).
* Redis: keys under our own prefix, deleted with SCAN + UNLINK (never FLUSHALL).
* MongoDB wire: an ``nx-27017 --db memory`` process on a free loopback port, stopped by PID.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

from .common import free_port, stop_process

PG_ADMIN_URL = os.environ.get("RDQ_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("RDQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def pg_url(database: str) -> str:
    return urlunsplit(urlsplit(PG_ADMIN_URL)._replace(path=f"/{database}"))


@contextmanager
def pg_database(tag: str = "") -> Iterator[str]:
    import psycopg
    from psycopg import sql

    name = f"rdq_bench_{tag}{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_url(name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def redis_client():
    import redis

    return redis.Redis.from_url(REDIS_URL)


def new_redis_prefix(tag: str = "rdqbench") -> str:
    return f"{tag}-{secrets.token_hex(4)}"


def redis_delete_prefix(prefix: str) -> int:
    """Delete every key starting with ``prefix`` (SCAN + UNLINK; never FLUSHALL)."""
    client = redis_client()
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            deleted += client.unlink(*batch)
            batch = []
    if batch:
        deleted += client.unlink(*batch)
    client.close()
    return deleted


def redis_storage_url(prefix: str) -> str:
    sep = "&" if "?" in REDIS_URL else "?"
    return f"{REDIS_URL}{sep}prefix={prefix}"


@contextmanager
def mongo_server() -> Iterator[str]:
    """Start ``nx-27017`` (in-memory) on a free loopback port; stop it by PID afterwards."""
    exe = shutil.which("nx-27017")
    if exe is None:
        raise RuntimeError("nx-27017 is not installed (pip install nx-27017)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--host", "127.0.0.1", "-p", str(port), "--db", "memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        import pymongo

        deadline = time.monotonic() + 20
        while True:
            try:
                client = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}", serverSelectionTimeoutMS=300)
                client.admin.command("ping")
                client.close()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("nx-27017 did not start")
                time.sleep(0.1)
        yield f"mongodb://127.0.0.1:{port}"
    finally:
        stop_process(proc)
