"""Latency: enqueue→start into an idle worker, a steady mixed load, and what the wake-up costs an
enqueue.

* ``idle_latency_rdq``: the real ``rdq worker`` (``python -m rdq_core.hosts.cli worker``, default
  settings: batch 10, concurrency 1, 1 s idle poll) serving one queue; one task at a time is
  enqueued with ``Client.enqueue`` after a random 20–60 ms pause (so the worker is idle each
  time); latency = the probe handler's start (``bench/latency_jobs.py``) minus the wall time just
  before the enqueue call. ``idle_latency_pgqueuer``: the same against PgQueuer's worker
  (``PgQueuer.run()``, its defaults, LISTEN/NOTIFY). ``idle_latency_dev``: ``rdq dev`` on SQLite,
  tasks POSTed to its HTTP API (one every 250 ms: the dev host's wake-up is debounced 200 ms).
* ``steady_run``: enqueue one task at a time at a fixed rate for a few seconds while one
  ``rdq worker`` drains; every 100th task fails its first attempt and is retried (backoff 0.2 s).
  enqueue→start from the probe's first attempt; enqueue→done from the task's ``updated_at`` as
  stored when it SUCCEEDED (the servers run on this machine: one clock).
* ``enqueue_overhead``: single-task and 500-task enqueues with the wake-up on and off, in
  alternating blocks (PostgreSQL: the trigger dropped; Redis: the enqueue script without its
  PUBLISH), with a listener connected while it is on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rdq_core.client import Client
from rdq_core.model import Backoff, TaskStatus
from rdq_core.storage import open_storage

from .common import child_env, free_port, percentile, stop_process

QUEUE = "lat"
#: Pause before each idle enqueue (seconds): long enough for the worker to be idle again.
IDLE_SPACING = (0.02, 0.06)
#: The dev host debounces its wake-up (RDQ_WAKE_DEBOUNCE_SECONDS, 0.2 s): one task per 250 ms.
DEV_SPACING = (0.25, 0.30)
#: Every FAIL_EVERY-th task of the steady load fails its first attempt.
FAIL_EVERY = 100
RETRY_BACKOFF = Backoff(initial_seconds=0.2, factor=2.0, max_seconds=5.0, jitter=0.2)


# -- the probe's log ----------------------------------------------------------------------------

def read_probe(path: str) -> dict[str, dict[int, tuple[float, float]]]:
    """key -> attempt -> (start, end), from the probe handler's lines."""
    seen: dict[str, dict[int, tuple[float, float]]] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 4:
                    seen.setdefault(parts[0], {})[int(parts[1])] = (float(parts[2]), float(parts[3]))
    except FileNotFoundError:
        pass
    return seen


def wait_for_keys(path: str, keys: set[str], timeout: float, proc: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        seen = read_probe(path)
        if keys <= seen.keys():
            return seen
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(keys - seen.keys())} of {len(keys)} probe tasks did not start within {timeout:g}s")
        time.sleep(0.01)


def summary_ms(values: list[float]) -> dict[str, float | int | None]:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms) if ms else None}


# -- processes ----------------------------------------------------------------------------------

