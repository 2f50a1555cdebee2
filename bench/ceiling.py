"""The physical reference on the same PostgreSQL: a bare batched SKIP LOCKED claim of 100 rows
plus one bulk status update, no library, psycopg 3 autocommit (the driver rdq uses).

Its Redis counterpart is ``bench/redis_ceiling.py``; both start their clients on one barrier
(``common.run_on_barrier``) and time them the same way (``busy_window``)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from .common import ready_then_go, run_on_barrier


SETUP_SQL = """
CREATE TABLE ceiling_jobs (
    id bigserial PRIMARY KEY,
    status text NOT NULL DEFAULT 'PENDING',
    payload jsonb
);
CREATE INDEX ceiling_jobs_pending_idx ON ceiling_jobs (id) WHERE status = 'PENDING';
"""
CLAIM_SQL = """
UPDATE ceiling_jobs SET status = 'RUNNING'
WHERE id = ANY (ARRAY(
    SELECT id FROM ceiling_jobs WHERE status = 'PENDING' ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
))
RETURNING id, payload
"""
DONE_SQL = "UPDATE ceiling_jobs SET status = 'DONE' WHERE id = ANY(%(ids)s)"


def worker_main() -> None:
    import psycopg

    dsn, limit = sys.argv[1], int(sys.argv[2])
    conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
    if not ready_then_go():
        return
    first = time.time()
    last, rows = first, 0
    while True:
        claimed = conn.execute(CLAIM_SQL, {"limit": limit}).fetchall()
        if not claimed:
            break
        conn.execute(DONE_SQL, {"ids": [r[0] for r in claimed]})
        rows += len(claimed)
        last = time.time()
    print(json.dumps({"rows": rows, "first": first, "last": last}), flush=True)


def ceiling_run(pg_database_url: str, n: int, clients: int, limit: int = 100) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS ceiling_jobs")
        conn.execute(SETUP_SQL)
        conn.execute(
            "INSERT INTO ceiling_jobs (payload) SELECT jsonb_build_object('n', g) FROM generate_series(1, %(n)s) AS g",
            {"n": n},
        )
        conn.execute("VACUUM ANALYZE ceiling_jobs")
    try:
        reports = run_on_barrier(["-m", "bench.ceiling", pg_database_url, str(limit)], clients)
    finally:
        with psycopg.connect(pg_database_url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS ceiling_jobs")
    window = busy_window(reports, n)
    return {"store": "postgres", "n": n, "clients": clients, "batch": limit, "rows_per_s": n / window, "seconds": window}


def busy_window(reports: list[dict[str, Any]], n: int) -> float:
    """Seconds from the first claim any client made to its last done-write; the clients must
    have taken exactly ``n`` rows between them."""
    rows = sum(r["rows"] for r in reports)
    assert rows == n, (rows, n)
    busy = [r for r in reports if r["rows"]]
    return max(r["last"] for r in busy) - min(r["first"] for r in busy)


if __name__ == "__main__":
    worker_main()
