"""A worker process for the exactly-once chaos test (``chaos.exactly_once``): the real ``Worker``
running a handler that inserts a row into an application table and completes its task in the
same ``ctx.transaction()``, journaled as ``chaos.worker`` journals (the grammar there, read by
``chaos.journal``).

``python -m rdq_testing.chaos.exactly_once_worker URL QUEUE JOURNAL --app-db PATH_OR_URL
--app-table NAME [--lease S] [--batch N] [--plugin MOD] [--go-file PATH]``

The completion is written inside the handler's transaction and is durable only once COMMIT
returns, so its settle call (``B <seq> settle <ts> tx``) spans both: ``R stale`` when the fenced
write matched nothing (the claim was lost; the transaction is rolled back), ``R ok`` only after
COMMIT returned. A kill between the fenced write and ``R`` leaves the call in flight, which the
history checker reads as "committed or not" and resolves from the store. The handler journals
``F`` once its work is done, before the block closes: what follows is its completion, as a
returning handler's settle follows ``F`` in ``chaos.worker``.

A task's payload names its fate on its first attempt (``FATES``). The handler holds at the fated
point, journaling an ``H`` marker, and the test SIGKILLs the process there or freezes it
(SIGSTOP) until its lease has been reaped::

    kill-in-block        the row inserted, the transaction open           H <task> handler
    kill-before-commit   the fenced completion written in it, no COMMIT   H <seq> tx-settled
    kill-after-commit    COMMIT returned, the handler has not heard       H <seq> tx-committed
    freeze-then-kill     frozen past the lease and reaped, then killed    H <task> freeze, then
                         inside the block                                 H <task> handler
    freeze-then-commit   frozen past the lease and reaped, then thawed:   H <task> freeze
                         its COMMIT is fenced out (ClaimLost)

On PostgreSQL the freeze comes inside the block, after the INSERT. A SQLite transaction holds the
database's write lock from its BEGIN IMMEDIATE, so a process frozen inside one would stop the
reaper as well: there the freeze comes just before the block, and once thawed the handler writes
its row in a transaction begun after the reap.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import threading
import time
from typing import Any, Callable, cast
from urllib.parse import urlsplit

from rdq_core.engine.handlers import HandlerRegistry, TaskContext
from rdq_core.model import Settlement
from rdq_core.storage import open_storage
from rdq_core.storage.spi import OpenTransaction, Storage
from .worker import JournalingStorage, chaos_process_arguments, run_chaos_worker, stamp

HANDLER = "exactly-once-ship"
FATES = ("kill-in-block", "kill-before-commit", "kill-after-commit", "freeze-then-kill", "freeze-then-commit")
FREEZE_FATES = ("freeze-then-kill", "freeze-then-commit")
#: Call-level points the handler's transaction holds at (``H <seq> <point> <ts>``).
COMMIT_POINTS = {"kill-before-commit": "tx-settled", "kill-after-commit": "tx-committed"}
#: The test kills a holding process within milliseconds; the caps turn a miss into a failed
#: assertion about the task's history, never a hang.
KILL_HOLD_SECONDS = 10.0
THAW_WAIT_SECONDS = 60.0


def thaw_path(journal: str, task_id: str) -> str:
    """The file the test creates to let a frozen handler go on (before it sends SIGCONT)."""
    return f"{journal}.thaw-{task_id}"


class _JournaledTransaction:
    """The handler's ``OpenTransaction``: its COMMIT closes the settle call made inside it."""

    def __init__(self, journal: TransactionJournal, inner: OpenTransaction) -> None:
        self.connection = inner.connection
        self._journal = journal
        self._inner = inner
        self.settle_seq: int | None = None

    def commit(self) -> None:
        seq, self.settle_seq = self.settle_seq, None
        if seq is not None:
            self._journal.hold_at(seq, "tx-settled")
        try:
            self._inner.commit()
        except BaseException as exc:
            if seq is not None:
                self._journal.answered(seq, f"error {type(exc).__name__}")
            raise
        if seq is not None:
            # Committed, and nobody knows yet: a kill here is the "after commit" point.
            self._journal.hold_at(seq, "tx-committed")
            self._journal.answered(seq, "ok -")

    def rollback(self) -> None:
        seq, self.settle_seq = self.settle_seq, None
        self._inner.rollback()
        if seq is not None:
            self._journal.answered(seq, "error RolledBack")


