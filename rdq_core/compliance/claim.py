"""Claim: oldest due first up to the limit, one queue, fresh tokens and leases from the store's
clock, and never one task to two claimers."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import timedelta

from ..model import TaskStatus
from ..storage.spi import Storage
from .support import OpenStore, enqueue_n, must_get, success


class ClaimCompliance:
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
