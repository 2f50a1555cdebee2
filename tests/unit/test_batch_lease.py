"""The lease has one owner per batch: given when the batch starts, never reassigned.

A Lambda worker claims each batch with a shorter lease than the one before (the rest of the
invocation plus a grace), and with ``HandlerConcurrency`` several batches run at once on one
runner. Each batch must renew with its own lease: one batch's lease written into a shared field
would let a neighbour's ``extend_lease`` renew to the wrong length.
"""
from __future__ import annotations

import threading
from datetime import datetime, timezone

from rdq_core.engine.claiming import ClaimLoop
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import TaskStatus
from rdq_core.engine.runner import BatchRunner
from rdq_core.storage.spi import Storage

DEFAULT_LEASE = 300.0


def _lease_left(storage: Storage, task_id: str) -> float:
    task = storage.get(task_id)
    assert task is not None and task.lease_expires_at is not None
    return (task.lease_expires_at - datetime.now(timezone.utc)).total_seconds()


def _enqueue(storage: Storage, queue: str, task_id: str) -> None:
    from rdq_core.client import build_new_task

    storage.enqueue([build_new_task(queue, {"handler": "extend_and_wait", "id": task_id})])


def test_concurrent_batches_each_renew_with_the_lease_they_were_claimed_with(storage: Storage) -> None:
    both_extended = threading.Barrier(2, timeout=30)
    leases_seen: dict[str, float] = {}
    registry = HandlerRegistry()

    def extend_and_wait(payload: object, ctx) -> None:
        ctx.extend_lease(1.0)  # asks for less than a lease: renews to the batch's own lease
        leases_seen[ctx.task_id] = _lease_left(storage, ctx.task_id)
        both_extended.wait()  # both batches are in flight at once

    registry.register("extend_and_wait", extend_and_wait, timeout_seconds=60)

    runner = BatchRunner(storage, registry=registry, lease_seconds=DEFAULT_LEASE)
    _enqueue(storage, "short", "t-short")
    _enqueue(storage, "long", "t-long")
    short = storage.claim("short", 1, 20.0)
    long = storage.claim("long", 1, 120.0)
    threads = [threading.Thread(target=runner.run, args=(claimed,), kwargs={"lease_seconds": lease})
               for claimed, lease in ((short, 20.0), (long, 120.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert 15 < leases_seen["t-short"] <= 20.5
    assert 110 < leases_seen["t-long"] <= 120.5
    assert {storage.get(t).status for t in ("t-short", "t-long")} == {TaskStatus.SUCCEEDED}  # type: ignore[union-attr]
    assert runner.lease_seconds == DEFAULT_LEASE  # nothing wrote a batch's lease into the runner


def test_a_claim_loop_hands_each_batch_the_lease_it_claimed_it_with(storage: Storage) -> None:
    leases = iter([40.0, 90.0])
    seen: dict[str, float] = {}
    registry = HandlerRegistry()

    def extend_and_wait(payload: object, ctx) -> None:
        ctx.extend_lease()
        seen[ctx.queue] = _lease_left(storage, ctx.task_id)

    registry.register("extend_and_wait", extend_and_wait, timeout_seconds=60)

    for queue in ("first", "second"):
        _enqueue(storage, queue, f"t-{queue}")
    runner = BatchRunner(storage, registry=registry, lease_seconds=DEFAULT_LEASE)
    loop = ClaimLoop(storage, runner, queues=lambda: ("first", "second"), batch_size=1,
                     lease_seconds=lambda: next(leases))
    loop.run_round()

    assert 35 < seen["first"] <= 40.5
    assert 85 < seen["second"] <= 90.5
    assert runner.lease_seconds == DEFAULT_LEASE
