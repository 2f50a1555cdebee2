"""One rdq worker process for the throughput runs: the real ``Worker`` host, drained once.

``python -m bench.rdq_worker URL QUEUE BATCH``: opens the store, connects, starts the lease
heartbeat like ``rdq worker`` does, prints ``ready``, waits for ``go`` on stdin, then calls
``Worker.drain`` (the claim loop of ``rdq worker``: claim a batch, run it, settle it while the
next batch is claimed and run) until a round finds nothing, and prints one JSON line: tasks
run, first-claim / last-settle wall times, claims, round trips, peak RSS.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig

from .common import peak_rss_mb, ready_then_go


def noop(payload, ctx):
    return None


def main() -> None:
    url, queue, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lease = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
    storage = open_storage(url)
    storage.now()  # connect before the clock starts
    registry = HandlerRegistry()
    registry.register("noop", noop, timeout_seconds=10)
    worker = Worker(storage, WorkerConfig(queues=[queue], batch_size=batch, lease_seconds=lease), registry=registry)
    threading.Thread(target=worker._heartbeat_loop, name="rdq-heartbeat", daemon=True).start()
    if not ready_then_go():
        return
    trips = storage.round_trips
    claims = 0
    claim = storage.claim

    def counted_claim(*args, **kwargs):
        nonlocal claims
        claims += 1
        return claim(*args, **kwargs)

    storage.claim = counted_claim  # type: ignore[method-assign]
    first = time.time()
    if hasattr(worker, "drain"):
        tasks = worker.drain()  # the claim loop of ``rdq worker`` until the queue is empty
    else:  # an older tree (bench.ab): one settled round at a time
        tasks = 0
        while started := worker.run_once():
            tasks += started
    last = time.time()
    worker.stop()
    print(json.dumps({
        "tasks": tasks, "first": first, "last": last, "claims": claims,
        "round_trips": storage.round_trips - trips, "peak_rss_mb": peak_rss_mb(),
        "stale": worker.telemetry.counts.get("stale_settlements", 0),
    }), flush=True)
    storage.close()


if __name__ == "__main__":
    main()
