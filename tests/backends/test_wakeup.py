"""An idle ``rdq worker`` wakes when a task is enqueued (PostgreSQL LISTEN/NOTIFY, Redis pub/sub).

Every worker here polls only every 30 s: a task that starts within 2 s of its enqueue was started
by the wake-up, not by the poll. The listener is best-effort: losing it (its PostgreSQL backend
terminated) costs a reconnect, never an enqueue.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from collections.abc import Iterator

import pytest

from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.errors import ConfigurationError
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig

#: The poll interval of every worker here: far above the wake-up deadline below.
POLL_SECONDS = 30.0
#: How soon an enqueued task must have started.
WAKE_DEADLINE_SECONDS = 2.0


class Started:
    """A handler that records when each task started."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.registry = HandlerRegistry()
        self.registry.register("note", self._note, timeout_seconds=5)

    def _note(self, payload: dict, ctx) -> None:
        self.at[payload["key"]] = time.monotonic()


@pytest.fixture(params=["postgresql", "redis"])
def store(request: pytest.FixtureRequest, fresh_store_url) -> Iterator[Storage]:
    storage = open_storage(fresh_store_url(request.param))
    storage.migrate()
    yield storage
    storage.close()


def running_worker(storage: Storage, started: Started, queues: list[str]) -> tuple[Worker, threading.Thread]:
    worker = Worker(storage, WorkerConfig(queues=queues, idle_poll_seconds=POLL_SECONDS, lease_seconds=10,
                                          reap_interval_seconds=0, schedules_every_seconds=0),
                    registry=started.registry)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    assert worker.wake is not None
    wait_until(worker.wake.listening.is_set, timeout=10, what="the worker to listen for enqueues")
    return worker, thread


def stopped(worker: Worker, thread: threading.Thread) -> None:
    worker.stop()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the worker did not stop"


def assert_wakes(storage: Storage, started: Started, queue: str, key: str, **options: Any) -> None:
    enqueued = time.monotonic()
    Client(storage).enqueue(queue, "note", {"key": key}, **options)
    wait_until(lambda: key in started.at, timeout=WAKE_DEADLINE_SECONDS,
               what=f"task {key} to start within {WAKE_DEADLINE_SECONDS}s of its enqueue (poll: {POLL_SECONDS:g}s)")
    assert started.at[key] - enqueued < WAKE_DEADLINE_SECONDS


def test_an_enqueue_wakes_an_idle_worker(store: Storage) -> None:
    started = Started()
    worker, thread = running_worker(store, started, ["wake"])
    try:
        # The first claim round may still be under way; from the second task on, the worker is
        # certainly idle in its 30 s pause when the enqueue commits.
        for n in range(4):
            assert_wakes(store, started, "wake", f"t{n}")
            time.sleep(0.2)  # let the claim loop go idle again
    finally:
        stopped(worker, thread)


def test_an_enqueue_with_a_dedupe_key_wakes_an_idle_worker_too(store: Storage) -> None:
    started = Started()
    worker, thread = running_worker(store, started, ["wake"])
    try:
        assert_wakes(store, started, "wake", "first")
        # Past the claim loop's re-checks after work (10 ms doubling: the next one is > 5 s away),
        # so only the wake-up can start the keyed task within the deadline.
        time.sleep(5.3)
        assert_wakes(store, started, "wake", "keyed", dedupe_key="only-one")
    finally:
        stopped(worker, thread)


def test_a_worker_serving_every_queue_wakes_for_any_of_them(store: Storage) -> None:
    started = Started()
    Client(store).enqueue("first", "note", {"key": "seed"})  # so the queue list is not empty
    worker, thread = running_worker(store, started, [])
    try:
        wait_until(lambda: "seed" in started.at, timeout=10, what="the seed task to run")
        time.sleep(0.2)
        assert_wakes(store, started, "first", "again")
    finally:
        stopped(worker, thread)


def test_an_enqueue_into_another_queue_does_not_wake_the_worker(store: Storage) -> None:
    started = Started()
    worker, thread = running_worker(store, started, ["mine"])
    assert worker.wake is not None
    try:
        assert_wakes(store, started, "mine", "t0")
        seen = worker.wake.mark()
        Client(store).enqueue("theirs", "note", {"key": "other"})
        time.sleep(0.5)
        assert worker.wake.mark() == seen, "an enqueue into a queue the worker does not serve woke it"
        assert_wakes(store, started, "mine", "t1")
        assert worker.wake.mark() != seen
    finally:
        stopped(worker, thread)


