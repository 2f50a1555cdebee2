"""Bounded calls: a batch costs a constant number of round trips (the backend's declared budget),
and an unreachable server makes every call raise ``StorageUnavailable`` in bounded time."""

from __future__ import annotations

import socket
import time
from typing import Callable

import pytest

from ..errors import StaleClaim, StorageUnavailable
from ..model import ClaimedTask, ClaimRef, DeadFilter, ErrorInfo, Outcome, Settlement, TaskStatus
from ..storage import open_storage
from ..storage.spi import Storage
from .capabilities import OPERATIONS, Capabilities, PerTask
from .support import NEVER_ISSUED, dead_letter, enqueue_n, new_task, retry, success, wait_until

BATCHES = (1, 50)


def _settlement(i: int, claimed: ClaimedTask) -> Settlement:
    if i % 3 == 1:
        return retry(claimed, delay=5)
    if i % 3 == 2:
        return Settlement(claimed.task.id, claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                          error=ErrorInfo("test.Fatal", "no"))
    return success(claimed, {"i": i})


def _prepare(storage: Storage, operation: str, n: int, queue: str, short_lease: float) -> Callable[[], object]:
    """Sets up a batch of ``n`` for ``operation`` and returns the one call to measure."""
    if operation == "enqueue":
        tasks = [new_task(queue, payload={"n": i}) for i in range(n)]
        return lambda: storage.enqueue(tasks)
    if operation == "claim":
        enqueue_n(storage, queue, n)
        # Named, as every worker claims: storing who claimed costs no trip of its own.
        return lambda: storage.claim(queue, n, 30, worker="bounds-worker:1")
    if operation == "stats":
        enqueue_n(storage, queue, n)
        return lambda: storage.stats(queue)
    if operation in ("list_dead", "redrive"):
        dead_letter(storage, queue, n)
        if operation == "list_dead":
            return lambda: storage.list_dead(queue, limit=n)
        return lambda: storage.redrive(queue, DeadFilter())
    if operation == "get":  # one task whose history holds n attempts
        (task_id,) = enqueue_n(storage, queue, 1)
        for _ in range(n):
            (one,) = storage.claim(queue, 1, 30)
            storage.settle([retry(one)])
        return lambda: storage.get(task_id)
    if operation == "find_expired":
        enqueue_n(storage, queue, n)
        storage.claim(queue, n, short_lease)
        wait_until(lambda: len(storage.find_expired_leases(n, queue=queue)) == n, what="the leases to expire")
        return lambda: storage.find_expired_leases(n, queue=queue)
    enqueue_n(storage, queue, n)
    claimed = storage.claim(queue, n, 60)
    if operation == "extend":
        return lambda: storage.extend_leases([c.ref for c in claimed], 120)
    if operation == "release":
        return lambda: storage.release([c.ref for c in claimed])
    if operation == "settle":
        return lambda: storage.settle([_settlement(i, c) for i, c in enumerate(claimed)])
    raise AssertionError(f"no measurement for {operation!r}")


class BoundsCompliance:
    capabilities: Capabilities
    short_lease: float

    @pytest.mark.parametrize("operation", OPERATIONS)
    def test_round_trips_per_call_are_within_the_declared_budget(self, storage: Storage, operation: str) -> None:
        budget = self.capabilities.round_trips.get(operation)
        if budget is None:
            pytest.skip(f"the backend declares no round-trip budget for {operation}")
        spent = {}
        for n in BATCHES:
            call = _prepare(storage, operation, n, f"trips-{operation}-{n}", self.short_lease)
            before = storage.round_trips
            call()
            spent[n] = storage.round_trips - before
        # An int budget is one bound for every batch size: the cost may not grow with the batch
        # (a store may still save a trip on a small one, e.g. MongoDB's get when the task carries
        # its only attempt row).
        allowed = {n: budget.allows(n) if isinstance(budget, PerTask) else budget for n in BATCHES}
        assert all(spent[n] <= allowed[n] for n in BATCHES), f"{operation}: spent {spent}, budget {allowed}"

    def test_an_unreachable_server_makes_every_call_storage_unavailable_in_time(self) -> None:
        template = self.capabilities.unreachable_url
        if template is None:
            pytest.skip("an embedded store has no server to be unreachable")
        with socket.socket() as probe:  # a loopback port that was free, now closed: nothing listens
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        store = open_storage(template.format(port=port))
        ref = ClaimRef("t-unreachable", NEVER_ISSUED)
        calls: dict[str, Callable[[], object]] = {
            "migrate": store.migrate,
            "now": store.now,
            "enqueue": lambda: store.enqueue([new_task("unreachable")]),
            "claim": lambda: store.claim("unreachable", 1, 30),
            "extend": lambda: store.extend_leases([ref], 30),
            "settle": lambda: store.settle([Settlement(ref.task_id, ref.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
            "release": lambda: store.release([ref]),
            "find_expired": lambda: store.find_expired_leases(10),
            "get": lambda: store.get(ref.task_id),
            "cancel": lambda: store.cancel(ref.task_id),
            "list_dead": lambda: store.list_dead("unreachable", limit=10),
            "redrive": lambda: store.redrive("unreachable", DeadFilter()),
            "purge_dead": lambda: store.purge_dead("unreachable", DeadFilter()),
            "stats": lambda: store.stats("unreachable"),
            "list_queues": store.list_queues,
            "purge_succeeded": lambda: store.purge_succeeded(3600, 10),
        }
        wrong: dict[str, str] = {}
        try:
            for name, call in calls.items():
                started = time.monotonic()
                try:
                    call()
                    wrong[name] = "answered"
                except StorageUnavailable:
                    pass
                except StaleClaim:
                    # A token this store could never have issued (its format says so) may be
                    # refused without asking the server: an answer, in bounded time.
                    if name not in ("extend", "settle", "release"):
                        wrong[name] = "raised StaleClaim"
                except Exception as exc:  # noqa: BLE001 - reported below, with every other miss
                    wrong[name] = f"raised {type(exc).__name__}: {exc}"[:200]
                took = time.monotonic() - started
                if took > self.capabilities.unreachable_within:
                    wrong[name] = f"took {took:.1f}s (bound {self.capabilities.unreachable_within:g}s)"
        finally:
            store.close()
        assert wrong == {}, wrong
