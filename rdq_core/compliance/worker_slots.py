"""Worker slots on this store: a fleet's cap holds under racing takers (threads on their own
connections, and separate processes), a killed holder's slot comes back after its lease and not
before, renew and free are fenced by the token, and a lowered cap lets no more than itself run.
Pending starts (slots reserved for workers being invoked) count against the cap, expire after
their lease, are taken over or cancelled only under their token, and racing starters never
reserve beyond the fleet size they ask for.

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
from ..storage import open_storage, slots
from ..storage.spi import Storage, WorkerSlot, WorkerStart
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


def start_hold_and_free_until(store: Storage, fleet: str, cap: int, fleet_size: int,
                              until: float) -> list[tuple[datetime, datetime]]:
    """As a starter would: reserve starts, take each over as its worker, hold briefly and free;
    the intervals from the reservation to the free."""
    held: list[tuple[datetime, datetime]] = []
    while time.monotonic() < until:
        starts = store.reserve_worker_starts(fleet, cap, 30, fleet_size=fleet_size)
        if not starts:
            time.sleep(random.uniform(0.005, 0.03))
            continue
        began = store.now()
        slots = [store.take_reserved_worker_slot(start, 30) for start in starts]
        assert all(slots), "a pending start is taken over by its worker"
        time.sleep(random.uniform(0.03, 0.08))
        ended = store.now()
        held.extend((began, ended) for _ in slots)
        for slot in slots:
            assert slot is not None and store.free_worker_slot(slot)
    return held


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

    # -- pending starts ------------------------------------------------------------------------
    def test_pending_starts_count_against_the_cap_until_taken_over_or_cancelled(self, storage: Storage) -> None:
        fleet = "kit-starts"
        running = present(storage.take_worker_slot(fleet, 4, 30), "a running worker")
        starts = storage.reserve_worker_starts(fleet, 4, 30, fleet_size=9)
        assert len(starts) == 3, "the fleet size is bounded by the cap: 4, one running"
        assert running.number not in {start.number for start in starts}
        assert storage.worker_slots_held(fleet) == 4 and storage.worker_starts_pending(fleet) == 3
        assert storage.take_worker_slot(fleet, 4, 30) is None, "a pending start is not a free slot"
        assert storage.reserve_worker_starts(fleet, 4, 30, fleet_size=4) == []

        first = present(storage.take_reserved_worker_slot(starts[0], 60), "the worker takes its start over")
        assert first.number == starts[0].number and first.token != starts[0].token
        assert storage.worker_starts_pending(fleet) == 2 and storage.worker_slots_held(fleet) == 4
        assert storage.take_reserved_worker_slot(starts[0], 60) is None, "taken over once"
        assert not storage.cancel_worker_start(starts[0]), "a taken-over start is its worker's"
        assert storage.renew_worker_slot(first, 60) is not None

        forged = replace(starts[1], token="0" * 32)
        assert storage.take_reserved_worker_slot(forged, 60) is None
        assert not storage.cancel_worker_start(forged)
        assert storage.worker_starts_pending(fleet) == 2, "a wrong token changed nothing"
        assert storage.cancel_worker_start(starts[1])
        assert not storage.cancel_worker_start(starts[1]), "cancelled once"
        assert storage.take_reserved_worker_slot(starts[1], 60) is None, "a cancelled start is not taken over"
        assert storage.worker_slots_held(fleet) == 3 and storage.worker_starts_pending(fleet) == 1

        # The fleet is topped up to the size asked for, counting what runs and what is pending.
        assert storage.reserve_worker_starts(fleet, 4, 30, fleet_size=3) == []
        (again,) = storage.reserve_worker_starts(fleet, 4, 30, fleet_size=4)
        assert again.number == starts[1].number
        assert storage.worker_slots_held(fleet) == 4
        for slot in (running, first):
            assert storage.free_worker_slot(slot)
        assert [len(storage.reserve_worker_starts(fleet, 4, 30, fleet_size=4, most=1)) for _ in range(3)] == [1, 1, 0]

    def test_a_start_whose_worker_never_came_frees_itself_after_its_lease(self, storage: Storage) -> None:
        fleet = "kit-start-expiry"
        (start,) = storage.reserve_worker_starts(fleet, 1, self.short_lease, fleet_size=1)
        assert storage.take_worker_slot(fleet, 1, 30) is None, "pending until its lease ends"
        wait_until(lambda: storage.now() > start.expires_at, timeout=10, what="the start's lease to run out")
        assert storage.worker_slots_held(fleet) == 0 and storage.worker_starts_pending(fleet) == 0
        assert storage.take_reserved_worker_slot(start, 30) is None, "a late worker takes a slot the ordinary way"
        slot = present(storage.take_worker_slot(fleet, 1, 30), "the slot back after the start's lease")
        assert slot.number == start.number
        assert not storage.cancel_worker_start(start)
        assert storage.worker_slots_held(fleet) == 1

    def test_racing_starters_never_reserve_beyond_the_fleet_size_they_ask_for(
            self, storage: Storage, open_another: OpenStore) -> None:
        cap, fleet_size, starters, takers = 6, 3, 12, 4
        # Starters alone, each asking for a fleet of 3 on a cap of 6: at most 3 at any instant.
        intervals = self._race(open_another, "kit-start-race", starters, 0, cap, fleet_size)
        assert len(intervals) >= fleet_size
        assert max_overlap(intervals) <= fleet_size, f"{max_overlap(intervals)} workers for a fleet of {fleet_size}"
        assert storage.worker_slots_held("kit-start-race") == 0
        # Starters asking for the whole cap, beside ordinary takers: never beyond the cap.
        mixed = self._race(open_another, "kit-start-mixed", starters, takers, 2, 2)
        assert len(mixed) >= 2 and max_overlap(mixed) <= 2, f"{max_overlap(mixed)} holders at once on a cap of 2"
        assert storage.worker_slots_held("kit-start-mixed") == 0

    def test_a_starter_waits_for_another_starters_decision_instead_of_dropping_its_own(
            self, storage: Storage) -> None:
        """A wake-up that meets another starter deciding (on a backlog read before this one's
        enqueue) must not be dropped: it waits for that decision, then tops the fleet up."""
        fleet = "kit-start-plan"
        plan_key = slots.fleet_prefix(fleet) + slots.PLAN_SUFFIX
        now_micros = int(storage.now().timestamp() * 1_000_000)
        held = present(storage.put_document(slots.SLOT_KIND, plan_key, {
            "token": "another-starter", "expires_at": now_micros + 5_000_000}, expected_version=None), "the plan")

        def other_decision_ends() -> None:
            time.sleep(0.2)
            storage.put_document(slots.SLOT_KIND, plan_key, {"token": None, "expires_at": None},
                                 expected_version=held.version)

        ender = threading.Thread(target=other_decision_ends)
        began = time.monotonic()
        ender.start()
        try:
            starts = storage.reserve_worker_starts(fleet, 3, 30, fleet_size=2)
        finally:
            ender.join()
        assert len(starts) == 2, "the wake-up was dropped while another starter decided"
        assert time.monotonic() - began >= 0.15, "it did not wait for the other decision"
        assert storage.worker_slots_held(fleet) == 2

    def test_start_reservations_check_their_input(self, storage: Storage) -> None:
        for fleet, cap, lease, size, most in (("", 1, 30, 1, None), ("kit", 0, 30, 1, None), ("kit", 1, 0, 1, None),
                                              ("kit", 1, 30, -1, None), ("kit", 1, 30, True, None),
                                              ("kit", 1, 30, 1, -1), ("kit", 1, 30, 1, 1.5)):
            with pytest.raises(InvalidInput):
                storage.reserve_worker_starts(fleet, cap, lease, fleet_size=size, most=most)  # type: ignore[arg-type]
        assert storage.worker_slots_held("kit") == 0, "a refused reservation wrote nothing"
        (start,) = storage.reserve_worker_starts("kit-start-event", 2, 30, fleet_size=1)
        assert WorkerStart.from_event(start.to_event()) == start, "the invoked worker's event carries it whole"
        for bad in (None, "x", {}, {**start.to_event(), "slot": "0"}, {**start.to_event(), "slot": True},
                    {**start.to_event(), "fleet": ""}, {**start.to_event(), "token": 7},
                    {**start.to_event(), "expires_at": "soon"}):
            assert WorkerStart.from_event(bad) is None, bad

    @staticmethod
    def _race(open_another: OpenStore, fleet: str, starters: int, takers: int, cap: int,
              fleet_size: int) -> list[tuple[datetime, datetime]]:
        stores = [open_another() for _ in range(starters + takers)]
        barrier = threading.Barrier(len(stores))
        intervals: list[tuple[datetime, datetime]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def race(store: Storage, starter: bool) -> None:
            try:
                barrier.wait(60)
                until = time.monotonic() + RACE_SECONDS
                found = start_hold_and_free_until(store, fleet, cap, fleet_size, until) if starter \
                    else hold_and_free_until(store, fleet, cap, until)
                with lock:
                    intervals.extend(found)
            except BaseException as exc:  # noqa: BLE001 - the test fails with it below
                errors.append(exc)

        threads = [threading.Thread(target=race, args=(store, n < starters)) for n, store in enumerate(stores)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors[:3]
        return intervals
