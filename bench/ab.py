"""A/B throughput of code trees in one run: each change to the claim path measured alone.

``python -m bench.ab --tree base=DIR --tree change=DIR [--backends postgres,redis] [--workers 1,2]
[--batch 100] [--n 20000] [--runs 3] [--out FILE] [--cpu]``

Each DIR is an export of one commit (``git archive <commit> | tar -x -C DIR``). A case migrates a
fresh store, enqueues N no-op tasks and drains them with W ``bench.rdq_worker`` processes, every
process running with that tree first on ``PYTHONPATH`` (its schema, its engine, its worker loop);
trees take turns within each repetition (A, B, A, B ...), so drift on a shared machine hits them
alike. Reported per tree, backend and W: the median tasks/s and each tree's ratio to the first.
With ``--cpu``, instead: one worker process drains alone and reports its own CPU time per task
(user and system, every thread) -- steadier than throughput on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .backends import BackendSession
from .common import drain_seconds, load_average, median, run_on_barrier

PREPARE = """
import sys
from bench.rdq_bench import enqueue_noops
from rdq_core.storage import open_storage
storage = open_storage(sys.argv[1])
storage.migrate()
enqueue_noops(storage, "bench", int(sys.argv[2]))
storage.close()
print("ok")
"""

# One process, one claim loop, no barrier: the worker process's own CPU time (every thread, user
# and system, from ``os.times``) over its drain, per task. Inline like PREPARE so that every tree,
# old ones too, is measured by the same code.
DRAIN_CPU = """
import json, os, sys, time
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig
storage = open_storage(sys.argv[1])
storage.now()
registry = HandlerRegistry()
registry.register("noop", lambda payload, ctx: None, timeout_seconds=10)
worker = Worker(storage, WorkerConfig(queues=["bench"], batch_size=int(sys.argv[2])), registry=registry)
began, wall = os.times(), time.monotonic()
if hasattr(worker, "drain"):
    tasks = worker.drain()
else:
    tasks = 0
    while started := worker.run_once():
        tasks += started
ended, wall = os.times(), time.monotonic() - wall
worker.stop()
storage.close()
print(json.dumps({"tasks": tasks, "user_s": ended.user - began.user, "system_s": ended.system - began.system,
                  "wall_s": wall}))
"""

COUNT = """
import sys
from rdq_core.storage import open_storage
storage = open_storage(sys.argv[1])
print(storage.stats("bench").succeeded)
storage.close()
"""


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    return env


def _python(tree: Path, code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], env=_env(tree), cwd=tree, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def run_case(session: BackendSession, backend: str, tree: Path, n: int, workers: int, batch: int) -> dict[str, Any]:
    with session.store_url(backend) as url:
        if _python(tree, PREPARE, url, str(n)) != "ok":
            raise RuntimeError("prepare failed")
        reports = run_on_barrier(["-m", "bench.rdq_worker", url, "bench", str(batch)], workers,
                                 env=_env(tree), cwd=str(tree), timeout=900)
        succeeded = int(_python(tree, COUNT, url))
        if succeeded != n:
            raise RuntimeError(f"{tree}: {succeeded} of {n} tasks SUCCEEDED")
    window = drain_seconds(reports, n, str(tree))
    return {"tasks_per_s": n / window, "round_trips_per_task": sum(r["round_trips"] for r in reports) / n,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in reports)}


def cpu_case(session: BackendSession, backend: str, tree: Path, n: int, batch: int) -> dict[str, Any]:
    """One drain by one worker process of ``tree``: its CPU time per task, in microseconds."""
    with session.store_url(backend) as url:
        if _python(tree, PREPARE, url, str(n)) != "ok":
            raise RuntimeError("prepare failed")
        report = json.loads(_python(tree, DRAIN_CPU, url, str(batch)).splitlines()[-1])
    if report["tasks"] != n:
        raise RuntimeError(f"{tree}: drained {report['tasks']} of {n} tasks")
    return {"user_us_per_task": report["user_s"] / n * 1e6, "system_us_per_task": report["system_s"] / n * 1e6,
            "tasks_per_s": n / report["wall_s"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, in the order to report")
    parser.add_argument("--backends", default="postgres,redis")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--cpu", action="store_true",
                        help="instead: the CPU time per task of one worker process draining alone")
    args = parser.parse_args(argv)
    trees = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.tree)]
    backends = tuple(args.backends.split(","))
    workers = [int(w) for w in args.workers.split(",")]
    rows: list[dict[str, Any]] = []
    if args.cpu:
        _cpu_runs(trees, backends, args)
        return
    with BackendSession(backends) as session:
        for rep in range(args.runs):
            for w in workers:
                for backend in backends:
                    for name, tree in trees:
                        row = run_case(session, backend, tree, args.n, w, args.batch)
                        row.update(tree=name, backend=backend, workers=w, rep=rep, load=load_average())
                        rows.append(row)
                        print(f"rep {rep} {backend} W={w} {name}: {row['tasks_per_s']:.0f}/s", flush=True)
    print(f"\nmedian tasks/s of {args.runs} (n={args.n}, batch {args.batch}); ratio to {trees[0][0]}")
    for backend in backends:
        for w in workers:
            first = None
            for name, _ in trees:
                mid = median([r["tasks_per_s"] for r in rows if (r["tree"], r["backend"], r["workers"]) == (name, backend, w)])
                first = first or mid
                print(f"  {backend:8} W={w} {name:12} {mid:8.0f}/s  {mid / first:5.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"trees": {n: str(t) for n, t in trees}, "rows": rows}, indent=1))



def _cpu_runs(trees: list[tuple[str, Path]], backends: tuple[str, ...], args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    with BackendSession(backends) as session:
        for rep in range(args.runs):
            for backend in backends:
                for name, tree in trees:
                    row = cpu_case(session, backend, tree, args.n, args.batch)
                    row.update(tree=name, backend=backend, rep=rep, load=load_average())
                    rows.append(row)
                    print(f"rep {rep} {backend} {name}: {row['user_us_per_task']:.1f} us user, "
                          f"{row['system_us_per_task']:.1f} us system per task", flush=True)
    print(f"\nmedian CPU per task of one worker process, of {args.runs} (n={args.n}, batch {args.batch})")
    for backend in backends:
        for name, _ in trees:
            mine = [r for r in rows if (r["tree"], r["backend"]) == (name, backend)]
            print(f"  {backend:8} {name:12} user {median([r['user_us_per_task'] for r in mine]):6.1f} us"
                  f"  system {median([r['system_us_per_task'] for r in mine]):5.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"trees": {n: str(t) for n, t in trees}, "cpu_rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
