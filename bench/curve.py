"""The backlog curve: drain throughput of rdq and its peers as the backlog grows.

``python -m bench.curve [--sizes 20000,100000,1000000] [--runs 3] [--workers 2]
[--systems rdq-postgres,pgqueuer,rdq-redis,celery] [--peer-max 100000] [--out bench/results/curve.json]
[--plot FILE.svg]``; ``python -m bench.curve --replot RESULTS.json --plot FILE.svg`` draws a saved run.

For each backlog size and repetition, each system in turn (so drift hits them alike): enqueue N
no-op tasks, then drain them with W worker processes (Celery: one worker with a pool of W), the
same drivers as the head-to-head (``bench/rdq_bench.py``, ``bench/peers/``). Two figures per
drain: tasks/s from the first task started to the last one finished (``without start-up``), and
from spawning the worker processes -- imports, connecting -- to the last one finished (``with
start-up``), which is what a short drain or a restarted fleet sees. ``--peer-max`` skips a peer at
sizes above it (a peer's drain of 1 M can take a quarter of an hour; say so when publishing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .backends import BackendSession
from .curve_plot import write_svg
from .common import load_average, machine_facts, median

BATCH = 100


def _rdq(session: BackendSession, backend: str, n: int, workers: int) -> dict[str, Any]:
    from .rdq_bench import e2e_run

    row = e2e_run(session, backend, n, workers, BATCH, timeout=3600)
    return {"without": row["process_tasks_per_s"], "with": row["process_with_startup_tasks_per_s"]}


def _peer(peer: str, n: int, workers: int) -> dict[str, Any]:
    from .peers.drivers import peer_run

    row = peer_run(peer, n, workers, timeout=3600)
    return {"without": row["process_tasks_per_s"], "with": row["process_with_startup_tasks_per_s"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.curve")
    parser.add_argument("--sizes", default="20000,100000,1000000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rdq-runs-above-peer-max", type=int, default=None,
                        help="repetitions at sizes above --peer-max (default: --runs)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--systems", default="rdq-postgres,pgqueuer,rdq-redis,celery")
    parser.add_argument("--peer-max", type=int, default=100_000)
    parser.add_argument("--out", default="bench/results/curve.json")
    parser.add_argument("--plot", metavar="FILE.svg", help="also draw the medians as a chart (log-scale backlog)")
    parser.add_argument("--replot", metavar="RESULTS.json", help="only draw --plot from a saved run")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        write_svg(saved["median"], Path(args.plot or "curve.svg"), saved["config"]["workers"])
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    systems = args.systems.split(",")
    backends = tuple(sorted({s.removeprefix("rdq-") for s in systems if s.startswith("rdq-")}))
    samples: dict[str, list[dict[str, Any]]] = {}
    load = [load_average()]
    began = time.time()
    with BackendSession(backends) as session:
        for n in sizes:
            runs = args.runs if n <= args.peer_max or args.rdq_runs_above_peer_max is None \
                else args.rdq_runs_above_peer_max
            for rep in range(runs):
                for system in systems:
                    is_rdq = system.startswith("rdq-")
                    if not is_rdq and n > args.peer_max:
                        continue
                    result = _rdq(session, system.removeprefix("rdq-"), n, args.workers) if is_rdq \
                        else _peer(system, n, args.workers)
                    samples.setdefault(f"{system}/{n}", []).append(result)
                    load.append(load_average())
                    print(f"[{time.time() - began:7.1f}s] {system} n={n} rep {rep + 1}: "
                          f"{result['without']:.0f}/s, with start-up {result['with']:.0f}/s", flush=True)
    summary = {key: {"without": median([r["without"] for r in runs]), "with": median([r["with"] for r in runs]),
                     "runs": len(runs)} for key, runs in samples.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began)), "machine": machine_facts(),
        "config": vars(args), "load": load, "samples": samples, "median": summary}, indent=2))
    if args.plot:
        write_svg(summary, Path(args.plot), args.workers)
    print(f"\nmedian tasks/s (W={args.workers}, batch {BATCH} for rdq): without start-up / with start-up")
    for key, value in summary.items():
        print(f"  {key:28s} {value['without']:9.0f} {value['with']:9.0f}   ({value['runs']} runs)")


if __name__ == "__main__":
    main(sys.argv[1:])
