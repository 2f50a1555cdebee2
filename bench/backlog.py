"""Cost against backlog: claim latency and reaper throughput with a large pending backlog.

The backlog is bulk-loaded straight into the store's own layout (PostgreSQL: one
``INSERT … SELECT generate_series`` statement; Redis: pipelined HSET/ZADD in chunks), never
through the API, so a 1 M backlog loads in seconds. Claims are then made through the real
backend (batch 100, settled SUCCEEDED after each claim, as a worker would), and the reaper is
the real ``reap_expired_leases`` over the expired leases loaded next to the backlog.
"""

from __future__ import annotations

import time
from typing import Any

from rdq_core.errors import StaleClaim
from rdq_core.model import Outcome, Settlement, TaskStatus
from rdq_core.engine.reaper import reap_expired_leases
from rdq_core.storage import open_storage

from .common import percentile

QUEUE = "backlog"


def _pg_load(url: str, pending: int, expired: int) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO rdq_tasks (id, queue, handler, payload, status, next_attempt_at, created_at, updated_at)
            SELECT 'p' || lpad(g::text, 9, '0'), %(queue)s, 'noop', jsonb_build_object('n', g), 'PENDING',
                   now() - interval '1 hour' + g * interval '1 microsecond', now(), now()
            FROM generate_series(1, %(n)s) AS g
            """,
            {"queue": QUEUE, "n": pending},
        )
        if expired:
            conn.execute(
                """
                INSERT INTO rdq_tasks (id, queue, handler, payload, status, next_attempt_at, claim_token,
                                       claimed_at, lease_expires_at, created_at, updated_at)
                SELECT 'x' || lpad(g::text, 9, '0'), %(queue)s, 'noop', '{}'::jsonb, 'IN_FLIGHT',
                       now() - interval '2 hours', 'tok-' || g, now() - interval '10 minutes',
                       now() - interval '5 minutes' + g * interval '1 microsecond', now(), now()
                FROM generate_series(1, %(n)s) AS g
                """,
                {"queue": QUEUE, "n": expired},
            )
        conn.execute("VACUUM ANALYZE rdq_tasks")


def _redis_load(url: str, pending: int, expired: int, chunk: int = 5000) -> None:
    import redis

    from rdq_core.storage.redis import RedisStorage

    store = RedisStorage(url)
    prefix = store.prefix
    store.close()
    client = redis.Redis.from_url(url.split("?")[0])
    base = f"{prefix}:{{{QUEUE}}}:"
    ids_key = f"{prefix}:{{{prefix}:global}}:ids"
    queues_key = f"{prefix}:{{{prefix}:global}}:queues"
    sec, usec = client.time()
    now = sec * 1_000_000 + usec
    client.sadd(queues_key, QUEUE)

    def load(total: int, make) -> None:
        for start in range(0, total, chunk):
            pipe = client.pipeline(transaction=False)
            ids = {}
            for g in range(start + 1, min(total, start + chunk) + 1):
                task_id, fields, zset, score = make(g)
                pipe.hset(base + "task:" + task_id, mapping=fields)
                pipe.zadd(base + zset, {task_id: score})
                if zset == "due":  # a PENDING task is also in its claim lane (priority 0, no group)
                    pipe.zadd(base + "lane:0:", {task_id: score})
                ids[task_id] = QUEUE
            pipe.hset(ids_key, mapping=ids)
            pipe.execute()

    def pending_task(g: int):
        task_id = f"p{g:09d}"
        due = now - 3_600_000_000 + g
        return task_id, {
            "id": task_id, "queue": QUEUE, "handler": "noop", "payload": f'{{"n":{g}}}', "headers": "{}",
            "status": "PENDING", "attempt_count": "0", "redrive_count": "0", "next_attempt_at": str(due),
            "created_at": str(now), "updated_at": str(now),
        }, "due", due

    def expired_task(g: int):
        task_id = f"x{g:09d}"
        lease = now - 300_000_000 + g
        return task_id, {
            "id": task_id, "queue": QUEUE, "handler": "noop", "payload": "{}", "headers": "{}",
            "status": "IN_FLIGHT", "attempt_count": "0", "redrive_count": "0",
            "next_attempt_at": str(now - 7_200_000_000), "created_at": str(now), "updated_at": str(now),
            "claim_token": f"{QUEUE}|bench.{g}", "claimed_at": str(now - 600_000_000), "lease_expires_at": str(lease),
        }, "inflight", lease

    load(pending, pending_task)
    client.zadd(base + "lanes", {"0:": 0})
    load(expired, expired_task)
    client.close()


def backlog_run(session, backend: str, pending: int, expired: int, claims: int, reap_seconds: float) -> dict[str, Any]:
    with session.store_url(backend) as url:
        storage = open_storage(url)
        try:
            storage.migrate()
            began = time.perf_counter()
            (_pg_load if backend == "postgres" else _redis_load)(url, pending, expired)
            load_seconds = time.perf_counter() - began
            latencies = []
            for _ in range(claims):
                t0 = time.perf_counter()
                claimed = storage.claim(QUEUE, 100, 60)
                latencies.append((time.perf_counter() - t0) * 1000)
                assert len(claimed) == 100, len(claimed)
                storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed])
            reap: dict[str, Any] = {}
            if expired:
                t0 = time.perf_counter()
                report = reap_expired_leases(storage, batch_size=100, deadline=time.monotonic() + reap_seconds)
                elapsed = time.perf_counter() - t0
                reap = {"reaped": report.expired, "reap_seconds": elapsed, "reap_tasks_per_s": report.expired / elapsed,
                        "reap_batches": report.batches}
        finally:
            storage.close()
    return {
        "backend": backend, "pending": pending, "expired": expired, "load_seconds": load_seconds,
        "claims": claims, "claim_batch": 100,
        "claim_p50_ms": percentile(latencies, 50), "claim_p99_ms": percentile(latencies, 99),
        **reap,
    }


__all__ = ["backlog_run", "StaleClaim"]
