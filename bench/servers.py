"""The servers the benchmarks use, each scoped so cleanup touches only what we created.

* PostgreSQL: a database ``rdq_bench_<random>`` created here and dropped here (only that one).
* Redis: keys under our own prefix, deleted with SCAN + UNLINK (never FLUSHALL).
* MongoDB wire: an ``nx-27017 --db memory`` process on a free loopback port, with its own pid
  file and log in a temporary directory, verified to be the server answering on that port (its
  ``serverStatus`` PID is the child we started), stopped by PID.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
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


def _mongo_served_pid(port: int) -> int | None:
    """The PID the server answering on ``port`` reports, or None if nothing answers."""
    import pymongo

    client = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}", serverSelectionTimeoutMS=300, connectTimeoutMS=300)
    try:
        return int(client.admin.command("serverStatus")["pid"])
    except Exception:  # noqa: BLE001 - not (yet) answering, or not a server that says its PID
        return None
    finally:
        client.close()


@contextmanager
def mongo_server(attempts: int = 3) -> Iterator[str]:
    """Start ``nx-27017`` (in-memory) on a free loopback port; stop it by PID afterwards.

    Its own ``--pid-file``: without one nx-27017 uses a fixed default path and refuses to start
    while that names a live process (any other nx-27017 on the machine). The port was free when
    chosen but can be taken before the server binds it, so the server answering must report our
    child's PID; if it does not, ours is stopped and another port tried.
    """
    exe = shutil.which("nx-27017")
    if exe is None:
        raise RuntimeError("nx-27017 is not installed (pip install nx-27017)")
    workdir = Path(tempfile.mkdtemp(prefix="rdq-bench-nx27017-"))
    problems: list[str] = []
    try:
        for _ in range(attempts):
            port = free_port()
            log_path = workdir / f"nx-{port}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    [exe, "--host", "127.0.0.1", "-p", str(port), "--db", "memory",
                     "--pid-file", str(workdir / f"nx-{port}.pid"), "--log-file", str(log_path)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
                    start_new_session=True,
                )
            deadline = time.monotonic() + 20
            try:
                while (pid := _mongo_served_pid(port)) is None and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if pid == proc.pid:
                    yield f"mongodb://127.0.0.1:{port}"
                    return
                if pid is not None:
                    problems.append(f"port {port} is served by PID {pid}, not by the nx-27017 we started (PID {proc.pid})")
                else:
                    problems.append(f"nx-27017 did not start on port {port}: {log_path.read_text(errors='replace')[-1000:]}")
            finally:
                stop_process(proc)
        raise RuntimeError("; ".join(problems))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
