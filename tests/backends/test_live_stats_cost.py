"""``live_stats`` costs in proportion to live work: on PostgreSQL and SQLite its plan reads only
the indexes that hold PENDING, IN_FLIGHT or DEAD tasks (or the ranges of those statuses), never
the table nor an index over the finished tasks a queue keeps."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from rdq_testing.servers import pg_fresh_schema  # noqa: E402 - after importorskip
from rdq_core.compliance.support import enqueue_n, success  # noqa: E402
from rdq_core.storage import open_storage  # noqa: E402
from rdq_core.storage.postgres.backend import QUERIES  # noqa: E402
from rdq_core.storage.sqlite.backend import _Q  # noqa: E402

FINISHED = 3000


def _fill(url: str) -> None:
    """A queue of many finished tasks and a little live work."""
    store = open_storage(url)
    try:
        store.migrate()
        enqueue_n(store, "gauged", FINISHED)
        while claimed := store.claim("gauged", 500, 30):
            store.settle([success(c) for c in claimed])
        enqueue_n(store, "gauged", 5)
        store.claim("gauged", 2, 30)
        live = store.live_stats("gauged")
        assert (live.pending, live.in_flight, live.dead) == (3, 2, 0)
        assert store.stats("gauged").succeeded == FINISHED
    finally:
        store.close()


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_postgres_live_stats_read_only_the_partial_indexes_of_live_statuses(pg_database_url: str) -> None:
    url = pg_fresh_schema(pg_database_url, prefix="live_stats_")
    _fill(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE rdq_tasks")
        (plan,), = conn.execute("EXPLAIN (FORMAT JSON, ANALYZE, BUFFERS) " + QUERIES["live_stats"],
                                {"queue": "gauged"}).fetchall()
    nodes = list(_plan_nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]))
    on_tasks = [n for n in nodes if n.get("Relation Name") == "rdq_tasks"]
    assert on_tasks and all(n["Node Type"] in ("Index Only Scan", "Index Scan") for n in on_tasks), \
        [(n["Node Type"], n.get("Index Name")) for n in on_tasks]
    assert {n["Index Name"] for n in on_tasks} <= {
        "rdq_tasks_pending_due_idx", "rdq_tasks_pending_claim_idx", "rdq_tasks_lease_expiry_idx", "rdq_tasks_dead_idx"}
    # Rows read from rdq_tasks' indexes: the live tasks, not the finished thousands.
    assert sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1) for n in on_tasks) < 20


def test_sqlite_live_stats_read_only_the_ranges_of_live_statuses(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'live.db'}"
    _fill(url)
    conn = sqlite3.connect(tmp_path / "live.db")
    try:
        conn.execute("ANALYZE")
        plan = [row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + _Q["live_status_counts"], ("gauged",))]
    finally:
        conn.close()
    assert any("USING COVERING INDEX rdq_tasks_queue_status (queue=? AND status=?)" in step for step in plan), plan
    assert not any(step.startswith("SCAN") for step in plan), plan
