"""Exactly-once effects (``ctx.transaction()``, rdq_core/engine/transactions.py): a handler's writes to
the application's tables and its task's completion commit together, fenced by the claim, or not
at all. Each promise is checked on both paths -- the application's own connection and one of the
store's. A store that cannot (``Capabilities.joins_transactions`` False) must refuse with
``UnsupportedOperation``, never run the block as plain at-least-once."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest

from rdq_testing.app_database import AppDatabase

from ..client import Client
from ..errors import ClaimLost, UnsupportedOperation
from ..engine.handlers import HandlerRegistry, TaskContext
from ..model import Backoff, ClaimedTask, ClaimRef, NewTask, Outcome, TaskStatus
from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..engine.runner import BatchRunner
from ..engine.settling import BatchReport, ClaimLedger
from ..storage import open_storage
from ..storage.spi import Storage
from .capabilities import Capabilities
from .support import OpenStore, must_get, new_task, wait_until

#: Retries come back at once: the tests run the task again straight after a failed attempt.
QUICK_RETRIES = PolicyBook(RetryPolicy(5, Backoff(initial_seconds=0.0, factor=1.0, max_seconds=0.0, jitter=0.0)))

#: The store's own connection, or the application's.
PATHS = ("store_connection", "app_connection")


class _RecordingLedger(ClaimLedger):
    """Which claims were dropped (no longer renewed), and when."""

    def __init__(self) -> None:
        self.dropped: list[ClaimRef] = []

    def drop(self, refs: Any) -> None:
        self.dropped.extend(refs)


def shipping(ship: Callable[[Any, TaskContext], Any]) -> HandlerRegistry:
    """A registry with ``ship`` as the ``ship`` handler."""
    registry = HandlerRegistry()
    registry.register("ship", ship)
    return registry


class ExactlyOnceCompliance:
    capabilities: Capabilities
    short_lease: float

    @pytest.fixture
    def app_db(self, storage_url: str, storage: Storage) -> AppDatabase:
        if not self.capabilities.joins_transactions:
            pytest.skip("this store does not complete tasks inside transactions (see the refusal test)")
        return AppDatabase(storage_url)

    @pytest.fixture(params=PATHS)
    def app_connection(self, request: pytest.FixtureRequest, app_db: AppDatabase) -> Iterator[Callable[[], Any]]:
        """What the handler passes to ``ctx.transaction(connection=...)``: None (the store's own)
        or the application's connection, opened once and closed at teardown."""
        if request.param == "store_connection":
            yield lambda: None
            return
        conn = app_db.connect()
        yield lambda: conn
        conn.close()

    def _run(self, storage: Storage, registry: HandlerRegistry, queue: str, *, lease: float = 30.0,
             ledger: ClaimLedger | None = None) -> tuple[BatchReport, list[ClaimedTask]]:
        claimed = wait_until(lambda: storage.claim(queue, 10, lease), what=f"a task of {queue!r} to claim")
        runner = BatchRunner(storage, QUICK_RETRIES, registry, settle_interval=0.01)
        return runner.run(claimed, ledger=ledger), claimed

    def _ship_one(self, storage: Storage, registry: HandlerRegistry, queue: str, payload: object = None,
                  *, lease: float = 30.0, ledger: ClaimLedger | None = None,
                  ) -> tuple[NewTask, BatchReport, list[ClaimedTask]]:
        """One task of the ``ship`` handler enqueued on ``queue``, claimed and run: the task, the
        batch's report and the claim."""
        item = new_task(queue, "ship", payload)
        storage.enqueue([item])
        report, claimed = self._run(storage, registry, queue, lease=lease, ledger=ledger)
        return item, report, claimed

    def test_a_handler_completes_its_task_in_its_own_transaction(
        self, storage: Storage, app_db: AppDatabase, app_connection: Callable[[], Any],
    ) -> None:
        ledger = _RecordingLedger()
        seen: dict[str, Any] = {}

        def ship(payload: Any, ctx: TaskContext) -> Any:
            with ctx.transaction(connection=app_connection()) as tx:
                app_db.insert(tx.connection, ctx.task_id, ctx.attempt)
                tx.result = {"shipped": payload["order"]}
            seen["dropped_at_commit"] = list(ledger.dropped)  # renewal stopped at the commit
            return "ignored: the transaction's result is the task's"

        registry = shipping(ship)
        item, report, claimed = self._ship_one(storage, registry, "xo-complete", {"order": "o-1"}, ledger=ledger)
        assert (report.started, report.stale, report.outcomes) == (1, 0, {"SUCCESS": 1})
        assert app_db.rows(item.id) == 1
        task = must_get(storage, item.id)
        assert task.status is TaskStatus.SUCCEEDED and task.result == {"shipped": "o-1"}
        assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.SUCCESS)]
        assert seen["dropped_at_commit"] == [claimed[0].ref]

    def test_a_lost_claim_rolls_back_the_handlers_writes_and_the_retry_applies_them_once(
        self, storage: Storage, app_db: AppDatabase, app_connection: Callable[[], Any], open_another: OpenStore,
    ) -> None:
        reaper = open_another()
        raised: list[ClaimLost] = []

        def reap() -> None:
            wait_until(lambda: storage.find_expired_leases(10, queue="xo-lost"), what="the lease to expire")
            assert reap_expired_leases(reaper, QUICK_RETRIES, queue="xo-lost").expired == 1

        def ship(payload: Any, ctx: TaskContext) -> None:
            if ctx.attempt == 1 and app_db.kind == "sqlite":
                reap()  # SQLite's transaction holds the write lock: the reaper runs before it
            try:
                with ctx.transaction(connection=app_connection()) as tx:
                    app_db.insert(tx.connection, ctx.task_id, ctx.attempt)
                    if ctx.attempt == 1 and app_db.kind != "sqlite":
                        reap()  # after the handler's write, before the commit
                    tx.result = {"attempt": ctx.attempt}
            except ClaimLost as exc:
                raised.append(exc)
                raise

        registry = shipping(ship)
        item, report, _ = self._ship_one(storage, registry, "xo-lost", lease=self.short_lease)
        assert len(raised) == 1 and raised[0].task_ids == (item.id,)
        assert report.stale == 1 and report.outcomes == {}
        assert app_db.rows(item.id) == 0
        task = must_get(storage, item.id)
        assert task.status is TaskStatus.PENDING
        assert [a.outcome for a in task.attempts] == [Outcome.LEASE_EXPIRED]

        report, _ = self._run(storage, registry, "xo-lost")
        assert report.outcomes == {"SUCCESS": 1}
        task = must_get(storage, item.id)
        assert task.status is TaskStatus.SUCCEEDED and task.result == {"attempt": 2}
        assert [a.outcome for a in task.attempts] == [Outcome.LEASE_EXPIRED, Outcome.SUCCESS]
        assert app_db.rows(item.id) == 1

    def test_an_exception_inside_the_block_rolls_back_and_the_task_is_retried(
        self, storage: Storage, app_db: AppDatabase, app_connection: Callable[[], Any],
    ) -> None:
        def ship(payload: Any, ctx: TaskContext) -> None:
            with ctx.transaction(connection=app_connection()) as tx:
                app_db.insert(tx.connection, ctx.task_id, ctx.attempt)
                if ctx.attempt == 1:
                    raise RuntimeError("the carrier refused the parcel")

        registry = shipping(ship)
        item, report, _ = self._ship_one(storage, registry, "xo-raise")
        assert report.outcomes == {"RETRYABLE_FAILURE": 1} and report.stale == 0
        assert app_db.rows(item.id) == 0
        assert must_get(storage, item.id).status is TaskStatus.PENDING
        self._run(storage, registry, "xo-raise")
        task = must_get(storage, item.id)
        assert task.status is TaskStatus.SUCCEEDED
        assert [a.outcome for a in task.attempts] == [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS]
        assert app_db.rows(item.id) == 1

    def test_a_follow_up_enqueued_inside_the_block_exists_iff_it_commits(
        self, storage: Storage, app_db: AppDatabase, app_connection: Callable[[], Any],
    ) -> None:
        def ship(payload: Any, ctx: TaskContext) -> None:
            with ctx.transaction(connection=app_connection()) as tx:
                tx.enqueue("xo-receipts", "send_receipt", {"for": ctx.task_id}, id=f"receipt-{ctx.task_id}")
                Client(storage).enqueue("xo-receipts", "audit", id=f"audit-{ctx.task_id}", connection=tx.connection)
                if ctx.attempt == 1:
                    raise RuntimeError("rolled back with its follow-ups")

        registry = shipping(ship)
        item, _, _ = self._ship_one(storage, registry, "xo-follow")
        assert storage.get(f"receipt-{item.id}") is None and storage.get(f"audit-{item.id}") is None
        self._run(storage, registry, "xo-follow")
        assert must_get(storage, item.id).status is TaskStatus.SUCCEEDED
        assert must_get(storage, f"receipt-{item.id}").payload == {"for": item.id}
        assert must_get(storage, f"audit-{item.id}").status is TaskStatus.PENDING

    def test_inside_the_block_a_lease_renewal_is_refused_at_once(
        self, storage: Storage, app_db: AppDatabase,
    ) -> None:
        """It would wait on the transaction's own lock or connection: refused, never a stall."""
        refused: list[BaseException] = []

        def ship(payload: Any, ctx: TaskContext) -> None:
            ctx.extend_lease()  # before the block: fine
            with ctx.transaction() as tx:
                app_db.insert(tx.connection, ctx.task_id, ctx.attempt)
                started = time.monotonic()
                with pytest.raises(UnsupportedOperation) as caught:
                    ctx.extend_lease()
                assert time.monotonic() - started < 1.0
                refused.append(caught.value)
            with pytest.raises(UnsupportedOperation):
                ctx.transaction()  # one transaction per run

        registry = shipping(ship)
        item, _, _ = self._ship_one(storage, registry, "xo-extend")
        assert len(refused) == 1 and app_db.rows(item.id) == 1
        assert must_get(storage, item.id).status is TaskStatus.SUCCEEDED

    def test_a_worker_bounded_to_one_connection_does_not_hang(
        self, storage_url: str, app_db: AppDatabase, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A Lambda worker's PostgreSQL pool is bounded to one connection: the store's own
        transaction takes it, and the settle buffer writing a neighbour's outcome meanwhile waits
        its turn instead of deadlocking (on SQLite, the write lock plays that part)."""
        monkeypatch.setenv("RDQ_PG_MAX_CONNECTIONS", "1")
        store = open_storage(storage_url)
        try:
            def ship(payload: Any, ctx: TaskContext) -> None:
                with ctx.transaction() as tx:
                    app_db.insert(tx.connection, ctx.task_id, ctx.attempt)
                    time.sleep(0.1)  # the buffer's thread flushes the plain task's outcome now

            registry = HandlerRegistry()
            registry.register("ship", ship)
            registry.register("plain", lambda payload, ctx: None)
            items = [new_task("xo-bounded", name) for name in ("plain", "ship", "plain", "ship")]
            for i, item in enumerate(items):
                store.enqueue([item])
                if i < len(items) - 1:
                    time.sleep(0.002)  # claimed in this order
            claimed = store.claim("xo-bounded", 10, 30)
            runner = BatchRunner(store, QUICK_RETRIES, registry, settle_interval=0.01)
            reports: list[BatchReport] = []
            thread = threading.Thread(target=lambda: reports.append(runner.run(claimed)), daemon=True)
            thread.start()
            thread.join(20)
            assert reports, "the batch hung"
            assert reports[0].outcomes == {"SUCCESS": 4} and reports[0].stale == 0
            assert all(must_get(store, item.id).status is TaskStatus.SUCCEEDED for item in items)
            assert [app_db.rows(item.id) for item in items] == [0, 1, 0, 1]
            peak = getattr(getattr(store, "_pool", None), "peak_open", None)
            assert peak in (None, 1), f"{peak} connections opened under a bound of 1"
        finally:
            store.close()

    def test_a_store_that_cannot_refuses_the_transaction(self, storage: Storage) -> None:
        """Never a silent at-least-once: ``UnsupportedOperation``, and the run is a failed attempt."""
        if self.capabilities.joins_transactions:
            pytest.skip("this store completes tasks inside transactions")
        assert not getattr(storage, "joins_transactions", False)
        with pytest.raises(UnsupportedOperation):
            storage.begin_transaction()
        refused: list[BaseException] = []

        def ship(payload: Any, ctx: TaskContext) -> None:
            try:
                ctx.transaction()
            except UnsupportedOperation as exc:
                refused.append(exc)
                raise

        registry = shipping(ship)
        item, report, _ = self._ship_one(storage, registry, "xo-refused")
        assert len(refused) == 1 and "cannot complete a task inside a database transaction" in str(refused[0])
        assert report.outcomes == {"RETRYABLE_FAILURE": 1}
        assert must_get(storage, item.id).status is TaskStatus.PENDING
