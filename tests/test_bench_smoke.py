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

from rdq_testing import servers  # noqa: E402 - after importorskip


def _require_bench_servers() -> None:
    """Fail (in CI) or skip (locally) when the benchmark's PostgreSQL or Redis (it reads
    RDQ_BENCH_*) does not answer."""
    from bench.servers import PG_ADMIN_URL, REDIS_URL

    problem = servers.pg_reachable(PG_ADMIN_URL) or servers.redis_reachable(REDIS_URL)
    if problem:
        servers.fail_or_skip(f"benchmark servers unreachable: {problem}")


def _pgqueuer_installed() -> bool:
    """Whether the PgQueuer peer can run here (the ``bench`` extra)."""
    return bool(importlib.util.find_spec("pgqueuer") and importlib.util.find_spec("asyncpg"))


def _run_bench(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` from the repository, this checkout first on the path; fails the
    test with the end of its output unless it exits 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(120)
def test_smoke_run_writes_json_and_markdown(tmp_path):
    _require_bench_servers()
    parts = "roundtrips,e2e,ceiling,backlog"
    extra: list[str] = []
    if _pgqueuer_installed():
        parts += ",peers"
        extra = ["--peers", "pgqueuer"]
    out = tmp_path / "results"
    _run_bench("bench", "run", "--smoke", "--out", str(out), "--parts", parts, *extra)
    data = json.loads((out / "results.json").read_text())
    assert data["errors"] == []
    backends = {"sqlite", "postgres", "redis", "mongo"}
    assert {r["backend"] for r in data["round_trips"]} == backends
    assert {r["backend"] for r in data["e2e"]} == backends
    assert all(r["process_tasks_per_s"] > 0 and r["enqueue_tasks_per_s"] > 0 for r in data["e2e"])
    assert {r["backend"] for r in data["backlog"]} == {"postgres", "redis"}
    assert data["ceiling"] and data["ceiling"][0]["rows_per_s"] > 0
    assert data["redis_ceiling"] and data["redis_ceiling"][0]["rows_per_s"] > 0
    if "peers" in parts:
        assert {r["system"] for r in data["head_to_head"]} >= {"rdq", "pgqueuer"}
    markdown = (out / "results.md").read_text()
    assert "## Round trips per task" in markdown and "## End-to-end throughput" in markdown
    assert "| redis | 1 |" in markdown.split("### The bare ceilings")[1]


@pytest.mark.timeout(150)
def test_smoke_latency_and_steady_load(tmp_path):
    """The idle enqueue→start runs (rdq on PostgreSQL and Redis, rdq dev; PgQueuer when
    installed), the wake-up's cost to an enqueue, and the steady mixed load on all four backends."""
    _require_bench_servers()
    with_pgqueuer = _pgqueuer_installed()
    out = tmp_path / "results"
    _run_bench("bench", "run", "--smoke", "--out", str(out), "--parts", "latency,steady",
               "--peers", "pgqueuer" if with_pgqueuer else "", timeout=140)
    data = json.loads((out / "results.json").read_text())
    assert data["errors"] == []
    systems = {(r["system"], r["backend"]) for r in data["idle_latency"]}
    assert systems >= {("rdq", "postgres"), ("rdq", "redis"), ("rdq dev (HTTP API)", "sqlite")}
    assert (("pgqueuer", "postgres") in systems) == with_pgqueuer
    assert all(r["n"] > 0 and r["p50_ms"] > 0 for r in data["idle_latency"])
    assert {r["backend"] for r in data["wake_overhead"]} == {"postgres", "redis"}
    assert {r["backend"] for r in data["wake_overhead_concurrent"]} == {"postgres", "redis"}
    assert {r["backend"] for r in data["steady"]} == {"sqlite", "postgres", "redis", "mongo"}
    assert all(r["start"]["n"] == r["n"] and r["done"]["n"] == r["n"] for r in data["steady"])
    assert "Steady mixed load" in (out / "results.md").read_text()


@pytest.mark.timeout(120)
def test_ab_cpu_mode_reports_cpu_per_task_for_each_tree(tmp_path):
    """``python -m bench.ab --cpu`` drains with one worker process per tree and reports its CPU
    time per task (this checkout as both trees, on SQLite: no server needed)."""
    out = tmp_path / "ab-cpu.json"
    done = _run_bench("bench.ab", "--cpu", "--tree", f"a={ROOT}", "--tree", f"b={ROOT}",
                      "--backends", "sqlite", "--n", "1000", "--runs", "1", "--out", str(out))
    rows = json.loads(out.read_text())["cpu_rows"]
    assert sorted(r["tree"] for r in rows) == ["a", "b"]
    assert all(r["user_us_per_task"] > 0 and r["tasks_per_s"] > 0 for r in rows)
    assert "median CPU per task" in done.stdout


@pytest.mark.timeout(120)
def test_smoke_startup_times_exec_to_first_claim_on_each_store(tmp_path):
    _require_bench_servers()
    out = tmp_path / "startup.json"
    _run_bench("bench.startup", "--runs", "1", "--backends", "sqlite,postgres", "--out", str(out))
    medians = json.loads(out.read_text())["median_ms"]
    # A start is slower than a bare interpreter and, on this loopback, well under the 30 s the
    # harness waits: the figure is the worker's, not a timeout's.
    for store in ("sqlite", "postgres"):
        assert medians["python -c pass"] < medians[f"{store}: exec to first claim"] < 20_000


@pytest.mark.timeout(120)
def test_smoke_backlog_curve_reports_with_and_without_start_up(tmp_path):
    _require_bench_servers()
    systems = "rdq-postgres,rdq-redis"
    if _pgqueuer_installed():
        systems += ",pgqueuer"
    out = tmp_path / "curve.json"
    _run_bench("bench.curve", "--sizes", "300,600", "--runs", "1", "--systems", systems,
               "--peer-max", "300", "--out", str(out))
    medians = json.loads(out.read_text())["median"]
    expected = {f"{s}/{n}" for s in systems.split(",") for n in (300, 600) if s.startswith("rdq-") or n <= 300}
    assert set(medians) == expected
    # Start-up (imports, connecting) only adds time: the figure with it is the lower one.
    assert all(0 < m["with"] <= m["without"] for m in medians.values()), medians
