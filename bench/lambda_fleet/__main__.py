"""``python -m bench.lambda_fleet run|compare`` (see ``bench/lambda_fleet/__init__.py``).

``run``: one scenario, its report as JSON (``--out`` also writes it to a file).
``compare``: the same backlog at H=1 and H=8, the SQS + Lambda model beside them, and the
Markdown table BENCHMARKS.md quotes (``--out`` writes ``fleet.json`` and ``fleet.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..common import machine_facts
from .scenario import Scenario, run
from .sqs_model import PRICES_AS_OF, SqsLambda, rdq_dollars_per_million_tasks


def _scenario_args(parser: argparse.ArgumentParser) -> None:
    d = Scenario()
    parser.add_argument("--backend", default=d.backend, choices=("postgres", "redis"))
    parser.add_argument("--tasks", type=int, default=d.tasks)
    parser.add_argument("--handler-ms", type=float, default=d.handler_ms)
    parser.add_argument("--cap", type=int, default=d.cap, help="MaxWorkerConcurrency")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--worker-timeout", type=int, default=d.worker_timeout_s)
    parser.add_argument("--memory-mb", type=int, default=None, help="default: the template's MemorySize")
    parser.add_argument("--tick", type=float, default=d.tick_s, help="seconds between scheduled ticks")
    parser.add_argument("--first-tick", type=float, default=d.first_tick_s)
    parser.add_argument("--burst-at", type=float, default=d.burst_at_s)
    parser.add_argument("--api-containers", type=int, default=d.api_containers)
    parser.add_argument("--enqueue-chunk", type=int, default=d.enqueue_chunk)
    parser.add_argument("--reserve-concurrency", action="store_true")
    parser.add_argument("--account-concurrency", type=int, default=d.account_concurrency)
    parser.add_argument("--prewarm", type=int, default=d.prewarm)
    parser.add_argument("--time-limit", type=float, default=d.time_limit_s)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="any other template parameter")
    parser.add_argument("--logs", default=None, help="keep the environments' logs in this directory")
    parser.add_argument("--out", default=None)


def _scenario(args: argparse.Namespace, handler_concurrency: int) -> Scenario:
    return Scenario(
        backend=args.backend, tasks=args.tasks, handler_ms=args.handler_ms, cap=args.cap,
        handler_concurrency=handler_concurrency, batch_size=args.batch_size, worker_timeout_s=args.worker_timeout,
        memory_mb=args.memory_mb, tick_s=args.tick, first_tick_s=args.first_tick, burst_at_s=args.burst_at,
        api_containers=args.api_containers, enqueue_chunk=args.enqueue_chunk,
        reserve_concurrency=args.reserve_concurrency, account_concurrency=args.account_concurrency,
        prewarm=args.prewarm, time_limit_s=args.time_limit,
        parameters=dict(p.split("=", 1) for p in args.param),
        logs_dir=f"{args.logs}/h{handler_concurrency}" if args.logs else None)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _money(value: float) -> str:
    return f"${value:.2f}" if value >= 0.1 else f"${value:.3f}"


def compare_table(results: dict[int, dict[str, Any]], model: SqsLambda) -> str:
    any_result = next(iter(results.values()))
    s = any_result["scenario"]
    arch = any_result["function"]["architecture"]
    lines = [
        f"{s['tasks']} tasks of {s['handler_ms']:g} ms (I/O-bound), cap {s['cap']}, batch {s['batch_size']}, "
        f"{any_result['function']['memory_mb']} MB, {s['backend']}; prices: {PRICES_AS_OF}.",
        "",
        "| | tasks/s | of its ideal | drain s | GB-s / 1,000 tasks | requests / 1,000 tasks | $ / million tasks (x86) "
        "| $ / million tasks (arm64) | peak invocations (holding tasks) | peak DB conns | lost / overlapping |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h, r in sorted(results.items()):
        x86 = rdq_dollars_per_million_tasks(r, "x86_64")["total"]
        arm = rdq_dollars_per_million_tasks(r, "arm64")["total"]
        lines.append(
            f"| rdq H={h} | {r['tasks_per_s']} | {r['of_ideal']} (ideal {r['ideal_tasks_per_s']:g}) | {r['drain_s']} | "
            f"{r['gb_s_per_1000_tasks']} | {r['requests_per_1000_tasks']} | {_money(x86)} | {_money(arm)} | "
            f"{r['peak_invocations']} ({r['peak_invocations_holding_tasks']}) | {r['peak_db_connections']} | "
            f"{r['lost_tasks']} / {r['overlapping_attempts']} |")
    row = model.row()
    lines.append(
        f"| SQS + Lambda (model) | {row['tasks_per_s']:g} | 1.0 (by construction) | {row['drain_s']:.1f} | "
        f"{row['gb_s_per_1000_tasks']:.4g} | {row['requests_per_1000_tasks']:g} | "
        f"{_money(row['usd_per_million_x86']['total'])} | {_money(row['usd_per_million_arm64']['total'])} | "
        f"{s['cap']} | – | – |")
    sqs = row["usd_per_million_x86"]
    lines += ["", f"SQS + Lambda (x86) splits into SQS requests {_money(sqs['sqs'])}, Lambda requests "
                  f"{_money(sqs['lambda_requests'])}, GB-s {_money(sqs['lambda_gb_s'])}; the function is {arch} in the template."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lambda_fleet")
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one scenario")
    _scenario_args(one)
    one.add_argument("--handler-concurrency", type=int, default=1, help="H: HandlerConcurrency")
    both = sub.add_parser("compare", help="rdq at several H against the SQS + Lambda model")
    _scenario_args(both)
    both.add_argument("--h", default="1,8", help="comma list of HandlerConcurrency values")
    args = parser.parse_args(argv)
    if args.command == "run":
        result = run(_scenario(args, args.handler_concurrency), _progress)
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    results = {}
    for h in (int(x) for x in args.h.split(",")):
        _progress(f"-- H={h}")
        results[h] = run(_scenario(args, h), _progress)
        _progress(json.dumps({k: results[h][k] for k in ("tasks_per_s", "of_ideal", "gb_s_per_1000_tasks",
                                                         "peak_invocations_holding_tasks", "lost_tasks")}))
    first = next(iter(results.values()))
    model = SqsLambda(tasks=args.tasks, handler_ms=args.handler_ms, cap=args.cap,
                      memory_mb=first["function"]["memory_mb"])
    table = compare_table(results, model)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fleet.json").write_text(json.dumps({"machine": machine_facts(), "runs": results,
                                                     "sqs_model": model.row(), "argv": argv}, indent=2) + "\n")
        (out / "fleet.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
