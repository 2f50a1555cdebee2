"""A/B throughput of code trees in one run: each change to the claim path measured alone.

``python -m bench.ab --tree base=DIR --tree change=DIR [--backends postgres,redis] [--workers 1,2]
[--batch 100] [--n 20000] [--runs 3] [--out FILE]``

Each DIR is an export of one commit (``git archive <commit> | tar -x -C DIR``). A case migrates a
fresh store, enqueues N no-op tasks and drains them with W ``bench.rdq_worker`` processes, every
process running with that tree first on ``PYTHONPATH`` (its schema, its engine, its worker loop);
trees take turns within each repetition (A, B, A, B ...), so drift on a shared machine hits them
alike. Reported per tree, backend and W: the median tasks/s and each tree's ratio to the first.
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, in the order to report")
    parser.add_argument("--backends", default="postgres,redis")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    trees = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.tree)]
    backends = tuple(args.backends.split(","))
    workers = [int(w) for w in args.workers.split(",")]
    rows: list[dict[str, Any]] = []
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


if __name__ == "__main__":
    main(sys.argv[1:])
