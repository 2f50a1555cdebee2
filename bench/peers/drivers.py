"""Parent side of the peer runs: a fresh database / key prefix, bulk enqueue, W workers, timing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .. import servers
from ..common import child_env, stop_process, wait_for_count

CHUNK = 500  # same enqueue batch as rdq's largest (Limits.batch_items)
PEERS = {"pgqueuer": "postgres", "procrastinate": "postgres", "rq": "redis", "celery": "redis"}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("pgqueuer", "asyncpg", "procrastinate", "psycopg", "rq", "celery", "kombu", "redis"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


@contextmanager
def _target(peer: str) -> Iterator[tuple[str, str]]:
    """(connection target, queue name) for one run; removes only what it created."""
    if PEERS[peer] == "postgres":
        with servers.pg_database(tag=f"{peer}_") as url:
            yield url, "bench"
    else:
        prefix = servers.new_redis_prefix(f"rdqbench-{peer}")
        try:
            yield servers.REDIS_URL, prefix
        finally:
            servers.redis_delete_prefix(prefix)
            servers.redis_delete_prefix(f"rq:job:{prefix}")
            for pattern in (f"rq:*:{prefix}*", f"rq:*{prefix}*"):
                client = servers.redis_client()
                keys = list(client.scan_iter(match=pattern, count=5000))
                if keys:
                    client.unlink(*keys)
                client.srem("rq:queues", f"rq:queue:{prefix}")
                client.close()


# -- schema + bulk enqueue ----------------------------------------------------------------------

def _pgqueuer_enqueue(dsn: str, queue: str, n: int) -> float:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    async def go() -> float:
        conn = await asyncpg.connect(dsn)
        try:
            queries = Queries(AsyncpgDriver(conn))
            await queries.install()
            began = time.perf_counter()
            for start in range(0, n, CHUNK):
                k = min(CHUNK, n - start)
                await queries.enqueue([queue] * k, [None] * k, [0] * k)
            return time.perf_counter() - began
        finally:
            await conn.close()

    return asyncio.run(go())


def _procrastinate_enqueue(dsn: str, queue: str, n: int) -> float:
    os.environ["RDQ_BENCH_PROCRASTINATE_DSN"] = dsn
    os.environ["RDQ_BENCH_QUEUE"] = queue
    import importlib

    from . import procrastinate_app

    importlib.reload(procrastinate_app)
    app = procrastinate_app.app
    with app.open():
        app.schema_manager.apply_schema()
        began = time.perf_counter()
        for start in range(0, n, CHUNK):
            procrastinate_app.noop.batch_defer(*[{} for _ in range(min(CHUNK, n - start))])
        return time.perf_counter() - began


def _rq_enqueue(url: str, queue: str, n: int) -> float:
    from redis import Redis
    from rq import Queue

    connection = Redis.from_url(url)
    q = Queue(queue, connection=connection)
    began = time.perf_counter()
    for start in range(0, n, CHUNK):
        q.enqueue_many([
            Queue.prepare_data("bench.peers.jobs.noop", job_id=f"{queue}-{i}")
            for i in range(start, min(n, start + CHUNK))
        ])
    elapsed = time.perf_counter() - began
    connection.close()
    return elapsed


def _celery_enqueue(url: str, queue: str, n: int) -> float:
    from celery import group

    from .celery_app import make_app

    app = make_app(url, queue)
    task = app.tasks["noop"]
    began = time.perf_counter()
    for start in range(0, n, CHUNK):
        group(task.s() for _ in range(min(CHUNK, n - start))).apply_async()
    elapsed = time.perf_counter() - began
    app.close()
    return elapsed


_ENQUEUE = {"pgqueuer": _pgqueuer_enqueue, "procrastinate": _procrastinate_enqueue, "rq": _rq_enqueue, "celery": _celery_enqueue}


def peer_run(peer: str, n: int, workers: int, timeout: float = 600) -> dict[str, Any]:
    with _target(peer) as (target, queue), tempfile.TemporaryDirectory(prefix="rdq-bench-cnt-") as counters:
        enqueue_seconds = _ENQUEUE[peer](target, queue, n)
        env = child_env(
            RDQ_BENCH_COUNTER_DIR=counters, RDQ_BENCH_PROCRASTINATE_DSN=target, RDQ_BENCH_QUEUE=queue,
            RDQ_BENCH_CELERY_CONCURRENCY=str(workers),
        )
        # Celery: one worker with a prefork pool of W processes (its recommended deployment);
        # the others: W worker processes.
        processes = 1 if peer == "celery" else workers
        spawned = time.time()
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.peers.worker", peer, target, queue],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env, start_new_session=True,
            )
            for _ in range(processes)
        ]
        try:
            for proc in procs:
                line = proc.stdout.readline().strip()
                if line != "ready":
                    raise RuntimeError(f"{peer} worker did not start: {proc.stderr.read()[-2000:]}")
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            info = wait_for_count(counters, n, timeout, procs if peer != "rq" else ())
        finally:
            for proc in procs:
                stop_process(proc)
    window = info["last"] - info["first"]
    return {
        "peer": peer, "backend": PEERS[peer], "n": n, "workers": workers,
        "enqueue_tasks_per_s": n / enqueue_seconds,
        "process_tasks_per_s": n / window,
        "process_seconds": window,
        "process_with_startup_tasks_per_s": n / (info["last"] - spawned),
        "worker_peak_rss_mb": info["peak_rss_mb"],
    }
