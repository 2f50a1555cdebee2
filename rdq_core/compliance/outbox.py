"""Lifecycle events through the outbox (``rdq_core/events.py``): an event is written with the
state change and never without it, a take leases, an ack removes, nothing is lost when the
deliverer dies between taking and acknowledging, and one task's events come in write order."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from ..errors import InvalidInput, StaleClaim
from ..events import OPERATION_FINISHED, TASK_DEAD, TASK_REDRIVEN, TASK_SUCCEEDED, EventSettings, OutboxEvent
from ..model import DeadFilter, Outcome, Settlement, TaskStatus
from ..storage.spi import Storage
from .bounds import _prepare
from .capabilities import Capabilities
from .support import (OpenStore, dead_letter, enqueue_n, fail_permanently, must_get, new_task, retry, success,
                      wait_until)

ON = EventSettings(enabled=True, succeeded=True)


def _change(event_id: str) -> str:
    """A task event's id without its incarnation stamp: ``<task id>:<kind>:<number>``."""
    head, _, stamp = event_id.rpartition(":")
    assert head and stamp, f"{event_id!r} carries no incarnation stamp"
    return head


def _changes(events: list[OutboxEvent]) -> list[str]:
    return [_change(e.id) for e in events]


def _die(storage: Storage, queue: str, task_id: str, *, attempts: int = 1) -> None:
    """Enqueue ``task_id`` and settle it DEAD at its ``attempts``-th attempt."""
    storage.enqueue([new_task(queue, id=task_id, max_attempts=attempts)])
    for attempt in range(1, attempts + 1):
        (claimed,) = storage.claim(queue, 1, 30)
        assert claimed.task.id == task_id
        storage.settle([fail_permanently(claimed) if attempt == attempts else retry(claimed)])


def _all_events(storage: Storage, lease_seconds: float = 60.0) -> list[OutboxEvent]:
    """Everything takeable now (leased by this call)."""
    found: list[OutboxEvent] = []
    while True:
        batch = storage.take_events(10, lease_seconds=lease_seconds)
        if not batch:
            return found
        found += batch


