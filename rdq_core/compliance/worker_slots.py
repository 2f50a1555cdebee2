"""Worker slots on this store: a fleet's cap holds under racing takers (threads on their own
connections, and separate processes), a killed holder's slot comes back after its lease and not
before, renew and free are fenced by the token, and a lowered cap lets no more than itself run.

Overlap is measured from instants read from the store's clock *inside* each holding: after the
take returned and before the free was sent. Each recorded interval lies within the real one, so
more than ``cap`` overlapping recorded intervals proves more than ``cap`` real holders.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import replace
from datetime import datetime
from typing import Any

import pytest

from ..errors import InvalidInput
from ..storage import open_storage
from ..storage.spi import Storage, WorkerSlot
from .support import OpenStore, present, race_processes, wait_until

#: Seconds each racing claimant keeps taking and freeing.
RACE_SECONDS = 2.5


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals that share an instant (an end and a start at one instant do not)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                   key=lambda edge: (edge[0], edge[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def hold_and_free_until(store: Storage, fleet: str, cap: int, until: float) -> list[tuple[datetime, datetime]]:
    """Take, hold briefly and free slots until ``until`` (monotonic); the holding intervals."""
    held: list[tuple[datetime, datetime]] = []
    while time.monotonic() < until:
        slot = store.take_worker_slot(fleet, cap, 30)
        if slot is None:
            time.sleep(random.uniform(0.005, 0.03))
            continue
        began = store.now()
        time.sleep(random.uniform(0.03, 0.08))
        ended = store.now()
        held.append((began, ended))
        assert store.free_worker_slot(slot), "a holder frees its own slot"
    return held


def claimant_process(storage_url: str, fleet: str, cap: int, seconds: float, barrier: Any, answers: Any) -> None:
    """One claimant process: its own connection, released with the others, then hold and free."""
    store = open_storage(storage_url)
    try:
        barrier.wait(60)
        answers.put(("held", hold_and_free_until(store, fleet, cap, time.monotonic() + seconds)))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        answers.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()


def hold_until_killed(storage_url: str, fleet: str, lease_seconds: float, answers: Any) -> None:
    """Take a slot, say which, and sleep until SIGKILLed (never freeing it)."""
    store = open_storage(storage_url)
    slot = store.take_worker_slot(fleet, 1, lease_seconds)
    answers.put(None if slot is None else (slot.number, slot.expires_at))
    time.sleep(600)


class WorkerSlotCompliance:
    short_lease: float

    def test_fifty_threads_on_their_own_connections_never_hold_more_than_the_cap(
            self, storage: Storage, open_another: OpenStore) -> None:
        cap, claimants = 4, 50
        stores = [open_another() for _ in range(claimants)]
        barrier = threading.Barrier(claimants)
        intervals: list[tuple[datetime, datetime]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def claim(store: Storage) -> None:
            try:
                barrier.wait(60)
                found = hold_and_free_until(store, "kit-threads", cap, time.monotonic() + RACE_SECONDS)
                with lock:
                    intervals.extend(found)
            except BaseException as exc:  # noqa: BLE001 - the test fails with it below
                errors.append(exc)

        threads = [threading.Thread(target=claim, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors[:3]
        assert len(intervals) >= cap, f"the racing claimants held only {len(intervals)} slots"
        assert max_overlap(intervals) <= cap, f"{max_overlap(intervals)} holders at once on a cap of {cap}"
        assert storage.worker_slots_held("kit-threads") == 0, "every slot was freed"

    def test_claimants_in_separate_processes_never_hold_more_than_the_cap(
            self, storage: Storage, storage_url: str) -> None:
        cap, processes = 2, 5
        outcomes = race_processes(claimant_process, processes, timeout=90, args=lambda barrier, answers: (
            storage_url, "kit-procs", cap, RACE_SECONDS, barrier, answers))
        assert all(kind == "held" for kind, _ in outcomes), outcomes
        intervals = [interval for _, held in outcomes for interval in held]
        assert len(intervals) >= cap
        assert max_overlap(intervals) <= cap, f"{max_overlap(intervals)} holders at once on a cap of {cap}"

    def test_a_killed_holders_slot_comes_back_after_its_lease_and_not_before(
            self, storage: Storage, storage_url: str) -> None:
        lease = 1.5
        context = multiprocessing.get_context("spawn")
        answers = context.Queue()
        holder = context.Process(target=hold_until_killed, args=(storage_url, "kit-killed", lease, answers))
        holder.start()
        try:
            taken = answers.get(timeout=60)
            assert taken is not None, "the holder took the only slot"
            assert holder.pid is not None
            os.kill(holder.pid, signal.SIGKILL)
        finally:
            holder.join(10)
        _, expires_at = taken
        assert storage.take_worker_slot("kit-killed", 1, 30) is None, "the dead holder's lease still runs"
        assert storage.worker_slots_held("kit-killed") == 1
        # Keep asking; every refusal is before the lease's end, and the take after it succeeds.
        while True:
            asked_at = storage.now()
            slot = storage.take_worker_slot("kit-killed", 1, 30)
            if slot is not None:
                assert (slot.expires_at - expires_at).total_seconds() >= 30, \
                    "the slot came back before its lease ended"
                break
            assert asked_at <= expires_at, "the slot stayed held after its lease ended"
            assert (asked_at - expires_at).total_seconds() < 5
            time.sleep(0.05)
        assert storage.worker_slots_held("kit-killed") == 1

    def test_renew_and_free_are_fenced_by_the_token(self, storage: Storage) -> None:
        slot = storage.take_worker_slot("kit-fence", 1, 30)
        assert slot is not None and slot.number == 0
        forged = replace(slot, token="0" * 32)
        assert storage.renew_worker_slot(forged, 60) is None
        assert not storage.free_worker_slot(forged)
        assert storage.worker_slots_held("kit-fence") == 1, "a wrong token changed nothing"
        assert storage.take_worker_slot("kit-fence", 1, 30) is None
        renewed = storage.renew_worker_slot(slot, 60)
        assert renewed is not None and renewed.token == slot.token and renewed.expires_at > slot.expires_at
        assert storage.free_worker_slot(slot)
        assert not storage.free_worker_slot(slot), "freed once"
        assert storage.renew_worker_slot(slot, 60) is None, "a freed slot is not revived by its old token"
        assert storage.worker_slots_held("kit-fence") == 0

    def test_a_holder_whose_lease_ran_out_cannot_renew_or_free_the_next_holders_slot(self, storage: Storage) -> None:
        first = storage.take_worker_slot("kit-stale", 1, self.short_lease)
        assert first is not None
        wait_until(lambda: storage.now() > first.expires_at, timeout=10, what="the first lease to run out")
        assert storage.renew_worker_slot(first, 30) is None, "a lease that ran out is not revived"
        second = present(storage.take_worker_slot("kit-stale", 1, 30), "the slot back after its lease")
        assert second.number == first.number and second.token != first.token
        assert storage.renew_worker_slot(first, 30) is None
        assert not storage.free_worker_slot(first)
        assert storage.worker_slots_held("kit-stale") == 1 and storage.take_worker_slot("kit-stale", 1, 30) is None
        assert storage.free_worker_slot(second)

    def test_a_lowered_cap_lets_no_more_than_itself_run(self, storage: Storage) -> None:
        held = {}
        for _ in range(4):
            slot = storage.take_worker_slot("kit-lowered", 4, 30)
            assert slot is not None
            held[slot.number] = slot
        assert sorted(held) == [0, 1, 2, 3]
        assert storage.take_worker_slot("kit-lowered", 2, 30) is None
        for number in (0, 1):
            assert storage.free_worker_slot(held.pop(number))
        # Slots 2 and 3 are above the new cap of 2 and still held: they fill it.
        assert storage.worker_slots_held("kit-lowered") == 2
        assert storage.take_worker_slot("kit-lowered", 2, 30) is None
        assert storage.free_worker_slot(held.pop(2))
        one: WorkerSlot | None = storage.take_worker_slot("kit-lowered", 2, 30)
        assert one is not None and one.number == 0, "below the new cap, one under it per holder above it"
        assert storage.take_worker_slot("kit-lowered", 2, 30) is None
        assert storage.free_worker_slot(held.pop(3))
        two = storage.take_worker_slot("kit-lowered", 2, 30)
        assert two is not None and two.number == 1
        assert storage.take_worker_slot("kit-lowered", 2, 30) is None
        assert storage.worker_slots_held("kit-lowered") == 2

    def test_a_full_fleet_answers_in_one_round_trip(self, storage: Storage) -> None:
        for _ in range(3):
            assert storage.take_worker_slot("kit-full", 3, 30) is not None
        before = storage.round_trips
        assert storage.take_worker_slot("kit-full", 3, 30) is None
        assert storage.round_trips - before == 1, "a full fleet is one read"

    def test_fleets_are_separate_and_names_are_checked(self, storage: Storage) -> None:
        assert storage.take_worker_slot("kit_fleet", 1, 30) is not None
        assert storage.take_worker_slot("kit_fleet", 1, 30) is None
        for other in ("kit-fleet", "kit~5Ffleet", "kit_fleet2", "kit"):
            slot = storage.take_worker_slot(other, 1, 30)
            assert slot is not None and slot.fleet == other, other
        for fleet, cap, lease in (("", 1, 30), ("kit", 0, 30), ("kit", 10_000, 30), ("kit", 1, 0),
                                  ("kit", True, 30), ({"$ne": ""}, 1, 30), ("x" * 300, 1, 30)):
            with pytest.raises(InvalidInput):
                storage.take_worker_slot(fleet, cap, lease)  # type: ignore[arg-type]  # deliberately wrong values
