"""Exactly-once effects: a handler completes its task inside its own database transaction.

```python
@handler("ship_order")
def ship_order(payload, ctx):
    with ctx.transaction() as tx:                  # or ctx.transaction(connection=app_conn)
        tx.connection.execute("INSERT INTO shipments (order_id) VALUES (%s)", (payload["order"],))
        tx.enqueue("emails", "send_receipt", {"order": payload["order"]})   # exists iff this commits
        tx.result = {"shipped": payload["order"]}
```

When the block ends without an exception, the task's completion (SUCCEEDED, ``tx.result``, its
SUCCESS attempt) is written in that same transaction, fenced by the claim token, and the
transaction commits: the handler's writes and the completion are one atomic step. If the claim no
longer holds (the lease expired and the reaper took the task back), the fenced write matches
nothing, everything is rolled back and the block raises ``ClaimLost``; the attempt stands as the
reaper recorded it (LEASE_EXPIRED) and the task runs again. An exception inside the block rolls
back and propagates: the ordinary failed attempt, retried under the task's policy.

Once committed, the outcome is durable: the runner writes nothing more for the task (it is not
buffered, the heartbeat stops renewing it), so a crash after the commit never runs it again.

Only stores that ``joins_transactions`` (PostgreSQL, SQLite) can do this; elsewhere
``ctx.transaction()`` raises ``UnsupportedOperation`` rather than quietly being at-least-once.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Unpack

from . import tracecontext
from ..errors import ClaimLost, InvalidInput, UnsupportedOperation
from ..model import ClaimedTask, Outcome, Settlement, Task, TaskStatus
from .new_tasks import EnqueueOptions, build_new_task, check_enqueue_options, written_or_conflict
from .outcomes import result_problem
from .payloads import REF_HEADER, finished, reserved_result_problem
from ..storage.spi import Storage


class HandlerTransaction:
    """What ``with ctx.transaction() as tx`` gives the handler."""

    def __init__(self, connection: Any, storage: Storage) -> None:
        #: The DB-API connection the transaction is open on: run the handler's statements on it.
        self.connection = connection
        #: The task's result, stored with its completion (plain JSON, at most 64 KiB; a larger one
        #: is refused here, as the payload store is not part of the transaction).
        self.result: Any = None
        self._storage = storage

    def enqueue(self, queue: str, handler: str, payload: Any = None, *, traceparent: str | None = None,
                tracestate: str | None = None, **options: Unpack[EnqueueOptions]) -> Task:
        """``Client.enqueue`` inside this transaction: the task exists if and only if it commits.

        The payload stays inline (at most ``Limits.payload_bytes``): the payload store is not part
        of the transaction, so a larger one is refused here, as a larger result is."""
        fields = {"handler": handler, "payload": payload, **check_enqueue_options(options)}
        (new_task,) = tracecontext.stamped([build_new_task(queue, fields)],
                                           tracecontext.enqueue_headers(traceparent, tracestate))
        (result,) = self._storage.enqueue([new_task], connection=self.connection)
        return written_or_conflict(new_task, result).task


class Completion:
    """One run's completion inside a transaction: at most one transaction per run, and what
    became of it -- committed (the task SUCCEEDED with it) or lost (fenced out) -- so the runner
    writes nothing more for the task. ``on_settled`` is called once either is known (the runner
    stops renewing the claim)."""

    def __init__(self, storage: Storage, item: ClaimedTask, *, started_after_seconds: float | None = None,
                 on_settled: Callable[[], None] = lambda: None) -> None:
        self._storage = storage
        self._item = item
        self._started_after_seconds = started_after_seconds
        self._on_settled = on_settled
        self._lock = threading.Lock()
        self._open = False
        #: The completion written, once its transaction committed.
        self.committed: Settlement | None = None
        #: The claim was found lost when the transaction tried to complete the task.
        self.lost = False

    @property
    def settled(self) -> bool:
        """The task's outcome for this run is already decided in the store: write nothing more."""
        return self.committed is not None or self.lost

    @property
    def in_transaction(self) -> bool:
        return self._open

    def transaction(self, connection: Any = None) -> AbstractContextManager[HandlerTransaction]:
        if not getattr(self._storage, "joins_transactions", False):
            name = getattr(self._storage, "store_name", type(self._storage).__name__)
            raise UnsupportedOperation(
                f"ctx.transaction(): the {name} backend cannot complete a task inside a database transaction, "
                "so effects cannot be made exactly-once there (PostgreSQL and SQLite can); write an idempotent "
                "handler instead")
        with self._lock:
            if self._open or self.settled:
                raise UnsupportedOperation("ctx.transaction(): one transaction per run, and this run's "
                                           + ("is still open" if self._open else "has already ended"))
            self._open = True
        try:
            return self._run(connection)
        except BaseException:
            self._open = False
            raise

    @contextmanager
    def _run(self, connection: Any) -> Iterator[HandlerTransaction]:
        try:
            opened = self._storage.begin_transaction(connection)
            tx = HandlerTransaction(opened.connection, self._storage)
            try:
                yield tx
                settlement = self._settlement(tx.result)
                applied = self._storage.settle_in_transaction(opened.connection, settlement)
            except BaseException:
                opened.rollback()
                raise
            if not applied:
                opened.rollback()
                self.lost = True
                self._on_settled()
                raise ClaimLost(self._item.task.id)
            # A commit that fails leaves its fate unknown: the runner then settles as for any
            # exception, and the fence makes that settle a no-op if the commit did happen.
            opened.commit()
            self.committed = settlement
            self._on_settled()
            if REF_HEADER in self._item.task.headers:
                finished(self._item.task)  # its payload object may now expire, as after any success
        finally:
            self._open = False

    def _settlement(self, result: Any) -> Settlement:
        problem = result_problem(result) if result is not None else None
        problem = problem or (reserved_result_problem(result) if result is not None else None)
        if problem is not None:
            raise InvalidInput(f"tx.result: {problem}", field="result")
        return Settlement(self._item.task.id, self._item.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED,
                          result=result, started_after_seconds=self._started_after_seconds)
