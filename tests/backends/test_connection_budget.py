"""The connection budget: 50 worker processes through a pooler that keeps at most 20 server
connections to PostgreSQL, and a worker whose database refuses connections for a while.

Each ``rdq worker`` process holds its own small pool (a connection per concurrent call: the
claim loop, the heartbeat, the settle); with 50 of them the clients far outnumber the 20 server
connections pgbouncer may open, and transaction mode shares those between every client.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")

from rdq_testing.servers import SHARED_PG_URL, pg_scratch_database, stop_process  # noqa: E402
from rdq_core.compliance.support import wait_until  # noqa: E402 - after importorskip
from rdq_core.model import NewTask, Outcome, TaskStatus  # noqa: E402 - after importorskip
from rdq_core.storage import open_storage  # noqa: E402 - after importorskip

from tests.backends.conftest import PGBOUNCER_SERVER_CONNECTIONS as SERVER_CONNECTIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKERS = 50


def start_worker(url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "POWERTOOLS_LOG_LEVEL": "INFO"}
    env.pop("RDQ_STORAGE_URL", None)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", url, "worker", "--handlers", "rdq_core.examples",
             "--queues", "budget", "--schedules-every", "0", *extra],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=log.parent)


def test_fifty_workers_share_twenty_server_connections_without_errors_or_lost_tasks(bouncer, tmp_path):
    with pg_scratch_database(SHARED_PG_URL, prefix="rdq_budget_") as direct:
        database = direct.rsplit("/", 1)[1]
        url = bouncer.url_for(direct)
        store = open_storage(url)
        store.migrate()
        tasks = [NewTask(id=f"b{i:04d}", queue="budget", handler="greet", payload={"name": str(i)}) for i in range(600)]
        store.enqueue(tasks)
        peak = {"server": 0, "clients": 0}
        stop = threading.Event()

        def watch_both_sides() -> None:
            """What PostgreSQL sees for this database, and the clients pgbouncer serves for it."""
            with psycopg.connect(SHARED_PG_URL, autocommit=True, prepare_threshold=None) as conn, \
                    psycopg.connect(f"postgresql://postgres@127.0.0.1:{bouncer.port}/pgbouncer", autocommit=True,
                                    prepare_threshold=None) as pooler:
                while not stop.wait(0.1):
                    count = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                         (database,)).fetchone()[0]
                    peak["server"] = max(peak["server"], count)
                    cursor = pooler.execute("SHOW CLIENTS")
                    column = [d.name for d in cursor.description].index("database")
                    clients = sum(1 for row in cursor.fetchall() if row[column] == database)
                    peak["clients"] = max(peak["clients"], clients)

        watcher = threading.Thread(target=watch_both_sides, daemon=True)
        watcher.start()
        workers = [start_worker(url, tmp_path / f"worker-{n}.log", "--batch", "4") for n in range(WORKERS)]
        try:
            wait_until(lambda: store.stats("budget").succeeded == len(tasks), timeout=150, interval=0.5,
                       what="every task to succeed")
            assert all(w.poll() is None for w in workers), "a worker exited"
        finally:
            for worker in workers:
                stop_process(worker, timeout=20)
            stop.set()
            watcher.join(5)
        try:
            for task in tasks:
                done = store.get(task.id)
                assert done is not None and done.status is TaskStatus.SUCCEEDED
                assert [a.outcome for a in done.attempts] == [Outcome.SUCCESS], (task.id, done.attempts)
        finally:
            store.close()
        logs = "".join((tmp_path / f"worker-{n}.log").read_text(errors="replace") for n in range(WORKERS))
        assert "Traceback" not in logs and "storage unavailable" not in logs and '"level":"ERROR"' not in logs, logs[-3000:]
        assert 0 < peak["server"] <= SERVER_CONNECTIONS, peak
        # Each worker process: a connection for the claim loop and one for the heartbeat at most
        # (plus the test's own store).
        assert 0 < peak["clients"] <= 2 * WORKERS + 2, peak
        print(f"\nconnection budget: {WORKERS} workers, peaks {peak}")


def test_a_worker_rides_out_a_database_that_refuses_connections(bouncer, tmp_path):
    """The database refuses connections (pgbouncer's ``DISABLE`` + ``KILL``: every connection
    dropped, new ones refused) while a worker holds claimed tasks whose handlers are running.
    The worker logs the outage once, backs off, and when the database is back settles exactly
    the tasks it holds: one SUCCESS attempt each, no release or lease loss, nothing else touched."""
    with pg_scratch_database(SHARED_PG_URL, prefix="rdq_refused_") as direct:
        database = direct.rsplit("/", 1)[1]
        url = bouncer.url_for(direct)
        store = open_storage(url)
        store.migrate()
        held = [NewTask(id=f"s{i}", queue="budget", handler="sleep", payload={"seconds": 3}) for i in range(3)]
        later = [NewTask(id=f"l{i}", queue="budget", handler="greet", payload=None, delay_seconds=6) for i in range(3)]
        store.enqueue(held + later)
        log = tmp_path / "worker.log"
        worker = start_worker(url, log, "--batch", "3", "--concurrency", "1", "--lease", "30")
        try:
            wait_until(lambda: store.stats("budget").in_flight == 3, timeout=30, interval=0.1,
                       what="the worker to claim the sleeping tasks")
            bouncer.admin(f"DISABLE {database}")
            bouncer.admin(f"KILL {database}")
            wait_until(lambda: "storage unavailable" in log.read_text(errors="replace"), timeout=20, interval=0.1,
                       what="the worker to notice the refused connections")
            refused_for = time.monotonic()
            wait_until(lambda: time.monotonic() - refused_for > 4, timeout=10, interval=0.2,
                       what="the outage to outlast the handlers")
            bouncer.admin(f"ENABLE {database}")
            bouncer.admin(f"RESUME {database}")
            wait_until(lambda: store.stats("budget").succeeded == 6, timeout=60, interval=0.2,
                       what="every task to succeed after the outage")
        finally:
            stop_process(worker, timeout=20)
        try:
            for task in held + later:
                done = store.get(task.id)
                assert done is not None and [a.outcome for a in done.attempts] == [Outcome.SUCCESS], done
        finally:
            store.close()
        text = log.read_text(errors="replace")
        assert text.count("storage unavailable") == 1, text[-3000:]
        assert text.count("storage reachable again") == 1, text[-3000:]
