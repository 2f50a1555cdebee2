"""Enqueue: every field kept, batches in order, idempotency per id, delays from the store's clock,
and ``connection=`` joined (a store that can) or refused."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ..errors import InvalidInput, UnsupportedOperation
from ..model import Backoff, NewTask, TaskStatus
from ..storage.spi import Storage
from .capabilities import Capabilities
from .support import due_at, must_get, new_task, retry, state, wait_until


class EnqueueCompliance:
    capabilities: Capabilities

    def test_enqueue_round_trips_every_field(self, storage: Storage) -> None:
        payload = {"to": "a@b.c", "n": [1, 2.5, None, True], "nested": {"$gt": "", "a.b": "ünïcødé ✓"}, "": None}
        headers = {"trace": "abc", "x.trace": "1", "$where": "true"}
        item = new_task(
            "fields", "send_email", payload, headers=headers, max_attempts=7,
            backoff=Backoff(initial_seconds=2, factor=3, max_seconds=60, jitter=0.1),
        )
        (result,) = storage.enqueue([item])
        assert result.created and not result.conflict and result.task.payload == payload
        task = must_get(storage, item.id)
        assert (task.queue, task.handler, task.payload, dict(task.headers)) == ("fields", "send_email", payload, headers)
        assert (task.status, task.attempt_count, task.redrive_count, task.max_attempts) == (TaskStatus.PENDING, 0, 0, 7)
        assert task.backoff == Backoff(2, 3, 60, 0.1)
        assert task.attempts == () and task.created_at is not None and task.next_attempt_at is not None

    def test_enqueue_keeps_any_json_payload(self, storage: Storage) -> None:
        """Scalars and lists are payloads too, and operator-shaped keys stay plain data."""
        for payload in ("text", 3, None, [1, 2], {"$set": {"status": "SUCCEEDED"}, "a.b": [1, {"$gt": ""}]}):
            item = new_task("scalars", payload=payload)
            storage.enqueue([item])
            assert must_get(storage, item.id).payload == payload

    def test_a_payload_with_nul_is_kept_or_refused_as_declared(self, storage: Storage) -> None:
        items = [new_task("nul", payload={"ok": 1}), new_task("nul", payload={"s": "a\x00b", "a\x00": 1})]
        if self.capabilities.holds_nul:
            storage.enqueue(items)
            assert must_get(storage, items[1].id).payload == {"s": "a\x00b", "a\x00": 1}
            return
        with pytest.raises(InvalidInput):
            storage.enqueue(items)
        assert storage.get(items[0].id) is None and storage.get(items[1].id) is None

    def test_enqueue_batch_returns_results_in_input_order(self, storage: Storage) -> None:
        items = [new_task("batch", payload=i) for i in range(50)]
        results = storage.enqueue(items)
        assert [r.task.id for r in results] == [i.id for i in items]
        assert all(r.created for r in results)
        assert storage.stats("batch").pending == 50

    def test_enqueue_same_id_same_queue_is_a_noop_that_keeps_state(self, storage: Storage) -> None:
        item = new_task("idem", payload={"v": 1}, max_attempts=5)
        storage.enqueue([item])
        (claimed,) = storage.claim("idem", 1, 30)
        storage.settle([retry(claimed, delay=3600)])
        before = must_get(storage, item.id)
        (again,) = storage.enqueue([NewTask(id=item.id, queue="idem", handler="other", payload={"v": 2})])
        assert not again.created and not again.conflict
        assert again.task.payload == {"v": 1} and again.task.handler == "noop"
        after = must_get(storage, item.id)
        assert state(after) == state(before) and after.payload == {"v": 1}

    def test_enqueue_same_id_other_queue_is_a_conflict_and_writes_nothing(self, storage: Storage) -> None:
        item = new_task("home")
        storage.enqueue([item])
        fresh = new_task("elsewhere")
        results = storage.enqueue([NewTask(id=item.id, queue="elsewhere", handler="noop"), fresh])
        assert results[0].conflict and not results[0].created and results[0].task.queue == "home"
        assert results[1].created
        assert storage.stats("elsewhere").pending == 1
        assert must_get(storage, item.id).queue == "home"

    def test_delayed_task_is_not_claimed_before_it_is_due(self, storage: Storage) -> None:
        storage.enqueue([new_task("delay", delay_seconds=0.6)])
        storage.enqueue([new_task("delay", run_at=datetime.now(timezone.utc) + timedelta(hours=1))])
        assert storage.claim("delay", 10, 30) == []
        claimed = wait_until(lambda: storage.claim("delay", 10, 30), timeout=10, what="the delayed task to come due")
        assert len(claimed) == 1

    def test_run_at_is_kept_and_a_delay_counts_from_the_store_clock(self, storage: Storage) -> None:
        now = storage.now()
        at, delayed, past = new_task("when", run_at=now + timedelta(hours=1)), new_task("when", delay_seconds=60), \
            new_task("when", run_at=now - timedelta(seconds=5))
        storage.enqueue([at, delayed, past])
        assert abs((due_at(storage, at.id) - (now + timedelta(hours=1))).total_seconds()) < 0.002
        assert 59 <= (due_at(storage, delayed.id) - now).total_seconds() <= 70
        assert [c.task.id for c in storage.claim("when", 10, 30)] == [past.id]

    def test_a_callers_connection_is_joined_or_refused(self, storage: Storage) -> None:
        """A store that joins transactions refuses what is not one of its connections; any other
        store refuses ``connection=`` outright. Either way ``UnsupportedOperation`` (also a
        ``TypeError``), and nothing is written."""
        declared = getattr(storage, "joins_transactions", self.capabilities.joins_transactions)
        assert declared == self.capabilities.joins_transactions, "the store and its test class disagree"
        item = new_task("joined")
        with pytest.raises(TypeError) as refused:
            storage.enqueue([item], connection=object())
        assert storage.get(item.id) is None and storage.stats("joined").pending == 0
        assert isinstance(refused.value, UnsupportedOperation), f"{type(refused.value).__name__} is not UnsupportedOperation"
