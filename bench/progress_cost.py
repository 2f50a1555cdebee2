"""What each store pays to keep the progress promise (docs/flow-control.md#progress).

``python -m bench.progress_cost [--backends sqlite,postgres,redis,mongo] [--blocked 10000] [--runs 15]``

Per store and per adversarial head, in one run: the median latency of a claim of 5 that must pass
over ``--blocked`` due tasks nothing may take to reach the 5 allowed tasks behind them, against
the same claim with an empty head (the 5 allowed tasks alone), and the ratio. Each claim's tasks
are released straight after (no attempt spent), so every sample sees the same head.

Heads: ``full_key`` (one concurrency key at its limit, ``concurrency_limit: 1``), ``spent_rate``
(one rate key out of budget, ``rate_limit: 1/h``), ``busy_keys`` (a key per blocked task, each
with one task running: the head is ``--blocked`` / 2 keys waiting behind their running task),
``delayed_groups`` (``fair_groups``, a group per blocked task, every task an hour in the future).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from rdq_core.flow import FlowPolicy, RateLimit
from rdq_core.model import ClaimRef, NewTask
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage

from .backends import BackendSession
from .common import load_average, median

CLAIM = 5
HOUR = 3600.0


def _task(task_id: str, queue: str, **fields: Any) -> NewTask:
    return NewTask(id=task_id, queue=queue, handler="noop", **fields)


def _enqueue(storage: Storage, tasks: list[NewTask]) -> None:
    for start in range(0, len(tasks), 500):
        storage.enqueue(tasks[start:start + 500])


def _head(case: str, queue: str, blocked: int) -> tuple[FlowPolicy, list[NewTask], Callable[[Storage, FlowPolicy], None]]:
    """The policy, the blocked tasks and what to run before timing (e.g. fill the keys)."""
    def nothing(storage: Storage, flow: FlowPolicy) -> None:
        return None

    if case == "full_key":
        def hold_one(storage: Storage, flow: FlowPolicy) -> None:
            assert len(storage.claim(queue, 1, HOUR, flow)) == 1
        return (FlowPolicy(concurrency_limit=1), [_task(f"b{n:06d}", queue, concurrency_key="hot") for n in range(blocked)],
                hold_one)
    if case == "spent_rate":
        def spend(storage: Storage, flow: FlowPolicy) -> None:
            assert len(storage.claim(queue, 1, HOUR, flow)) == 1
        return (FlowPolicy(rate_limit=RateLimit(1, HOUR)), [_task(f"b{n:06d}", queue, rate_key="hot") for n in range(blocked)],
                spend)
    if case == "busy_keys":
        keys = blocked // 2

        def run_one_of_each(storage: Storage, flow: FlowPolicy) -> None:
            while len(storage.claim(queue, 500, HOUR, flow)) == 500:
                pass
        return (FlowPolicy(concurrency_limit=1),
                [_task(f"b{n:06d}-{k:06d}", queue, concurrency_key=f"k{k:06d}") for n in range(2) for k in range(keys)],
                run_one_of_each)
    if case == "delayed_groups":
        return (FlowPolicy(fair_groups=True),
                [_task(f"b{n:06d}", queue, group=f"g{n:06d}", delay_seconds=HOUR) for n in range(blocked)], nothing)
    if case == "empty":
        return FlowPolicy(concurrency_limit=1), [], nothing
    raise ValueError(case)


def measure(storage: Storage, case: str, blocked: int, runs: int) -> dict[str, Any]:
    queue = f"head-{case}"
    flow, head, prepare = _head(case, queue, blocked)
    _enqueue(storage, head)
    prepare(storage, flow)
    group = {"group": "z"} if flow.fair_groups else {}
    storage.enqueue([_task(f"z-allowed-{n}", queue, **group) for n in range(CLAIM)])
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        claimed = storage.claim(queue, CLAIM, 60.0, flow)
        samples.append((time.perf_counter() - started) * 1000)
        got = sorted(c.task.id for c in claimed)
        assert got == [f"z-allowed-{n}" for n in range(CLAIM)], (case, got)
        storage.release([ClaimRef(c.task.id, c.claim_token) for c in claimed])
    return {"median_ms": median(samples), "min_ms": min(samples), "max_ms": max(samples)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.progress_cost")
    parser.add_argument("--backends", default="sqlite,postgres,redis,mongo")
    parser.add_argument("--blocked", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--cases", default="full_key,spent_rate,busy_keys,delayed_groups")
    args = parser.parse_args(argv)
    backends = tuple(args.backends.split(","))
    results: dict[str, Any] = {"blocked": args.blocked, "runs": args.runs, "load_before": load_average()}
    with BackendSession(backends) as session:
        for backend in backends:
            rows = {}
            for case in ["empty", *args.cases.split(",")]:
                with session.store_url(backend) as url:
                    storage = open_storage(url)
                    try:
                        storage.migrate()
                        rows[case] = measure(storage, case, args.blocked, args.runs)
                    finally:
                        storage.close()
            base = rows["empty"]["median_ms"]
            print(f"\n{backend}: claim of {CLAIM} behind {args.blocked} blocked tasks, median of {args.runs} (ms)")
            for case, row in rows.items():
                print(f"  {case:15s} {row['median_ms']:8.2f}  (min {row['min_ms']:.2f}, max {row['max_ms']:.2f})"
                      f"  x{row['median_ms'] / base:.1f} of the empty head")
            results[backend] = rows
    results["load_after"] = load_average()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