class OutboxCompliance:
    capabilities: Capabilities
    short_lease: float

    def test_no_event_is_written_while_events_are_off(self, storage: Storage) -> None:
        storage.configure_events(EventSettings())
        dead = dead_letter(storage, "ev-off", 2)
        storage.redrive("ev-off", DeadFilter())
        storage.record_events([OutboxEvent("op:x:finished", OPERATION_FINISHED, "ev-off", None, datetime.now(timezone.utc))])
        assert must_get(storage, dead[0]).status is TaskStatus.PENDING
        assert storage.take_events(10, lease_seconds=30) == []

    def test_settle_writes_dead_and_succeeded_events_with_the_change(self, storage: Storage) -> None:
        storage.configure_events(ON)
        ids = enqueue_n(storage, "ev-settle", 3, handler="mail.send")
        claimed = {c.task.id: c for c in storage.claim("ev-settle", 3, 30)}
        died, won, retried = (claimed[i] for i in ids)
        storage.settle([fail_permanently(died, "smtp.Refused"), success(won, {"ok": True}), retry(retried, delay=60)])
        events = {_change(e.id): e for e in _all_events(storage)}
        assert set(events) == {f"{ids[0]}:dead:1", f"{ids[1]}:succeeded:1"}, "a retry writes no event"
        dead, succeeded = events[f"{ids[0]}:dead:1"], events[f"{ids[1]}:succeeded:1"]
        assert (dead.type, dead.queue, dead.task_id) == (TASK_DEAD, "ev-settle", ids[0])
        assert succeeded.type == TASK_SUCCEEDED
        body = dead.to_dict()
        assert body["handler"] == "mail.send" and body["attempt"] == 1 and body["redrive_count"] == 0
        assert body["error"]["type"] == "smtp.Refused" and body["error"]["message"] == "failed on purpose"
        assert "stack" not in body["error"] and "payload" not in body, "no stack, no payload by default"
        assert succeeded.to_dict().get("error") is None
        task = must_get(storage, ids[0])
        assert task.dead_at is not None and abs((dead.at - task.dead_at).total_seconds()) < 5

    def test_a_refused_settle_writes_no_event(self, storage: Storage) -> None:
        storage.configure_events(ON)
        (task_id,) = enqueue_n(storage, "ev-stale", 1)
        (first,) = storage.claim("ev-stale", 1, 30)
        storage.settle([retry(first)])
        (second,) = storage.claim("ev-stale", 1, 30)
        with pytest.raises(StaleClaim):
            storage.settle([fail_permanently(first)])  # the first claim's token is spent
        assert _all_events(storage) == [], "no change, no event"
        storage.settle([fail_permanently(second)])
        assert _changes(_all_events(storage)) == [f"{task_id}:dead:2"]
        with pytest.raises(StaleClaim):
            storage.settle([fail_permanently(second)])
        assert [e.id for e in storage.take_events(10, lease_seconds=30)] == []

    def test_a_settle_the_store_refuses_as_a_whole_writes_no_event(self, storage: Storage) -> None:
        if self.capabilities.holds_nul:
            pytest.skip("the store holds any settlement: none is refused as a whole")
        storage.configure_events(ON)
        enqueue_n(storage, "ev-refused", 2)
        died, odd = storage.claim("ev-refused", 2, 30)
        with pytest.raises(InvalidInput):  # a result it cannot hold: nothing of the batch is written
            storage.settle([fail_permanently(died), success(odd, "a\x00b")])
        assert must_get(storage, died.task.id).status is TaskStatus.IN_FLIGHT
        assert storage.take_events(10, lease_seconds=30) == [], "no change, no event"

    def test_redrive_writes_one_event_per_task_named_by_its_redrive_count(self, storage: Storage) -> None:
        storage.configure_events(ON)
        ids = dead_letter(storage, "ev-redrive", 3)
        storage.ack_events([e.id for e in _all_events(storage)])
        assert storage.redrive("ev-redrive", DeadFilter(ids=(ids[0], ids[1]))) == 2
        events = _all_events(storage)
        assert sorted(_changes(events)) == sorted(f"{i}:redriven:1" for i in ids[:2])
        assert all(e.type == TASK_REDRIVEN and e.to_dict()["redrive_count"] == 1 for e in events)
        assert storage.redrive("ev-redrive", DeadFilter(ids=(ids[0],))) == 0, "not dead any more: no event"
        assert storage.take_events(10, lease_seconds=30) == []

    def test_a_task_id_used_again_after_a_purge_names_new_events(self, storage: Storage) -> None:
        # order-X dies, is purged, is enqueued again with the same id and dies again: a consumer
        # that deduplicates by id must see two deaths, whether the first was delivered or not.
        storage.configure_events(ON)
        queue, task_id = "ev-reuse", "order-X"
        _die(storage, queue, task_id)
        assert storage.purge_dead(queue, DeadFilter()) == 1
        _die(storage, queue, task_id)
        undelivered = _all_events(storage)
        assert _changes(undelivered) == [f"{task_id}:dead:1", f"{task_id}:dead:1"], "both deaths are in the outbox"
        assert len({e.id for e in undelivered}) == 2, "two incarnations, two ids"
        assert storage.ack_events([e.id for e in undelivered]) == 2
        assert storage.purge_dead(queue, DeadFilter()) == 1
        _die(storage, queue, task_id)
        (third,) = _all_events(storage)
        assert _change(third.id) == f"{task_id}:dead:1" and third.id not in {e.id for e in undelivered}

    def test_every_redrive_and_every_incarnations_redrive_has_its_own_event_id(self, storage: Storage) -> None:
        storage.configure_events(ON)
        queue, task_id = "ev-reuse-redrive", "order-R"
        _die(storage, queue, task_id)
        redriven: list[OutboxEvent] = []
        for _ in range(2):
            assert storage.redrive(queue, DeadFilter()) == 1
            (claimed,) = storage.claim(queue, 1, 30)
            storage.settle([fail_permanently(claimed)])
            taken = _all_events(storage)
            redriven += [e for e in taken if e.type == TASK_REDRIVEN]
            storage.ack_events([e.id for e in taken])
        assert _changes(redriven) == [f"{task_id}:redriven:1", f"{task_id}:redriven:2"]
        # The same id again, purged first: its first redrive is a new event, not redriven:1 again.
        assert storage.purge_dead(queue, DeadFilter()) == 1
        _die(storage, queue, task_id)
        assert storage.redrive(queue, DeadFilter()) == 1
        again = [e for e in _all_events(storage) if e.type == TASK_REDRIVEN]
        assert _changes(again) == [f"{task_id}:redriven:1"]
        assert len({e.id for e in redriven + again}) == 3, "no two redrives share an id"

    def test_a_task_id_used_again_after_retention_names_new_succeeded_events(self, storage: Storage) -> None:
        storage.configure_events(ON)
        queue, task_id = "ev-reuse-ok", "order-S"
        seen: list[OutboxEvent] = []
        for _ in range(2):
            storage.enqueue([new_task(queue, id=task_id)])
            (claimed,) = storage.claim(queue, 1, 30)
            storage.settle([success(claimed)])
            wait_until(lambda: storage.purge_succeeded(0, 100) or storage.get(task_id) is None,
                       what="retention to remove the finished task")
            assert storage.get(task_id) is None
            seen += _all_events(storage)
        assert _changes(seen) == [f"{task_id}:succeeded:1", f"{task_id}:succeeded:1"]
        assert len({e.id for e in seen}) == 2

    def test_an_event_keeps_its_id_on_every_redelivery(self, storage: Storage) -> None:
        storage.configure_events(ON)
        dead_letter(storage, "ev-stable", 2)
        first = storage.take_events(10, lease_seconds=self.short_lease)
        again = wait_until(lambda: storage.take_events(10, lease_seconds=self.short_lease), what="the lease to pass")
        assert sorted(e.id for e in again) == sorted(e.id for e in first)
        assert [e.to_dict() for e in sorted(again, key=lambda e: e.id)] == [
            e.to_dict() for e in sorted(first, key=lambda e: e.id)], "the same event, not a rewritten one"

    def test_one_tasks_events_are_taken_in_the_order_they_were_written(self, storage: Storage) -> None:
        storage.configure_events(ON)
        (task_id,) = enqueue_n(storage, "ev-order", 1, max_attempts=1)
        (other,) = enqueue_n(storage, "ev-order-2", 1, max_attempts=1)
        for _ in range(3):
            for queue in ("ev-order", "ev-order-2"):
                (claimed,) = storage.claim(queue, 1, 30)
                storage.settle([fail_permanently(claimed)])
                storage.redrive(queue, DeadFilter())
        taken = _changes(_all_events(storage))
        for tid in (task_id, other):
            mine = [i for i in taken if i.startswith(tid + ":")]
            assert mine == [f"{tid}:dead:1", f"{tid}:redriven:1", f"{tid}:dead:2", f"{tid}:redriven:2",
                            f"{tid}:dead:3", f"{tid}:redriven:3"]

    def test_a_take_leases_its_events_until_the_lease_passes(self, storage: Storage, open_another: OpenStore) -> None:
        storage.configure_events(ON)
        dead_letter(storage, "ev-lease", 3)
        other = open_another()
        first = storage.take_events(2, lease_seconds=60)
        second = other.take_events(10, lease_seconds=self.short_lease)
        assert len(first) == 2 and len(second) == 1
        assert not {e.id for e in first} & {e.id for e in second}, "no event is taken twice while leased"
        again = wait_until(lambda: other.take_events(10, lease_seconds=60), what="the short lease to pass")
        assert [e.id for e in again] == [e.id for e in second]
        with pytest.raises(InvalidInput):
            storage.take_events(0, lease_seconds=30)

    def test_an_ack_removes_exactly_the_delivered_events(self, storage: Storage) -> None:
        storage.configure_events(ON)
        dead_letter(storage, "ev-ack", 3)
        taken = storage.take_events(10, lease_seconds=self.short_lease)
        assert storage.ack_events([taken[0].id, taken[1].id, "no-such-event"]) == 2
        assert storage.ack_events([taken[0].id]) == 0, "an ack repeated removes nothing"
        assert storage.ack_events([]) == 0
        left = wait_until(lambda: storage.take_events(10, lease_seconds=60), what="the lease to pass")
        assert [e.id for e in left] == [taken[2].id]

    def test_nothing_is_lost_when_the_deliverer_dies_before_its_ack(self, storage: Storage, open_another: OpenStore) -> None:
        storage.configure_events(ON)
        ids = dead_letter(storage, "ev-crash", 4)
        dying = open_another()
        dying.configure_events(ON)
        taken = dying.take_events(10, lease_seconds=self.short_lease)
        assert len(taken) == 4
        dying.close()  # delivered, perhaps, but never acknowledged
        successor = open_another()
        retaken = wait_until(lambda: successor.take_events(10, lease_seconds=60), what="the dead deliverer's lease to pass")
        assert sorted(_changes(retaken)) == sorted(f"{i}:dead:1" for i in ids)
        assert sorted(e.id for e in retaken) == sorted(e.id for e in taken), "the same events, same ids"
        assert successor.ack_events([e.id for e in retaken]) == 4

    def test_recorded_events_are_kept_once_per_id(self, storage: Storage) -> None:
        storage.configure_events(ON)
        event = OutboxEvent("op:kit1:finished", OPERATION_FINISHED, "ev-op", None, datetime.now(timezone.utc),
                            {"operation_id": "kit1", "kind": "redrive", "done": 3})
        storage.record_events([event])
        storage.record_events([event])
        (taken,) = _all_events(storage)
        assert (taken.id, taken.type, taken.queue, taken.task_id) == (event.id, OPERATION_FINISHED, "ev-op", None)
        assert taken.detail == {"operation_id": "kit1", "kind": "redrive", "done": 3}

    def test_the_payload_is_in_events_only_when_asked(self, storage: Storage) -> None:
        storage.configure_events(EventSettings(enabled=True, include_payload=True))
        (task_id,) = enqueue_n(storage, "ev-payload", 1)
        (claimed,) = storage.claim("ev-payload", 1, 30)
        storage.settle([Settlement(claimed.task.id, claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD)])
        (event,) = _all_events(storage)
        assert _change(event.id) == f"{task_id}:dead:1" and event.to_dict()["payload"] == {"n": 0}

    @pytest.mark.parametrize("operation", ("settle", "redrive"))
    def test_events_cost_what_the_backend_declares(self, storage: Storage, operation: str) -> None:
        budget = self.capabilities.round_trips.get(operation)
        if not isinstance(budget, int):
            pytest.skip(f"the backend declares no fixed budget for {operation}")
        storage.configure_events(ON)
        allowed = budget + self.capabilities.event_round_trips.get(operation, 0)
        for n in (1, 50):
            call = _prepare(storage, operation, n, f"ev-trips-{operation}-{n}", self.short_lease)
            before = storage.round_trips
            call()
            assert storage.round_trips - before <= allowed, f"{operation} of {n} with events on"
        assert _all_events(storage), "the measured calls wrote events"
