"""Start-up: from ``rdq worker`` exec to its first claim, as a short drain or a restart sees it.

``python -m bench.startup [--backends sqlite,postgres,redis] [--runs 7] [--rdq PATH ...] [--out bench/results/startup.json]``

Each run: a fresh store with one task of the examples' ``greet`` handler enqueued (and the schema
migrated) before the clock starts; then the clock starts, ``rdq worker`` (the installed console
script, else ``python -m rdq_core.hosts.cli``; ``--rdq`` names another, such as a wheel installed in
a clean virtual environment; several are run in turn, each run, for an A/B) is exec'd, and the harness polls the task. The
figure is the first attempt's ``started_at`` (the claim's time plus the moment the worker started
the handler) minus the instant before exec; the worker is then stopped with SIGTERM. Beside it,
``rdq --help`` and a bare ``python -c pass`` from the same instant give the floor the interpreter
and the command line's imports set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from rdq_core.storage import open_storage

from .backends import BackendSession
from .common import load_average, machine_facts, median, stop_process

QUEUE = "startup"


def rdq_command(given: str | None = None) -> list[str]:
    """``given``, else the installed ``rdq`` script beside this interpreter (what a user runs),
    else the module."""
    if given:
        return [given]
    script = Path(sys.executable).with_name("rdq")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rdq_core.hosts.cli"]


def python_beside(command: list[str]) -> str:
    """The interpreter the ``rdq`` script runs on (its ``#!`` line), for the bare-start floor."""
    if len(command) == 1:
        first = Path(command[0]).read_text(encoding="utf-8", errors="replace").splitlines()[0]
        if first.startswith("#!"):
            return first[2:].strip()
    return sys.executable


def _enqueue_one(url: str) -> str:
    from rdq_core import Client

    storage = open_storage(url)
    try:
        storage.migrate()
        return Client(storage).enqueue(QUEUE, "greet", {"name": "start-up"}).id
    finally:
        storage.close()


def _first_start(url: str, task_id: str, deadline: float) -> datetime:
    storage = open_storage(url)
    try:
        while time.monotonic() < deadline:
            task = storage.get(task_id)
            if task is not None and task.attempts and task.attempts[0].started_at is not None:
                return task.attempts[0].started_at
            time.sleep(0.005)
    finally:
        storage.close()
    raise TimeoutError(f"the worker did not start task {task_id} within the deadline")


def one_run(url: str, cwd: Path, rdq: list[str]) -> float:
    task_id = _enqueue_one(url)
    env = dict(os.environ, RDQ_STORAGE_URL=url)
    started = datetime.now(timezone.utc)
    worker = subprocess.Popen([*rdq, "worker", "--handlers", "rdq_core.examples", "--queues", QUEUE],
                              cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = _first_start(url, task_id, time.monotonic() + 30)
    finally:
        stop_process(worker, timeout=30)
    return (first - started).total_seconds() * 1000


def floor_ms(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - started) * 1000


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup")
    parser.add_argument("--backends", default="sqlite,postgres,redis")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--rdq", metavar="PATH", action="append",
                        help="an rdq script to start (default: the one beside this Python); repeat to compare, "
                             "interleaved run by run")
    parser.add_argument("--out", default="bench/results/startup.json")
    args = parser.parse_args(argv)
    commands = [rdq_command(path) for path in (args.rdq or [None])]
    backends = tuple(args.backends.split(","))
    samples: dict[str, list[float]] = {}
    cwd = Path(os.environ.get("TMPDIR", "/tmp")) / f"rdq-startup-{os.getpid()}"
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        with BackendSession(backends) as session:
            for run in range(args.runs):
                for rdq in commands:
                    label = f"{rdq[0]}: " if len(commands) > 1 else ""
                    samples.setdefault(f"{label}python -c pass", []).append(
                        floor_ms([python_beside(rdq), "-c", "pass"], cwd))
                    samples.setdefault(f"{label}rdq --help", []).append(floor_ms([*rdq, "--help"], cwd))
                    for backend in backends:
                        with session.store_url(backend) as url:
                            ms = one_run(url, cwd, rdq)
                        samples.setdefault(f"{label}{backend}: exec to first claim", []).append(ms)
                        print(f"run {run + 1} {label}{backend}: {ms:.0f} ms", flush=True)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    summary = {key: median(values) for key, values in samples.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_facts(), "load": load_average(),
        "commands": commands, "config": vars(args), "samples": samples, "median_ms": summary}, indent=2))
    for key, value in summary.items():
        spread = f"{min(samples[key]):.0f}-{max(samples[key]):.0f}"
        print(f"{key:56s} median {value:6.0f} ms  ({spread}, {len(samples[key])} runs)")


if __name__ == "__main__":
    main(sys.argv[1:])
