"""Flow-control throughput (issue 16): rdq before flow control and after, in one run.

``python -m bench.flow --base DIR --out bench/results/flow.json [--backends postgres,redis]``

DIR is an export of the commit before flow control (or, with ``--base-cases``, of any commit
whose flow cases are to be compared with this tree's) (``git archive <commit> | tar -x -C DIR``);
every case runs its processes with that tree or this one first on ``PYTHONPATH``, against a fresh
store of its own, in interleaved order (base, flow, base, flow ...) so drift on a shared machine
hits both alike. Cases (``bench/flow_worker.py``): ``off`` (no policy, all priority 0) on both
trees; ``priorities`` (priorities 0-9, no policy), ``many_keys`` (a concurrency key per task,
``concurrency_limit: 1``) and ``hot_key`` (one key, ``concurrency_limit: 4``) on this tree.
Reported: tasks/s (claim + settle, no handler), claim latency, round trips per claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .backends import BackendSession
from .common import ROOT, drain_seconds, load_average, machine_facts, median, run_on_barrier


WORKER = str(Path(__file__).with_name("flow_worker.py"))


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)  # the worker script imports rdq_core only: the tree's
    return env


def run_case(session: BackendSession, backend: str, tree: Path, case: str, n: int, workers: int, batch: int) -> dict[str, Any]:
    with session.store_url(backend) as url:
        env = _env(tree)
        out = subprocess.run([sys.executable, WORKER, "prepare", url, case, str(n)], env=env,
                             capture_output=True, text=True, timeout=600, cwd=tree)
        if out.stdout.strip() != "ok":
            raise RuntimeError(f"prepare failed: {out.stderr[-2000:]}")
        reports = run_on_barrier([WORKER, "drain", url, case, str(batch)], workers, env=env, cwd=str(tree),
                                 timeout=600)
    window = drain_seconds(reports, n, case)
    claims = sum(r["claims"] for r in reports)
    return {"tasks_per_s": n / window, "claim_ms": 1000 * sum(r["claim_seconds"] for r in reports) / claims,
            "claims": claims, "empty_claims": sum(r["empty_claims"] for r in reports),
            "round_trips_per_task": sum(r["round_trips"] for r in reports) / n}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.flow")
    parser.add_argument("--base", required=True, help="export of the commit before flow control")
    parser.add_argument("--out", default="bench/results/flow.json")
    parser.add_argument("--backends", default="postgres,redis")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", default="off,priorities,many_keys,hot_key")
    parser.add_argument("--base-cases", default="off",
                        help="cases run on the base tree too (default: off only, the tree before flow control)")
    args = parser.parse_args(argv)
    base, flow = Path(args.base).resolve(), ROOT
    cases = args.cases.split(",")
    # Cases also run on the base tree (an A/B of two trees that both have flow control).
    base_cases = [case for case in args.base_cases.split(",") if case and case != "off"]
    plan = [("off", "base", base), ("off", "flow", flow)]
    for case in ("priorities", "many_keys", "hot_key"):
        if case in base_cases:
            plan.append((case, "base", base))
        plan.append((case, "flow", flow))
    plan = [step for step in plan if step[0] in cases]
    backends = tuple(args.backends.split(","))
    samples: dict[str, list[dict[str, Any]]] = {}
    load = [load_average()]
    with BackendSession(backends) as session:
        for run in range(args.runs):
            for backend in backends:
                for case, tree_name, tree in plan:
                    key = f"{backend}/{case}/{tree_name}"
                    result = run_case(session, backend, tree, case, args.n, args.workers, args.batch)
                    samples.setdefault(key, []).append(result)
                    print(f"run {run + 1} {key}: {result['tasks_per_s']:.0f} tasks/s, claim {result['claim_ms']:.2f} ms, "
                          f"{result['round_trips_per_task']:.2f} round trips/task", flush=True)
                    load.append(load_average())
    summary = {key: {field: median([s[field] for s in runs]) for field in runs[0]} for key, runs in samples.items()}
    for key, runs in samples.items():
        # Each repetition's throughput over the base tree's in the same repetition: drift between
        # repetitions cancels out of the ratio (the machine may be shared).
        # Every case but the base's own plain claim, on either tree, against that plain claim.
        base_key = f"{key.split('/')[0]}/off/base"
        base_runs = samples.get(base_key)
        if base_runs and key != base_key:
            ratios = [r["tasks_per_s"] / b["tasks_per_s"] for r, b in zip(runs, base_runs, strict=True)]
            summary[key]["ratio_to_base"] = median(ratios)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_facts(),
                                          "config": vars(args), "load": load, "samples": samples, "median": summary},
                                         indent=2))
    for key, values in summary.items():
        ratio = f"  x{values['ratio_to_base']:.2f} of base" if "ratio_to_base" in values else ""
        print(f"{key:32s} {values['tasks_per_s']:8.0f} tasks/s  claim {values['claim_ms']:6.2f} ms  "
              f"{values['round_trips_per_task']:.2f} rt/task{ratio}")


if __name__ == "__main__":
    main(sys.argv[1:])
