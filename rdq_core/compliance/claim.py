"""Claim: oldest due first up to the limit, one queue, fresh tokens and leases from the store's
clock, and never one task to two claimers."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from ..engine.reaper import reap_expired_leases
from ..engine.retry import PolicyBook, RetryPolicy
from ..errors import InvalidInput
from ..flow import FlowPolicy
from ..model import TaskStatus
from ..storage.spi import Storage
from ..validation import Limits
from .support import OpenStore, enqueue_n, must_get, success, wait_until


class ClaimCompliance:
    short_lease: float

    def test_claim_records_who_claimed_while_the_task_is_in_flight(self, storage: Storage) -> None:
        """``claim(worker=...)`` stores the name with the claim; the task shows it as
        ``claimed_by`` while IN_FLIGHT, on the plain and the flow-controlled claim alike, and
        never once the claim has ended or under a later claim that gave no name."""
        worker = "ip-10-0-3-7.internal:4242 billing [réplica λ]"
        enqueue_n(storage, "claimer", 3)
        first, second = storage.claim("claimer", 2, 30, worker=worker)
        assert (first.task.claimed_by, second.task.claimed_by) == (worker, worker)
        assert must_get(storage, first.task.id).claimed_by == worker
        storage.settle([success(first)])
        storage.release([second.ref])
        assert must_get(storage, first.task.id).claimed_by is None, "settled: no longer held"
        assert must_get(storage, second.task.id).claimed_by is None, "released: no longer held"
        (again,) = storage.claim("claimer", 1, 30)
        assert again.task.id == second.task.id
        assert again.task.claimed_by is None and must_get(storage, again.task.id).claimed_by is None, \
            "a claim without a name shows none, not the earlier claimer's"
        (flowed,) = storage.claim("claimer", 1, 30, FlowPolicy(max_in_flight=10), worker="flow:7")
        assert flowed.task.claimed_by == "flow:7" and must_get(storage, flowed.task.id).claimed_by == "flow:7"
        longest = "w" * Limits.worker_chars
        storage.release([flowed.ref])
        (held,) = storage.claim("claimer", 1, self.short_lease, worker=longest)
        assert must_get(storage, held.task.id).claimed_by == longest
        wait_until(lambda: storage.find_expired_leases(10, queue="claimer"), what="the lease to expire")
        assert reap_expired_leases(storage, PolicyBook(RetryPolicy(max_attempts=5)), queue="claimer").expired == 1
        reaped = must_get(storage, held.task.id)
        assert reaped.status is TaskStatus.PENDING and reaped.claimed_by is None, "reaped: no longer held"

    def test_claim_refuses_a_worker_name_it_cannot_show_and_claims_nothing(self, storage: Storage) -> None:
        enqueue_n(storage, "claimer-bad", 2)
        for bad in ("w" * (Limits.worker_chars + 1), "two\nlines", "tab\there", "nul\x00", "\x1b[31mred",
                    "lone \ud800", None, 42, b"bytes"):
            with pytest.raises(InvalidInput) as refused:
                storage.claim("claimer-bad", 2, 30, worker=bad)  # type: ignore[arg-type]  # a bad value on purpose
            assert refused.value.field == "worker"
        counts = storage.stats("claimer-bad")
        assert (counts.pending, counts.in_flight) == (2, 0), "a refused claim takes nothing"

    def test_claim_takes_oldest_due_first_up_to_the_limit(self, storage: Storage) -> None:
        ids = []
        for _ in range(5):
            ids += enqueue_n(storage, "order", 1)
            time.sleep(0.002)
        first = storage.claim("order", 3, 30)
        assert [c.task.id for c in first] == ids[:3]
        second = storage.claim("order", 10, 30)
        assert [c.task.id for c in second] == ids[3:]
        assert storage.claim("order", 10, 30) == []

    def test_claim_stamps_lease_and_fresh_tokens(self, storage: Storage) -> None:
        enqueue_n(storage, "lease", 3)
        before = storage.now()
        claimed = storage.claim("lease", 3, 45)
        after = storage.now()
        tokens = {c.claim_token for c in claimed}
        assert len(tokens) == 3 and all(tokens)
        for c in claimed:
            assert c.task.status is TaskStatus.IN_FLIGHT and c.task.attempts == ()
            held = (c.lease_expires_at - c.claimed_at).total_seconds()
            assert 44 <= held <= 46
            assert before - timedelta(seconds=1) <= c.claimed_at <= after + timedelta(seconds=1)
            assert must_get(storage, c.task.id).status is TaskStatus.IN_FLIGHT
        storage.release([claimed[0].ref])
        (again,) = storage.claim("lease", 1, 45)
        assert again.task.id == claimed[0].task.id and again.claim_token not in tokens

    def test_claim_only_touches_its_queue(self, storage: Storage) -> None:
        enqueue_n(storage, "qa", 2)
        enqueue_n(storage, "qb", 2)
        assert {c.task.queue for c in storage.claim("qa", 10, 30)} == {"qa"}
        assert storage.stats("qb").pending == 2

    def test_claim_of_no_tasks_returns_nothing_and_touches_nothing(self, storage: Storage) -> None:
        """``limit <= 0`` is an empty claim, not an error and not "no limit"."""
        enqueue_n(storage, "none", 2)
        for limit in (0, -1):
            assert storage.claim("none", limit, 30) == []
        assert (storage.stats("none").pending, storage.stats("none").in_flight) == (2, 0)

    def test_concurrent_claimers_never_share_a_task(self, storage: Storage, open_another: OpenStore) -> None:
        total, threads = 240, 8
        enqueue_n(storage, "race", total)
        # Half the claimers share this connection, half have their own: both must be safe.
        stores = [storage] * (threads // 2) + [open_another() for _ in range(threads - threads // 2)]
        seen: list[list[str]] = [[] for _ in range(threads)]
        tokens: list[list[str]] = [[] for _ in range(threads)]
        errors: list[BaseException] = []
        start = threading.Barrier(threads)

        def claimer(index: int) -> None:
            store, rng = stores[index], random.Random(index)
            try:
                start.wait()
                idle = 0
                while idle < 3:
                    claimed = store.claim("race", rng.randint(1, 10), 30)
                    if not claimed:
                        idle += 1
                        continue
                    idle = 0
                    seen[index] += [c.task.id for c in claimed]
                    tokens[index] += [c.claim_token for c in claimed]
                    store.settle([success(c) for c in claimed])
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        workers = [threading.Thread(target=claimer, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not errors, errors
        everything = [task_id for ids in seen for task_id in ids]
        duplicates = [task_id for task_id, n in Counter(everything).items() if n > 1]
        assert duplicates == [], f"{len(duplicates)} task(s) claimed twice"
        assert len(everything) == total
        assert len({t for ts in tokens for t in ts}) == total, "a claim token was issued twice"
        assert storage.stats("race").succeeded == total