@contextmanager
def rdq_worker(url: str, probe_file: str, *args: str) -> Iterator[subprocess.Popen]:
    """``rdq worker`` on ``url`` serving QUEUE with the probe handler; stopped by PID."""
    with tempfile.TemporaryDirectory(prefix="rdq-bench-lat-") as cwd, open(os.path.join(cwd, "worker.log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", url, "--log-format", "text", "worker",
             "--handlers", "bench.latency_jobs", "--queues", QUEUE, *args],
            cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=child_env(RDQ_BENCH_LATENCY_FILE=probe_file),
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop_process(proc)


def warm_up(enqueue: Callable[[str], object], probe_file: str, proc: subprocess.Popen) -> None:
    """One task through, so the worker is connected (and listening) before the clock runs."""
    enqueue("warm")
    wait_for_keys(probe_file, {"warm"}, 30, proc)
    time.sleep(0.3)


# -- enqueue→start into an idle worker ---------------------------------------------------------

@contextmanager
def fresh_store(session, backend: str) -> Iterator[tuple[str, Client, str]]:
    """(URL, client, probe log path) of a fresh, migrated store of ``backend``; all removed after."""
    with session.store_url(backend) as url, tempfile.TemporaryDirectory(prefix="rdq-bench-probe-") as tmp:
        storage = open_storage(url)
        try:
            storage.migrate()
            yield url, Client(storage), os.path.join(tmp, "probe.log")
        finally:
            storage.close()


def idle_latency_rdq(session, backend: str, n: int) -> dict[str, Any]:
    with fresh_store(session, backend) as (url, client, probe), rdq_worker(url, probe) as proc:
        warm_up(lambda key: client.enqueue(QUEUE, "probe", {"key": key}), probe, proc)
        sent = {}
        for i in range(n):
            time.sleep(random.uniform(*IDLE_SPACING))
            key = f"k{i}"
            sent[key] = time.time()
            client.enqueue(QUEUE, "probe", {"key": key})
        seen = wait_for_keys(probe, set(sent), 30, proc)
    return {"system": "rdq", "backend": backend,
            **summary_ms([seen[key][1][0] - at for key, at in sent.items()])}


def idle_latency_pgqueuer(session, n: int) -> dict[str, Any]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    from . import servers

    with servers.pg_database(tag="pgqueuer_lat_") as dsn, tempfile.TemporaryDirectory(prefix="rdq-bench-probe-") as tmp:
        probe = os.path.join(tmp, "probe.log")

        async def install() -> None:
            conn = await asyncpg.connect(dsn)
            try:
                await Queries(AsyncpgDriver(conn)).install()
            finally:
                await conn.close()

        asyncio.run(install())
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.latency_jobs", "pgqueuer", dsn, QUEUE],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=child_env(RDQ_BENCH_LATENCY_FILE=probe), start_new_session=True,
        )
        try:
            async def drive() -> dict[str, float]:
                conn = await asyncpg.connect(dsn)
                try:
                    queries = Queries(AsyncpgDriver(conn))

                    async def enqueue(key: str) -> None:
                        await queries.enqueue(QUEUE, json.dumps({"key": key}).encode(), 0)

                    await enqueue("warm")
                    await asyncio.get_running_loop().run_in_executor(None, wait_for_keys, probe, {"warm"}, 30, proc)
                    await asyncio.sleep(0.3)
                    sent = {}
                    for i in range(n):
                        await asyncio.sleep(random.uniform(*IDLE_SPACING))
                        key = f"k{i}"
                        sent[key] = time.time()
                        await enqueue(key)
                    return sent
                finally:
                    await conn.close()

            sent = asyncio.run(drive())
            seen = wait_for_keys(probe, set(sent), 30, proc)
        finally:
            stop_process(proc)
    return {"system": "pgqueuer", "backend": "postgres",
            **summary_ms([seen[key][1][0] - at for key, at in sent.items()])}


def idle_latency_dev(session, n: int) -> dict[str, Any]:
    """``rdq dev`` on a fresh SQLite file; tasks POSTed to its API."""
    with session.store_url("sqlite") as url, tempfile.TemporaryDirectory(prefix="rdq-bench-dev-") as tmp:
        probe = os.path.join(tmp, "probe.log")
        port = free_port()
        with open(os.path.join(tmp, "dev.log"), "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", url, "dev", "--port", str(port),
                 "--handlers", "bench.latency_jobs"],
                cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=child_env(RDQ_BENCH_LATENCY_FILE=probe, RDQ_API_TOKEN=""),
            )
            try:
                base = f"http://127.0.0.1:{port}"
                _wait_http(f"{base}/v1/queues/{QUEUE}/stats", proc)

                def enqueue(key: str) -> None:
                    body = json.dumps({"handler": "probe", "payload": {"key": key}}).encode()
                    request = urllib.request.Request(f"{base}/v1/queues/{QUEUE}/tasks", data=body, method="POST",
                                                     headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(request, timeout=10) as answer:
                        answer.read()

                warm_up(enqueue, probe, proc)
                sent = {}
                for i in range(n):
                    time.sleep(random.uniform(*DEV_SPACING))
                    key = f"k{i}"
                    sent[key] = time.time()
                    enqueue(key)
                seen = wait_for_keys(probe, set(sent), 30, proc)
            finally:
                stop_process(proc)
    return {"system": "rdq dev (HTTP API)", "backend": "sqlite",
            **summary_ms([seen[key][1][0] - at for key, at in sent.items()])}


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (a queue without tasks may be a 404)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("rdq dev did not start") from None
            time.sleep(0.1)


# -- steady mixed load --------------------------------------------------------------------------

def steady_run(session, backend: str, rate: float, seconds: float) -> dict[str, Any]:
    n = int(rate * seconds)
    with fresh_store(session, backend) as (url, client, probe):
        with rdq_worker(url, probe) as proc:
            warm_up(lambda key: client.enqueue(QUEUE, "probe", {"key": key}, id=key), probe, proc)
            sent: dict[str, float] = {}
            enqueue_seconds = []
            began = time.time()
            for k in range(n):
                pause = began + k / rate - time.time()
                if pause > 0:
                    time.sleep(pause)
                key = f"s{k}"
                fail = k % FAIL_EVERY == FAIL_EVERY // 2
                sent[key] = time.time()
                client.enqueue(QUEUE, "probe", {"key": key, "fail": fail}, id=key, backoff=RETRY_BACKOFF)
                enqueue_seconds.append(time.time() - sent[key])
            enqueued_in = time.time() - began
            deadline = time.monotonic() + 60
            while client.storage.stats(QUEUE).succeeded < n + 1:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"only {client.storage.stats(QUEUE).succeeded - 1} of {n} tasks succeeded")
                time.sleep(0.05)
        done = _succeeded_at(client)
        seen = read_probe(probe)
    retried = {key for key in sent if 2 in seen.get(key, {})}
    finished = max(done[key] for key in sent)
    return {
        "backend": backend, "rate_per_s": rate, "n": n, "seconds": seconds,
        "offered_per_s": n / enqueued_in, "throughput_per_s": n / (finished - min(sent.values())),
        "retried": len(retried),
        "enqueue_call": summary_ms(enqueue_seconds),
        "start": summary_ms([seen[key][1][0] - at for key, at in sent.items()]),
        "done": summary_ms([done[key] - at for key, at in sent.items()]),
        "done_first_try": summary_ms([done[key] - at for key, at in sent.items() if key not in retried]),
    }


