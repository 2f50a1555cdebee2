"""rdq end-to-end throughput and round trips per task."""

from __future__ import annotations

import time
from typing import Any

from rdq_core.client import Client
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig

from .common import drain_seconds, run_on_barrier

ENQUEUE_CHUNK = 500  # Limits.batch_items: the largest batch enqueue_many takes


def enqueue_noops(storage, queue: str, n: int, chunk: int = ENQUEUE_CHUNK) -> dict[str, Any]:
    """Enqueue ``n`` no-op tasks through the public batch API; returns rate and round trips."""
    client = Client(storage)
    trips = storage.round_trips
    began = time.perf_counter()
    for start in range(0, n, chunk):
        items = [{"handler": "noop", "payload": {"n": i}} for i in range(start, min(n, start + chunk))]
        results = client.enqueue_many(queue, items)
        assert all(r.created for r in results)
    elapsed = time.perf_counter() - began
    return {"seconds": elapsed, "tasks_per_s": n / elapsed, "round_trips": storage.round_trips - trips}


def drain_with_workers(url: str, queue: str, n: int, workers: int, batch: int, timeout: float) -> dict[str, Any]:
    reports = run_on_barrier(["-m", "bench.rdq_worker", url, queue, str(batch)], workers, timeout=timeout)
    window = drain_seconds(reports, n, "rdq")
    return {
        "seconds": window,
        # From spawning the worker processes (imports, connecting) to the last task's end.
        "with_startup_seconds": max(r["last"] for r in reports if r["tasks"]) - reports[0]["spawned"],
        "tasks_per_s": n / window,
        "round_trips": sum(r["round_trips"] for r in reports),
        "claims": sum(r["claims"] for r in reports),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
        "stale": sum(r["stale"] for r in reports),
    }


def e2e_run(session, backend: str, n: int, workers: int, batch: int, timeout: float = 600) -> dict[str, Any]:
    with session.store_url(backend) as url:
        storage = open_storage(url)
        try:
            storage.migrate()
            queue = "bench"
            enq = enqueue_noops(storage, queue, n)
            drained = drain_with_workers(url, queue, n, workers, batch, timeout)
            stats = storage.stats(queue)
            if stats.succeeded != n:
                raise RuntimeError(f"{stats.succeeded} of {n} tasks SUCCEEDED")
        finally:
            storage.close()
    return {
        "backend": backend, "n": n, "workers": workers, "batch": batch,
        "enqueue_tasks_per_s": enq["tasks_per_s"],
        "enqueue_round_trips_per_task": enq["round_trips"] / n,
        "process_tasks_per_s": drained["tasks_per_s"],
        "process_seconds": drained["seconds"],
        "process_with_startup_tasks_per_s": n / drained["with_startup_seconds"],
        "claim_settle_round_trips_per_task": drained["round_trips"] / n,
        "worker_peak_rss_mb": drained["peak_rss_mb"],
        "stale_settlements": drained["stale"],
    }


# -- round trips per task, counted call by call --------------------------------------------------

class CountingStorage:
    """Delegates to a store and attributes its ``round_trips`` delta to the SPI method called."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.by_method: dict[str, int] = {}

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if name.startswith("_") or not callable(value) or name in ("round_trips",):
            return value

        def counted(*args, **kwargs):
            before = self._inner.round_trips
            try:
                return value(*args, **kwargs)
            finally:
                self.by_method[name] = self.by_method.get(name, 0) + self._inner.round_trips - before

        return counted

    @property
    def round_trips(self) -> int:
        return self._inner.round_trips


def round_trips_per_task(session, backend: str, batch: int, n: int) -> dict[str, Any]:
    """Enqueue ``n`` tasks in batches of ``batch``, then drain them with one worker claiming
    ``batch`` at a time; round trips per task for enqueue, claim and settle."""
    with session.store_url(backend) as url:
        inner = open_storage(url)
        try:
            inner.migrate()
            enq = enqueue_noops(inner, "rt", n, chunk=batch)
            storage = CountingStorage(inner)
            registry = HandlerRegistry()
            registry.register("noop", lambda p, c: None)
            worker = Worker(storage, WorkerConfig(queues=["rt"], batch_size=batch, lease_seconds=30), registry=registry)  # type: ignore[arg-type]  # a delegating proxy, not a subclass
            done = 0
            while done < n:
                started = worker.run_once()
                if not started:
                    break
                done += started
        finally:
            inner.close()
    claim = storage.by_method.get("claim", 0)
    settle = storage.by_method.get("settle", 0)
    return {
        "backend": backend, "batch": batch, "n": n,
        "enqueue": enq["round_trips"] / n,
        "claim": claim / n,
        "settle": settle / n,
        "claim_settle": (claim + settle) / n,
        "total": (enq["round_trips"] + claim + settle) / n,
    }
