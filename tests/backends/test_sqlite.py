"""The SQLite backend (the embedded default) against the compliance kit, plus its own specifics."""

from __future__ import annotations

import sqlite3

import pytest

from rdq_core.compliance import Capabilities, PerTask, StorageCompliance
from rdq_core.storage import open_storage


class TestSQLiteCompliance(StorageCompliance):
    # A file, not a server: "round trips" are statements, and extend and release run one each.
    capabilities = Capabilities(
        round_trips={"enqueue": 2, "claim": 1, "extend": PerTask(0, 1), "release": PerTask(0, 1), "settle": 2,
                     "find_expired": 1, "get": 1, "list_dead": 1, "stats": 2, "redrive": 1},
        # With lifecycle events on, one more statement in the same transaction.
        event_round_trips={"settle": 1, "redrive": 1},
        # enqueue(connection=) and ctx.transaction() on a sqlite3 connection to the store's file.
        joins_transactions=True,
    )

    @pytest.fixture
    def storage_url(self, tmp_path):
        yield f"sqlite:///{tmp_path}/rdq.db"


def test_relative_url_creates_the_file_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_storage("sqlite:///data/rdq.db")
    store.migrate()
    store.close()
    assert (tmp_path / "data" / "rdq.db").exists()


def test_database_runs_in_wal_mode_with_real_constraints(tmp_path):
    store = open_storage(f"sqlite:///{tmp_path}/rdq.db")
    store.migrate()
    store.close()
    conn = sqlite3.connect(tmp_path / "rdq.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, next_attempt_at, created_at, updated_at)"
            " VALUES ('x', 'q', 'h', 'null', '{}', 'BOGUS', 0, 0, 0)"
        )
    conn.execute(
        "INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, next_attempt_at, created_at, updated_at)"
        " VALUES ('x', 'q', 'h', 'null', '{}', 'PENDING', 0, 0, 0)"
    )
    conn.execute("INSERT INTO rdq_attempts (task_id, attempt_no, outcome) VALUES ('x', 1, 'SUCCESS')")
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("INSERT INTO rdq_attempts (task_id, attempt_no, outcome) VALUES ('x', 1, 'LEASE_EXPIRED')")


def test_memory_urls_are_refused():
    with pytest.raises(ValueError):
        open_storage("sqlite:///:memory:")


def test_a_held_write_lock_fails_the_call_within_the_url_busy_timeout(tmp_path):
    """Another process holding SQLite's write lock must not hang a claim loop: past the busy
    timeout (from the URL) the call raises StorageUnavailable, and the store works afterwards."""
    import time

    from rdq_core.errors import StorageUnavailable
    from rdq_core.model import NewTask

    store = open_storage(f"sqlite:///{tmp_path}/rdq.db?timeout=0.3")
    store.migrate()
    store.enqueue([NewTask(id="t1", queue="q", handler="h")])
    holder = sqlite3.connect(tmp_path / "rdq.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        for call in (lambda: store.claim("q", 1, 30), lambda: store.enqueue([NewTask(id="t2", queue="q", handler="h")])):
            started = time.monotonic()
            with pytest.raises(StorageUnavailable):
                call()
            assert 0.25 <= time.monotonic() - started < 3
        assert store.get("t1") is not None  # WAL readers are not blocked by the writer
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert [c.task.id for c in store.claim("q", 1, 30)] == ["t1"]
    store.close()


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf", "301", "soon"])
def test_busy_timeout_from_the_url_must_be_bounded(tmp_path, timeout):
    with pytest.raises(ValueError):
        open_storage(f"sqlite:///{tmp_path}/rdq.db?timeout={timeout}")


def test_opening_a_new_file_waits_for_another_opener_within_the_busy_timeout(tmp_path):
    """Switching a new file to WAL needs it to itself, and while another opener holds the write
    lock SQLite refuses at once instead of calling the busy handler: workers started together on
    a new file (each auto-migrating) must wait for each other within the busy timeout, like any
    writer, not fail their first call."""
    import time

    from rdq_core.errors import StorageUnavailable

    path = tmp_path / "rdq.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another opener, first to the new, empty file
    store = open_storage(f"sqlite:///{path}?timeout=0.3")
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            store.migrate()
        assert 0.25 <= time.monotonic() - started < 3
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.migrate()
    assert store.stats("q").pending == 0
    store.close()
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    check.close()
