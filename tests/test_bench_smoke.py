"""Smoke-sized benchmark run: checks only that the harness works end to end (no timing asserts).

Needs the local PostgreSQL and Redis (like tests/backends) and nx-27017; peers are exercised
only if PgQueuer is installed (``bench`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("psycopg")
pytest.importorskip("redis")
pytest.importorskip("pymongo")


def _servers_reachable() -> str | None:
    import psycopg
    import redis

    try:
        psycopg.connect(os.environ.get("RDQ_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
                        connect_timeout=3).close()
        redis.Redis.from_url(os.environ.get("RDQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
                             socket_connect_timeout=3).ping()
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_smoke_run_writes_json_and_markdown(tmp_path):
    problem = _servers_reachable()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"benchmark servers unreachable: {problem}")
        pytest.skip(f"benchmark servers unreachable: {problem}")
    parts = "roundtrips,e2e,ceiling,backlog"
    extra: list[str] = []
    if importlib.util.find_spec("pgqueuer") and importlib.util.find_spec("asyncpg"):
        parts += ",peers"
        extra = ["--peers", "pgqueuer"]
    out = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--smoke", "--out", str(out), "--parts", parts, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["errors"] == []
    backends = {"sqlite", "postgres", "redis", "mongo"}
    assert {r["backend"] for r in data["round_trips"]} == backends
    assert {r["backend"] for r in data["e2e"]} == backends
    assert all(r["process_tasks_per_s"] > 0 and r["enqueue_tasks_per_s"] > 0 for r in data["e2e"])
    assert {r["backend"] for r in data["backlog"]} == {"postgres", "redis"}
    assert data["ceiling"] and data["ceiling"][0]["rows_per_s"] > 0
    if "peers" in parts:
        assert {r["system"] for r in data["head_to_head"]} >= {"rdq", "pgqueuer"}
    markdown = (out / "results.md").read_text()
    assert "## Round trips per task" in markdown and "## End-to-end throughput" in markdown
