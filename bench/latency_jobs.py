"""The probe handler of the latency runs (``bench/latency.py``), loaded by ``rdq worker`` and
``rdq dev`` with ``--handlers bench.latency_jobs``.

Each attempt appends one line ``key attempt start end`` (wall-clock seconds) to
``$RDQ_BENCH_LATENCY_FILE``. A payload with ``"fail": true`` raises on its first attempt, so
the task is retried (the 1 % failures of the steady mixed load).
"""

from __future__ import annotations

import os
import threading
import time

from rdq_core import handler

_lock = threading.Lock()
_out = None


def _record(line: str) -> None:
    global _out
    with _lock:
        if _out is None:
            _out = open(os.environ["RDQ_BENCH_LATENCY_FILE"], "a", buffering=1, encoding="utf-8")  # kept open for the process
        _out.write(line)


@handler("probe", timeout_seconds=10)
def probe(payload, ctx):
    began = time.time()
    failing = bool(payload.get("fail")) and ctx.attempt == 1
    _record(f"{payload['key']} {ctx.attempt} {began:.6f} {time.time():.6f}\n")
    if failing:
        raise RuntimeError("the steady load's planned failure (retried)")
    return None


def _run_pgqueuer(dsn: str, queue: str) -> None:
    """PgQueuer's own worker (its defaults: LISTEN/NOTIFY, batch 10) running the same probe."""
    import asyncio
    import json

    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
        pgq = PgQueuer(AsyncpgDriver(conn))

        @pgq.entrypoint(queue)
        async def job(job) -> None:
            began = time.time()
            _record(f"{json.loads(job.payload)['key']} 1 {began:.6f} {time.time():.6f}\n")

        await pgq.run()

    asyncio.run(main())


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["pgqueuer"]:
        _run_pgqueuer(sys.argv[2], sys.argv[3])
