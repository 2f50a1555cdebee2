"""Bulk operations on this store: one running operation per queue, decided by the store however
many starters race (threads on their own connections, and separate processes); a start that died
half-way never locks a queue; ``rdq.operation.finished`` says what the stored operation says,
whichever of a cancel and the last chunk wins; and a stored rate outside the bounds, or an
operation whose document cannot be read, never stops the others from advancing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable

from ..engine import operations
from ..errors import TaskConflict
from ..events import OPERATION_FINISHED, EventSettings, OutboxEvent
from ..model import TaskFilter
from ..engine.operations import Operation, advance_operation, cancel_operation, drive_operations, get_operation, start_operation
from ..storage import open_storage
from ..storage.spi import Storage
from .support import OpenStore, dead_letter, race_processes

#: Long enough for any store here to finish a few chunks; the tests end as soon as they are done.
DRIVE_SECONDS = 30.0


def start_at_barrier(storage_url: str, barrier: Any, queue: str, action: str, answers: Any) -> None:
    """One starting process: open the store, wait for the others, start; report the outcome."""
    store = open_storage(storage_url)
    try:
        selection = TaskFilter()
        barrier.wait(60)
        try:
            answers.put(("started", start_operation(store, action=action, queue=queue, selection=selection,
                                                    all=True).id))
        except TaskConflict:
            answers.put(("conflict", ""))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        answers.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()


def _race(starters: list[Callable[[], Operation]]) -> list[Operation | BaseException]:
    """Run every starter on its own thread, released together; what each returned or raised."""
    barrier = threading.Barrier(len(starters))
    outcomes: list[Operation | BaseException] = [TaskConflict("not run")] * len(starters)

    def run(index: int) -> None:
        barrier.wait(30)
        try:
            outcomes[index] = starters[index]()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(starters))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def _finished_events(storage: Storage, operation_id: str) -> list[OutboxEvent]:
    """Every ``rdq.operation.finished`` the outbox holds for the operation (taken and acked)."""
    found: list[OutboxEvent] = []
    while batch := storage.take_events(100, lease_seconds=30):
        storage.ack_events([event.id for event in batch])
        found += [e for e in batch if e.type == OPERATION_FINISHED and e.detail.get("operation_id") == operation_id]
    return found


def _last_chunk(storage: Storage, operation_id: str) -> Operation:
    return advance_operation(storage, get_operation(storage, operation_id))[0]


class _BeforeWrite:
    """The store, except that ``hook`` runs once, right before the first write of an operation
    document whose status is ``status``: an interleaving that otherwise happens only by chance."""

    def __init__(self, storage: Storage, status: str, hook: Callable[[], object]) -> None:
        self._storage, self._status, self._hook, self._fired = storage, status, hook, False

    def put_document(self, kind: str, key: str, body: Any, *, expected_version: int | None) -> Any:
        if kind == operations.OPERATION and body.get("status") == self._status and not self._fired:
            self._fired = True
            self._hook()
        return self._storage.put_document(kind, key, body, expected_version=expected_version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


class OperationLockCompliance:
    """The operation lock, the finished event and robust advancing (see the module docstring)."""

    @staticmethod
    def _events_on(*stores: Storage) -> None:
        for store in stores:
            store.configure_events(EventSettings(enabled=True))

    # -- one running operation per queue ---------------------------------------------------------
    def test_concurrent_starters_on_their_own_connections_start_exactly_one_operation(
            self, storage: Storage, open_another: OpenStore) -> None:
        dead_letter(storage, "op-race", 6)
        stores = [open_another() for _ in range(6)]
        for round_no in range(3):
            outcomes = _race([partial(start_operation, store, action="redrive", queue="op-race",
                                      selection=TaskFilter(), all=True) for store in stores])
            started = [o for o in outcomes if isinstance(o, Operation)]
            assert len(started) == 1, f"round {round_no}: {outcomes}"
            assert all(isinstance(o, TaskConflict) for o in outcomes if not isinstance(o, Operation)), outcomes
            running = operations.list_operations(storage, queue="op-race", running_only=True)
            assert [op.id for op in running] == [started[0].id]
            drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
            assert get_operation(storage, started[0].id).status == operations.SUCCEEDED
            if round_no == 0:
                assert get_operation(storage, started[0].id).done == 6, "the one started runs to completion"
                assert storage.stats("op-race").dead == 0
        every = operations.list_operations(storage, queue="op-race")
        assert len(every) == 3 and all(op.status == operations.SUCCEEDED for op in every), every

    def test_concurrent_starters_in_separate_processes_start_exactly_one_operation(
            self, storage: Storage, storage_url: str) -> None:
        dead_letter(storage, "op-procs", 4)
        workers = 4
        outcomes = race_processes(start_at_barrier, workers, timeout=90, args=lambda barrier, answers: (
            storage_url, barrier, "op-procs", "redrive", answers))
        assert sorted(kind for kind, _ in outcomes) == ["conflict"] * (workers - 1) + ["started"], outcomes
        started = next(op_id for kind, op_id in outcomes if kind == "started")
        drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
        finished = get_operation(storage, started)
        assert (finished.status, finished.done) == (operations.SUCCEEDED, 4)
        assert len(operations.list_operations(storage, queue="op-procs")) == 1, "no second operation was written"

    def test_a_redrive_and_a_purge_started_together_on_one_queue_cannot_both_start(
            self, storage: Storage, open_another: OpenStore) -> None:
        dead_letter(storage, "op-mixed", 3, error_type="err.A")
        dead_letter(storage, "op-mixed", 3, error_type="err.B")
        first, second = open_another(), open_another()
        outcomes = _race([
            lambda: start_operation(first, action="redrive", queue="op-mixed", selection=TaskFilter(error_type="err.A")),
            lambda: start_operation(second, action="purge", queue="op-mixed", selection=TaskFilter(error_type="err.B")),
        ])
        started = [o for o in outcomes if isinstance(o, Operation)]
        assert len(started) == 1 and sum(isinstance(o, TaskConflict) for o in outcomes) == 1, outcomes
        drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
        finished = get_operation(storage, started[0].id)
        assert (finished.status, finished.done) == (operations.SUCCEEDED, 3), finished
        assert storage.stats("op-mixed").dead == 3, "the other half is untouched"
        assert operations.list_operations(storage, running_only=True) == []

    def test_a_start_that_died_after_taking_the_lock_runs_and_keeps_the_queue(self, storage: Storage) -> None:
        dead_letter(storage, "op-crash", 3)
        now = storage.now()
        orphan = Operation(id="0000orphanstart", action="redrive", queue="op-crash", selection={"all": True},
                           status=operations.RUNNING, matched=3, started_at=now, updated_at=now, next_chunk_at=now)
        operations._take_lock(storage, orphan)  # the starter dies here: no operation document
        try:
            start_operation(storage, action="purge", queue="op-crash", selection=TaskFilter(), all=True)
            raise AssertionError("a second operation started while the first one's start was pending")
        except TaskConflict as exc:
            assert orphan.id in str(exc)
        drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
        assert (get_operation(storage, orphan.id).status, get_operation(storage, orphan.id).done) == (
            operations.SUCCEEDED, 3)
        assert storage.stats("op-crash").dead == 0
        # And the queue is free again.
        assert start_operation(storage, action="purge", queue="op-crash", selection=TaskFilter(), all=True).matched == 0

    # -- the finished event follows the write that won -------------------------------------------
    def test_a_cancel_that_loses_to_the_last_chunk_writes_no_cancelled_event(
            self, storage: Storage, open_another: OpenStore) -> None:
        other = open_another()
        self._events_on(storage, other)
        dead_letter(storage, "op-ev-a", 2)
        operation = start_operation(storage, action="redrive", queue="op-ev-a", selection=TaskFilter(), all=True)
        # The last chunk runs, and finishes the operation, while the cancel is about to write.
        racing = _BeforeWrite(storage, operations.CANCELLED,
                              lambda: advance_operation(other, get_operation(other, operation.id)))
        try:
            cancel_operation(racing, operation.id)  # type: ignore[arg-type]
            raise AssertionError("the cancel won over a finished operation")
        except TaskConflict:
            pass
        stored = get_operation(storage, operation.id)
        events = _finished_events(storage, operation.id)
        assert stored.status == operations.SUCCEEDED
        assert [e.detail["status"] for e in events] == [operations.SUCCEEDED], "the event says what was stored"

    def test_a_last_chunk_that_loses_to_a_cancel_writes_no_succeeded_event(
            self, storage: Storage, open_another: OpenStore) -> None:
        other = open_another()
        self._events_on(storage, other)
        dead_letter(storage, "op-ev-b", 2)
        operation = start_operation(storage, action="redrive", queue="op-ev-b", selection=TaskFilter(), all=True)
        racing = _BeforeWrite(storage, operations.SUCCEEDED, lambda: cancel_operation(other, operation.id))
        advance_operation(racing, operation)  # type: ignore[arg-type]
        stored = get_operation(storage, operation.id)
        events = _finished_events(storage, operation.id)
        assert stored.status == operations.CANCELLED
        assert [e.detail["status"] for e in events] == [operations.CANCELLED]

    def test_a_cancel_racing_the_last_chunk_and_the_event_agree_every_time(
            self, storage: Storage, open_another: OpenStore) -> None:
        canceller, runner = open_another(), open_another()
        self._events_on(storage, canceller, runner)
        for run in range(15):
            queue = f"op-ev-race-{run}"
            dead_letter(storage, queue, 1)
            operation = start_operation(storage, action="redrive", queue=queue, selection=TaskFilter(), all=True)
            outcomes = _race([partial(cancel_operation, canceller, operation.id), partial(_last_chunk, runner, operation.id)])
            stored = get_operation(storage, operation.id)
            drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)  # settles nothing new
            events = _finished_events(storage, operation.id)
            assert [e.detail["status"] for e in events] == [stored.status], (run, stored, outcomes)
            cancelled = isinstance(outcomes[0], Operation)
            assert cancelled == (stored.status == operations.CANCELLED), (run, stored, outcomes)
            if not cancelled:
                assert isinstance(outcomes[0], TaskConflict), outcomes

    def test_a_finisher_that_died_before_its_event_leaves_it_to_the_next_pass(self, storage: Storage) -> None:
        self._events_on(storage)
        dead_letter(storage, "op-ev-crash", 1)
        operation = start_operation(storage, action="redrive", queue="op-ev-crash", selection=TaskFilter(), all=True)
        now = storage.now()
        # The winning write, and nothing after it (no event, the lock still held).
        current = get_operation(storage, operation.id)
        storage.put_document(operations.OPERATION, operation.id,
                             replace(current, status=operations.SUCCEEDED, finished_at=now)._body(),
                             expected_version=current.version)
        assert _finished_events(storage, operation.id) == []
        drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
        assert [e.detail["status"] for e in _finished_events(storage, operation.id)] == [operations.SUCCEEDED]
        assert start_operation(storage, action="purge", queue="op-ev-crash", selection=TaskFilter(), all=True)

    # -- whatever is stored, advancing goes on ------------------------------------------------------
    def test_a_stored_rate_outside_the_bounds_advances_without_error(self, storage: Storage) -> None:
        for queue, rate in (("op-rate-tiny", 5e-324), ("op-rate-small", 1e-12), ("op-rate-text", "fast"),
                            ("op-rate-huge", 1e300), ("op-rate-negative", -3)):
            dead_letter(storage, queue, 2)
            operation = start_operation(storage, action="redrive", queue=queue, selection=TaskFilter(), all=True)
            current = storage.get_document(operations.OPERATION, operation.id)
            assert current is not None
            storage.put_document(operations.OPERATION, operation.id, {**current.body, "rate_per_second": rate},
                                 expected_version=current.version)
        report = drive_operations(storage, deadline=time.monotonic() + 2.0)
        assert report.failed == [], report
        # Each took at least its first chunk, so none is stuck at done=0.
        for op in operations.list_operations(storage):
            assert op.done >= 1, op
        # The huge rate is taken as the ceiling: it finishes; the others go on at the floor.
        huge = operations.list_operations(storage, queue="op-rate-huge")[0]
        assert huge.status == operations.SUCCEEDED and storage.stats("op-rate-huge").dead == 0

    def test_an_operation_that_cannot_be_read_does_not_stop_the_others(self, storage: Storage) -> None:
        dead_letter(storage, "op-poisoned", 2)
        dead_letter(storage, "op-healthy", 2)
        poisoned = start_operation(storage, action="redrive", queue="op-poisoned", selection=TaskFilter(), all=True)
        current = storage.get_document(operations.OPERATION, poisoned.id)
        assert current is not None
        storage.put_document(operations.OPERATION, poisoned.id, {**current.body, "next_chunk_at": "not a time"},
                             expected_version=current.version)
        healthy = start_operation(storage, action="redrive", queue="op-healthy", selection=TaskFilter(), all=True)
        drive_operations(storage, deadline=time.monotonic() + DRIVE_SECONDS)
        assert get_operation(storage, healthy.id).status == operations.SUCCEEDED
        assert storage.stats("op-healthy").dead == 0 and storage.stats("op-poisoned").dead == 2