class TransactionJournal(JournalingStorage):
    """``JournalingStorage`` that also journals a completion written inside a handler's
    transaction, as one settle call from its fenced write to its COMMIT."""

    def __init__(self, inner: Storage, journal_fd: int, journal_path: str) -> None:
        super().__init__(inner, journal_fd)
        self.journal_path = journal_path
        self._tx = threading.local()

    def begin_transaction(self, connection: Any = None) -> OpenTransaction:
        # The handler's thread runs its whole transaction: begin, settle and commit.
        opened = _JournaledTransaction(self, self._inner.begin_transaction(connection))
        self._tx.open = opened
        return opened

    def settle_in_transaction(self, connection: Any, settlement: Settlement) -> bool:
        with self._lock:
            seq = next(self._seq)
        self.write(f"B {seq} settle {stamp()} tx\n"
                   f"i {seq} {settlement.task_id} {settlement.claim_token} {settlement.outcome.value}\n")
        try:
            applied = self._inner.settle_in_transaction(connection, settlement)
        except BaseException as exc:
            self.answered(seq, f"error {type(exc).__name__}")
            raise
        if not applied:
            self.answered(seq, f"stale {settlement.task_id}")
            return False
        opened = cast(_JournaledTransaction, self._tx.open)
        assert opened.connection is connection, "the completion is written on the handler's own transaction"
        opened.settle_seq = seq  # answered once its COMMIT is
        return True

    def answered(self, seq: int, result: str) -> None:
        self.write(f"R {seq} {stamp()} {result}\nE {seq} {stamp()}\n")

    # -- where the handler's fate holds it ---------------------------------------------------
    def aim(self, point: str | None) -> None:
        """Hold this thread's transaction at ``point`` (``COMMIT_POINTS``) when it gets there."""
        self._tx.aim = point

    def hold_at(self, seq: int, point: str) -> None:
        if getattr(self._tx, "aim", None) == point:
            self._tx.aim = None
            self.write(f"H {seq} {point} {stamp()}\n")
            time.sleep(KILL_HOLD_SECONDS)  # the SIGKILL comes in here

    def hold_for_kill(self, task_id: str) -> None:
        self.event("H", task_id, "handler", stamp())
        time.sleep(KILL_HOLD_SECONDS)

    def hold_for_freeze(self, task_id: str) -> None:
        """Wait, frozen by the test meanwhile, until it lets the handler go on."""
        self.event("H", task_id, "freeze", stamp())
        path = thaw_path(self.journal_path, task_id)
        deadline = time.monotonic() + THAW_WAIT_SECONDS
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"task {task_id}: never thawed")
            time.sleep(0.01)


class AppTable:
    """The application's side of the handler: its table and, for the tasks that ask, its own
    connection to the store's database (the test's ``AppDatabase`` made the table): ``database``
    is the SQLite file's path, or a PostgreSQL URL without rdq's parameters."""

    def __init__(self, kind: str, database: str, table: str) -> None:
        self.kind = kind
        self.database = database
        self.table = table
        self.mark = "?" if kind == "sqlite" else "%s"

    def connect(self) -> Any:
        if self.kind == "sqlite":
            return sqlite3.connect(self.database, timeout=30)
        import psycopg

        return psycopg.connect(self.database)

    def insert(self, conn: Any, task_id: str, attempt: int) -> None:
        conn.execute(f"INSERT INTO {self.table} (task_id, attempt) VALUES ({self.mark}, {self.mark})",
                     (task_id, attempt))


def exactly_once_handler(journal: TransactionJournal, app: AppTable) -> Callable[[Any, TaskContext], None]:
    """The handler: ``{"ms": 40, "app_connection": true, "fate": "kill-in-block"}`` inserts
    (task id, attempt) and works ``ms`` inside one ``ctx.transaction()`` -- on the application's
    own connection or the store's -- and, on the first attempt, meets its fate (``FATES``)."""
    freeze_inside = app.kind != "sqlite"  # see the module doc

    def handle(payload: Any, ctx: TaskContext) -> None:
        fate = payload.get("fate") if ctx.attempt == 1 else None
        journal.event("S", ctx.task_id, stamp(), ctx.attempt, payload["ms"])
        worked = False
        try:
            if fate in FREEZE_FATES and not freeze_inside:
                journal.hold_for_freeze(ctx.task_id)
            conn = app.connect() if payload.get("app_connection") else None
            try:
                with ctx.transaction(connection=conn) as tx:
                    app.insert(tx.connection, ctx.task_id, ctx.attempt)
                    time.sleep(payload["ms"] / 1000)  # the rest of its work, inside the transaction
                    if fate in FREEZE_FATES and freeze_inside:
                        journal.hold_for_freeze(ctx.task_id)
                    if fate in ("kill-in-block", "freeze-then-kill"):
                        journal.hold_for_kill(ctx.task_id)
                    journal.aim(COMMIT_POINTS.get(fate or ""))
                    tx.result = {"attempt": ctx.attempt}
                    # The work is done; the completion follows as the block closes.
                    journal.event("F", ctx.task_id, stamp(), "ok")
                    worked = True
            finally:
                journal.aim(None)
                if conn is not None:
                    conn.close()
        finally:
            if not worked:
                journal.event("F", ctx.task_id, stamp(), "raised")

    return handle


def main() -> None:
    parser = chaos_process_arguments()
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--app-db", required=True)
    parser.add_argument("--app-table", required=True)
    args = parser.parse_args()
    for module in args.plugin:
        importlib.import_module(module)
    fd = os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    storage = TransactionJournal(open_storage(args.url), fd, args.journal)
    registry = HandlerRegistry()
    app = AppTable("sqlite" if urlsplit(args.url).scheme == "sqlite" else "postgresql", args.app_db, args.app_table)
    registry.register(HANDLER, exactly_once_handler(storage, app), timeout_seconds=60.0)
    run_chaos_worker(storage, registry, args)


if __name__ == "__main__":
    main()
