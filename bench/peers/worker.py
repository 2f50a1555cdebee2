"""A peer worker process: ``python -m bench.peers.worker PEER TARGET QUEUE``.

Prepares (imports, connects), prints ``ready``, waits for ``go`` on stdin, then runs the peer's
own worker loop with its default settings until the harness stops it (SIGTERM by PID).
``RDQ_BENCH_COUNTER_DIR`` names the directory the no-op job writes its timings to.
"""

from __future__ import annotations

import asyncio
import sys


def barrier() -> bool:
    print("ready", flush=True)
    return sys.stdin.readline().strip() == "go"


def run_pgqueuer(dsn: str, queue: str) -> None:
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver

    from .jobs import noop

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
        pgq = PgQueuer(AsyncpgDriver(conn))

        @pgq.entrypoint(queue)
        async def job(job) -> None:  # PgQueuer entrypoints are async callables taking a Job
            noop()

        if not await asyncio.get_running_loop().run_in_executor(None, barrier):
            return
        await pgq.run()  # defaults: batch_size=10, continuous mode, LISTEN/NOTIFY

    asyncio.run(main())


def run_procrastinate(dsn: str, queue: str) -> None:
    from .procrastinate_app import app

    app.open()
    if not barrier():
        return
    # Defaults: concurrency 1, LISTEN/NOTIFY, jobs kept after success.
    app.run_worker(queues=[queue], install_signal_handlers=True)


def run_rq(url: str, queue: str) -> None:
    import os

    from redis import Redis
    from rq import Queue, SimpleWorker

    connection = Redis.from_url(url)
    q = Queue(queue, connection=connection)
    worker = SimpleWorker([q], connection=connection, name=f"{queue}-{os.getpid()}")
    if not barrier():
        return
    worker.work(burst=True, logging_level="WARNING")


def run_celery(url: str, queue: str) -> None:
    import os

    from .celery_app import make_app

    app = make_app(url, queue)
    concurrency = os.environ.get("RDQ_BENCH_CELERY_CONCURRENCY", "1")
    if not barrier():
        return
    app.worker_main([
        "worker", "--loglevel=WARNING", "-Q", queue, "--pool=prefork", f"--concurrency={concurrency}",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{queue}@%h",
    ])


def main() -> None:
    peer, target, queue = sys.argv[1:4]
    {"pgqueuer": run_pgqueuer, "procrastinate": run_procrastinate, "rq": run_rq, "celery": run_celery}[peer](target, queue)


if __name__ == "__main__":
    main()
