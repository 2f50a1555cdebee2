"""``python -m bench run --out bench/results [--smoke] [--parts …]`` -- runs every benchmark.

Writes ``<out>/results.json`` (every sample, medians, machine, load) and ``<out>/results.md``
(the tables BENCHMARKS.md quotes). Sizes are configurable; ``--smoke`` is a tiny run that only
proves the harness works (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from .common import load_average, machine_facts

ALL_PARTS = ("roundtrips", "e2e", "peers", "ceiling", "latency", "steady", "backlog", "imports", "artifacts")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the benchmarks")
    run.add_argument("--out", default="bench/results")
    run.add_argument("--smoke", action="store_true", help="tiny sizes, one run: checks the harness only")
    run.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma list of {ALL_PARTS}")
    run.add_argument("--backends", default="sqlite,postgres,redis,mongo")
    run.add_argument("--peers", default="pgqueuer,procrastinate,rq,celery")
    run.add_argument("--runs", type=int, default=3, help="repetitions (medians are reported)")
    run.add_argument("--n", type=int, default=20000, help="tasks per e2e run (batch 10 and 100)")
    run.add_argument("--n-batch1", type=int, default=5000, help="tasks per e2e run at batch 1")
    run.add_argument("--n-mongo", type=int, default=2000, help="tasks per e2e run on the MongoDB-wire server")
    run.add_argument("--n-peer", default="pgqueuer=20000,procrastinate=10000,rq=10000,celery=20000")
    run.add_argument("--workers", default="1,2")
    run.add_argument("--batches", default="1,10,100")
    run.add_argument("--rt-n", type=int, default=1000, help="tasks for the round-trip count")
    run.add_argument("--backlog", default="10000,100000,1000000", help="pending backlog sizes")
    run.add_argument("--backlog-backends", default="postgres,redis")
    run.add_argument("--expired", type=int, default=100000, help="expired leases loaded for the reaper")
    run.add_argument("--claims", type=int, default=50, help="claims (of 100) timed per backlog size")
    run.add_argument("--reap-seconds", type=float, default=20.0, help="reaper time budget per backlog size")
    run.add_argument("--ceiling-n", type=int, default=20000)
    run.add_argument("--import-runs", type=int, default=5)
    run.add_argument("--latency-n", type=int, default=200, help="tasks per idle enqueue→start run (rdq dev: a fifth)")
    run.add_argument("--steady-rate", default="sqlite=200,postgres=200,redis=200,mongo=50",
                     help="steady mixed load: tasks enqueued per second, per backend")
    run.add_argument("--steady-seconds", type=float, default=8.0, help="steady mixed load: seconds of enqueueing")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1
        args.n = args.n_batch1 = args.n_mongo = 100
        args.n_peer = "pgqueuer=100,procrastinate=100,rq=100,celery=100"
        args.workers = "1"
        args.batches = "100"
        args.rt_n = 100
        args.backlog = "1000"
        args.expired = 300
        args.claims = 3
        args.reap_seconds = 5
        args.ceiling_n = 1000
        args.import_runs = 1
        args.latency_n = 10
        args.steady_rate = "sqlite=50,postgres=50,redis=50,mongo=20"
        args.steady_seconds = 1.0
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Recorder:
    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            "command": "python -m bench " + " ".join(sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_facts(),
            "config": {k: v for k, v in vars(args).items() if k != "command"},
            "load": [],
            "errors": [],
        }

    def section(self, name: str) -> list:
        return self.data.setdefault(name, [])

    def note_load(self, label: str) -> None:
        self.data["load"].append({"at": label, "loadavg": load_average()})

    def error(self, where: str, exc: BaseException) -> None:
        print(f"  ! {where}: {exc}", file=sys.stderr, flush=True)
        self.data["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                                    "trace": traceback.format_exc()[-3000:]})

    def save(self) -> None:
        from .report import render

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "results.md").write_text(render(self.data))


def run(args: argparse.Namespace) -> int:
    from .backends import BackendSession

    warnings.filterwarnings("ignore")
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(ALL_PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {sorted(unknown)}")
    backends = tuple(b for b in args.backends.split(",") if b)
    peers = [p for p in args.peers.split(",") if p]
    n_peer = dict(item.split("=") for item in args.n_peer.split(","))
    workers, batches = _ints(args.workers), _ints(args.batches)
    rec = Recorder(Path(args.out), args)
    rec.note_load("start")
    began = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - began:7.1f}s] {msg}", flush=True)

    needed = set(backends) | ({"postgres"} if {"ceiling", "peers"} & set(parts) else set())
    needed |= set(b for b in args.backlog_backends.split(",") if b) if "backlog" in parts else set()
    with BackendSession(tuple(needed)) as session:
        if "roundtrips" in parts:
            from .rdq_bench import round_trips_per_task

            for backend in backends:
                for batch in (1, 100):
                    try:
                        row = round_trips_per_task(session, backend, batch, args.rt_n)
                        rec.section("round_trips").append(row)
                        log(f"round trips {backend} batch {batch}: claim+settle {row['claim_settle']:.3f}/task")
                    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                        rec.error(f"roundtrips {backend} b{batch}", exc)
            rec.save()

        if "e2e" in parts:
            from .rdq_bench import e2e_run

            rec.note_load("e2e")
            for rep in range(args.runs):  # repetitions outermost: load drift spreads over every config
                for backend in backends:
                    for w in workers:
                        for batch in batches:
                            n = args.n_mongo if backend == "mongo" else (args.n_batch1 if batch == 1 else args.n)
                            try:
                                row = e2e_run(session, backend, n, w, batch)
                                row["rep"] = rep
                                rec.section("e2e").append(row)
                                log(f"e2e {backend} W={w} b={batch}: {row['process_tasks_per_s']:.0f}/s "
                                    f"(enqueue {row['enqueue_tasks_per_s']:.0f}/s)")
                            except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                                rec.error(f"e2e {backend} W{w} b{batch}", exc)
                rec.save()

        if "peers" in parts or "ceiling" in parts:
            from .ceiling import ceiling_run
            from .peers.drivers import peer_run, versions
            from .rdq_bench import e2e_run
            from .redis_ceiling import redis_ceiling_run

            rec.data["peer_versions"] = versions()
            rec.note_load("peers")
            peer_batch = max(batches)
            for rep in range(args.runs):
                # rdq, the peers and the ceiling interleaved in the same repetition: the ratios
                # compare figures measured minutes apart, under the same background load.
                if "peers" in parts:
                    for w in workers:
                        for backend in ("postgres", "redis"):
                            if backend not in backends:
                                continue
                            try:
                                row = e2e_run(session, backend, args.n, w, peer_batch)
                                row.update(rep=rep, system="rdq")
                                rec.section("head_to_head").append(row)
                                log(f"h2h rdq {backend} W={w} b={peer_batch}: {row['process_tasks_per_s']:.0f}/s")
                            except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                                rec.error(f"h2h rdq {backend} W{w}", exc)
                        for peer in peers:
                            try:
                                row = peer_run(peer, int(n_peer[peer]), w)
                                row.update(rep=rep, system=peer)
                                rec.section("head_to_head").append(row)
                                log(f"h2h {peer} W={w}: {row['process_tasks_per_s']:.0f}/s "
                                    f"(enqueue {row['enqueue_tasks_per_s']:.0f}/s)")
                            except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                                rec.error(f"peer {peer} W{w}", exc)
                if "ceiling" in parts:
                    for clients in workers:
                        _measured(rec, log, "ceiling", f"ceiling clients={clients}", rep,
                                  lambda c=clients: ceiling_run(session.pg_database_url, args.ceiling_n, c),
                                  lambda row: f"{row['rows_per_s']:.0f} rows/s")
                        if "redis" in backends:  # the bare Lua floor under rdq's Redis scripts
                            _measured(rec, log, "redis_ceiling", f"redis ceiling clients={clients}", rep,
                                      lambda c=clients: redis_ceiling_run(args.ceiling_n, c),
                                      lambda row: f"{row['rows_per_s']:.0f} rows/s")
                rec.save()

        if "latency" in parts:
            _latency(session, args, backends, peers, rec, log)
        if "steady" in parts:
            from .latency import steady_run

            rec.note_load("steady")
            rates = {name: float(rate) for name, rate in (item.split("=") for item in args.steady_rate.split(","))}
            for rep in range(args.runs):
                for backend in backends:
                    _measured(rec, log, "steady", f"steady {backend}", rep,
                              lambda b=backend: steady_run(session, b, rates[b], args.steady_seconds),
                              lambda row: f"{row['rate_per_s']:g}/s: start p50 {row['start']['p50_ms']:.1f} "
                                          f"p99 {row['start']['p99_ms']:.1f} ms, done p50 {row['done']['p50_ms']:.1f} "
                                          f"p99 {row['done']['p99_ms']:.1f} ms")
                rec.save()

        if "backlog" in parts:
            from .backlog import backlog_run

            rec.note_load("backlog")
            for backend in [b for b in args.backlog_backends.split(",") if b]:
                for size in _ints(args.backlog):
                    try:
                        row = backlog_run(session, backend, size, args.expired, args.claims, args.reap_seconds)
                        rec.section("backlog").append(row)
                        log(f"backlog {backend} {size}: claim p50 {row['claim_p50_ms']:.2f} ms "
                            f"p99 {row['claim_p99_ms']:.2f} ms, reap {row.get('reap_tasks_per_s', 0):.0f}/s")
                    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                        rec.error(f"backlog {backend} {size}", exc)
                    rec.save()

    if "imports" in parts:
        from .serverless import cold_imports

        rec.note_load("imports")
        try:
            rec.data["imports"] = cold_imports(args.import_runs)
            log("import times measured")
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            rec.error("imports", exc)
    if "artifacts" in parts:
        from .serverless import artifact_sizes

        try:
            rec.data["artifacts"] = artifact_sizes()
            log("artifact sizes measured")
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            rec.error("artifacts", exc)
    rec.note_load("end")
    rec.data["elapsed_seconds"] = time.monotonic() - began
    rec.save()
    log(f"wrote {rec.out / 'results.json'} and {rec.out / 'results.md'}")
    return 1 if rec.data["errors"] else 0


def _latency(session, args: argparse.Namespace, backends: tuple[str, ...], peers: list[str], rec: Recorder, log) -> None:
    """enqueue→start into an idle worker, rdq and PgQueuer interleaved per repetition, then what
    the wake-up costs an enqueue (on/off A/B)."""
    from .latency import (
        concurrent_enqueue_overhead,
        enqueue_overhead,
        idle_latency_dev,
        idle_latency_pgqueuer,
        idle_latency_rdq,
        pg_trigger_cost,
    )

    rec.note_load("latency")
    runs: list[tuple[str, Any]] = [(f"rdq {b}", lambda b=b: idle_latency_rdq(session, b, args.latency_n))
                                   for b in ("postgres", "redis") if b in backends]
    if "pgqueuer" in peers and "postgres" in backends:
        runs.append(("pgqueuer", lambda: idle_latency_pgqueuer(session, args.latency_n)))
    if "sqlite" in backends:
        runs.append(("rdq dev", lambda: idle_latency_dev(session, max(5, args.latency_n // 5))))
    for rep in range(args.runs):
        for name, measure in runs:
            _measured(rec, log, "idle_latency", f"idle enqueue→start {name}", rep, measure,
                      lambda row: f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms")
        rec.save()
    for backend in ("postgres", "redis"):
        if backend in backends:
            _measured(rec, log, "wake_overhead", f"enqueue with/without wake-up {backend}", 0,
                      lambda b=backend: enqueue_overhead(session, b, blocks=max(2, args.runs * 2),
                                                         per_block=max(50, args.latency_n)),
                      lambda row: f"single {row['single_on_ms']:.2f}/{row['single_off_ms']:.2f} ms, "
                                  f"batch 500 {row['batch500_on_ms']:.1f}/{row['batch500_off_ms']:.1f} ms")
            if backend == "postgres":
                _measured(rec, log, "wake_trigger", "wake-up trigger's server time", 0,
                          lambda: pg_trigger_cost(session, samples=max(20, args.latency_n)),
                          lambda row: f"{row['one_due_trigger_ms']:.3f} of {row['one_due_statement_ms']:.3f} ms (1 row), "
                                      f"{row['batch500_due_trigger_ms']:.3f} of {row['batch500_due_statement_ms']:.3f} ms "
                                      f"(500 rows), {row['one_notify_trigger_ms']:.3f} ms (1 row, notifying)")
            _measured(rec, log, "wake_overhead_concurrent", f"8 concurrent producers with/without wake-up {backend}", 0,
                      lambda b=backend: concurrent_enqueue_overhead(session, b, producers=8,
                                                                    seconds=1.0 if args.smoke else 3.0,
                                                                    rounds=1 if args.smoke else max(2, args.runs)),
                      lambda row: f"{row['on_per_s']:.0f}/{row['off_per_s']:.0f} enqueues/s")
    rec.save()


def _measured(rec: Recorder, log, section: str, where: str, rep: int, measure, describe) -> None:
    """One measurement: its row recorded in ``section`` and logged, or its error recorded."""
    try:
        row = measure()
        row["rep"] = rep
        rec.section(section).append(row)
        log(f"{where}: {describe(row)}")
    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
        rec.error(where, exc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("PYTHONPATH") is None:
        os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