def _listener_pids(conn, schema: str) -> set[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query = %s",
        (f'LISTEN "rdq_enqueued:{schema}"',)).fetchall()
    return {row[0] for row in rows}


@pytest.mark.parametrize("fresh_store", ["postgresql"])
def test_a_killed_listening_connection_is_replaced_and_still_wakes(fresh_store_url, fresh_store: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    url = fresh_store_url(fresh_store)
    storage = open_storage(url)
    storage.migrate()
    started = Started()
    worker, thread = running_worker(storage, started, ["wake"])
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            (schema,) = admin.execute("SELECT current_schema()").fetchone()
            wait_until(lambda: _listener_pids(admin, schema), timeout=5, what="the LISTEN connection")
            (old,) = _listener_pids(admin, schema)
            admin.execute("SELECT pg_terminate_backend(%s)", (old,))
            # An enqueue while the listener is down never fails because of it.
            Client(storage).enqueue("wake", "note", {"key": "during"})
            wait_until(lambda: _listener_pids(admin, schema) - {old}, timeout=10, what="a new LISTEN connection")
        wait_until(lambda: "during" in started.at, timeout=5, what="the task enqueued meanwhile to run")
        time.sleep(0.2)
        assert_wakes(storage, started, "wake", "after")
    finally:
        stopped(worker, thread)
        storage.close()


def test_listen_off_polls_and_a_bad_flag_is_refused(fresh_store_url) -> None:
    pytest.importorskip("psycopg")
    url = fresh_store_url("postgresql")
    with open_storage(url + "&listen=off") as storage:
        storage.migrate()
        assert storage.enqueue_listener(["q"]) is None
        # The flag is rdq's own: libpq never sees it, and everything else works.
        assert Client(storage).enqueue("q", "note", {"key": "x"}).id
    with pytest.raises(ConfigurationError, match="listen"):
        open_storage(url + "&listen=maybe")


def test_an_enqueue_in_a_rolled_back_transaction_wakes_no_one(fresh_store_url) -> None:
    psycopg = pytest.importorskip("psycopg")
    url = fresh_store_url("postgresql")
    with open_storage(url) as storage:
        storage.migrate()
        listener = storage.enqueue_listener(["q"])
        assert listener is not None
        try:
            with psycopg.connect(url) as conn:
                Client(storage).enqueue("q", "note", {"key": "gone"}, connection=conn)
                conn.rollback()
            assert listener.receive(0.3) == []
            Client(storage).enqueue("q", "note", {"key": "kept"}, delay_seconds=60)
            assert listener.receive(0.3) == [], "a task that is not due yet wakes no one"
            Client(storage).enqueue("q", "note", {"key": "due"})
            assert listener.receive(2) == ["q"]
        finally:
            listener.close()


def test_only_an_enqueue_into_a_queue_without_due_tasks_notifies(fresh_store_url) -> None:
    """A committing NOTIFY serialises commits cluster-wide: a queue that already holds a due task
    has no idle worker to wake, so its enqueues send none."""
    pytest.importorskip("psycopg")
    with open_storage(fresh_store_url("postgresql")) as storage:
        storage.migrate()
        listener = storage.enqueue_listener([])
        assert listener is not None
        client = Client(storage)
        try:
            client.enqueue("q", "note", {"key": "first"})
            assert listener.receive(2) == ["q"]
            client.enqueue("q", "note", {"key": "second"})
            client.enqueue_many("q", [{"handler": "note", "payload": {"key": str(n)}} for n in range(3)])
            assert listener.receive(0.3) == [], "the queue had a due task: no one to wake"
            client.enqueue("other", "note", {"key": "x"})
            assert listener.receive(2) == ["other"], "another queue is judged on its own"
            claimed = storage.claim("q", 100, 30)
            assert len(claimed) == 5
            client.enqueue("q", "note", {"key": "after"})
            assert listener.receive(2) == ["q"], "claimed tasks are not due ones: wake"
        finally:
            listener.close()


def test_a_long_schema_name_gets_the_same_channel_on_both_sides(pg_database_url) -> None:
    psycopg = pytest.importorskip("psycopg")
    from rdq_testing.servers import pg_url_with_search_path

    schema = "s" * 63  # the longest identifier: the channel name is cut at 63 bytes on both sides
    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{schema}"')
    with open_storage(pg_url_with_search_path(pg_database_url, schema)) as storage:
        storage.migrate()
        listener = storage.enqueue_listener([])
        assert listener is not None
        try:
            Client(storage).enqueue("q" * 120, "note", {"key": "long"})
            assert listener.receive(2) == ["q" * 120]
        finally:
            listener.close()