def _succeeded_at(client: Client) -> dict[str, float]:
    out: dict[str, float] = {}
    cursor = None
    while True:
        page = client.storage.list_tasks(QUEUE, status=TaskStatus.SUCCEEDED, limit=500, cursor=cursor)
        for task in page.tasks:
            assert task.updated_at is not None
            out[task.id] = task.updated_at.timestamp()
        cursor = page.next_cursor
        if not cursor:
            return out


# -- what the wake-up costs an enqueue ----------------------------------------------------------

def enqueue_overhead(session, backend: str, blocks: int, per_block: int) -> dict[str, Any]:
    """Enqueue latency with the wake-up on and off, ``blocks`` pairs of alternating blocks of
    ``per_block`` single-task enqueues (and ``per_block // 25`` 500-task batches); medians in
    ms. Short blocks: the load other processes put on the machine drifts, and both sides share it.
    On Redis, where switching costs nothing, the switch is made before every call instead."""
    with fresh_store(session, backend) as (url, client, _), wake_switch(backend, url, client) as (toggle, drain):
        single: dict[bool, list[float]] = {True: [], False: []}
        batch: dict[bool, list[float]] = {True: [], False: []}
        counter = 0
        for block in range(blocks * 2):  # on, off, off, on, on, off, ...: neither side always first
            on = block % 4 in (0, 3)
            toggle(on)
            for n in range(per_block):
                counter += 1
                side = on if backend != "redis" else (n + block) % 2 == 0
                toggle(side)
                t = time.perf_counter()
                client.enqueue(QUEUE, "probe", {"key": f"o{counter}"})
                single[side].append(time.perf_counter() - t)
                drain()
            toggle(on)
            for _ in range(max(1, per_block // 25)):
                items = [{"handler": "probe", "payload": {"key": f"b{counter}-{i}"}} for i in range(500)]
                counter += 1
                t = time.perf_counter()
                client.enqueue_many(QUEUE, items)
                batch[on].append(time.perf_counter() - t)
                drain()
    med = {key: {on: percentile([v * 1000 for v in values[on]], 50) for on in (True, False)}
           for key, values in (("single", single), ("batch500", batch))}
    return {"backend": backend, "single_on_ms": med["single"][True], "single_off_ms": med["single"][False],
            "batch500_on_ms": med["batch500"][True], "batch500_off_ms": med["batch500"][False],
            "single_n": len(single[True]), "batch_n": len(batch[True])}


def concurrent_enqueue_overhead(session, backend: str, producers: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Enqueues/s of ``producers`` threads each enqueueing one task at a time for ``seconds``,
    wake-up on and off in alternating rounds (on, off, off, on, ...), a listener connected."""
    import threading

    rates: dict[bool, list[float]] = {True: [], False: []}
    with fresh_store(session, backend) as (url, client, _), wake_switch(backend, url, client) as (toggle, drain):
        for round_ in range(rounds * 2):
            on = round_ % 4 in (0, 3)
            toggle(on)
            done = [0] * producers
            until = time.monotonic() + seconds

            def produce(slot: int, until: float = until, done: list[int] = done) -> None:
                while time.monotonic() < until:
                    client.enqueue(QUEUE, "probe", {"key": "c"})
                    done[slot] += 1

            threads = [threading.Thread(target=produce, args=(slot,)) for slot in range(producers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates[on].append(sum(done) / seconds)
            drain()
    return {"backend": backend, "producers": producers, "on_per_s": percentile(rates[True], 50),
            "off_per_s": percentile(rates[False], 50), "rounds": rounds}


def pg_trigger_cost(session, samples: int) -> dict[str, Any]:
    """The wake-up trigger's own server time, as ``EXPLAIN ANALYZE`` reports it, for a 1-row and a
    500-row INSERT into a queue that already has due tasks (no NOTIFY) and for a 1-row INSERT into
    an empty queue (one NOTIFY); medians in ms, with the whole statement's time beside them. The
    client's view (enqueue_overhead) drowns this in the machine's load; the server's does not."""
    import psycopg

    with fresh_store(session, "postgres") as (url, _client, _), psycopg.connect(url, autocommit=True) as conn:
        made = iter(range(10**9))

        def explain(rows: int, empty_first: bool) -> tuple[float, float]:
            if empty_first:
                conn.execute("DELETE FROM rdq_tasks")
            plan = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status,"
                " max_attempts, next_attempt_at) SELECT %s || g, %s, 'probe', '{}', '{}', 'PENDING', 5, now()"
                " FROM generate_series(1, %s) AS g", (f"t{next(made)}-", QUEUE, rows)).fetchone()[0][0]
            trigger = sum(t["Time"] for t in plan.get("Triggers", []) if t["Trigger Name"] == "rdq_tasks_wake_workers")
            return trigger, plan["Execution Time"]

        explain(1, False)  # the session's first call compiles the function
        out: dict[str, Any] = {"backend": "postgres", "samples": samples}
        for name, rows, empty_first in (("one_due", 1, False), ("batch500_due", 500, False), ("one_notify", 1, True)):
            measured = [explain(rows, empty_first) for _ in range(samples if rows == 1 else max(3, samples // 10))]
            out[f"{name}_trigger_ms"] = percentile([m[0] for m in measured], 50)
            out[f"{name}_statement_ms"] = percentile([m[1] for m in measured], 50)
    return out


@contextmanager
def wake_switch(backend: str, url: str, client: Client) -> Iterator[tuple[Callable[[bool], None], Callable[[], None]]]:
    """(switch the wake-up on or off, read what the connected listener has heard); the wake-up
    is on again and the listener closed afterwards."""
    listener = client.storage.enqueue_listener([QUEUE])
    toggle = _wake_toggle(backend, url)

    def drain() -> None:
        while listener is not None and listener.receive(0):
            pass

    try:
        yield toggle, drain
    finally:
        toggle(True)
        if listener is not None:
            listener.close()


def _wake_toggle(backend: str, url: str) -> Callable[[bool], None]:
    if backend == "postgres":
        import psycopg

        conn = psycopg.connect(url, autocommit=True)
        state = {"on": True}

        def toggle_pg(on: bool) -> None:
            if on != state["on"]:
                verb = "ENABLE" if on else "DISABLE"
                conn.execute(f"ALTER TABLE rdq_tasks {verb} TRIGGER rdq_tasks_wake_workers")
                state["on"] = on

        return toggle_pg
    if backend == "redis":
        from rdq_core.storage.redis import lua

        with_publish = lua.SCRIPTS["enqueue"]
        without = lua.Script.of("enqueue", with_publish.source.replace(
            "if woken then redis.call('PUBLISH', ARGV[1] .. 'wake', queue) end", ""))
        assert without.source != with_publish.source, "the enqueue script's PUBLISH line moved"

        def toggle_redis(on: bool) -> None:
            lua.SCRIPTS["enqueue"] = with_publish if on else without  # loaded on NOSCRIPT

        return toggle_redis
    raise ValueError(backend)
