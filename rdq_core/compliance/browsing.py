"""What an operator's console reads and does: task listings by status, counts, cancel by filter,
pausing a queue, and the audit trail."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ..errors import InvalidCursor, InvalidInput
from ..model import Task, TaskFilter, TaskStatus
from ..storage.spi import Storage
from .support import OpenStore, dead_letter, enqueue_n, fail_permanently, must_get, new_task, success, wait_until


def walk(storage: Storage, queue: str, page_size: int, status: TaskStatus | None = None,
         filter: TaskFilter = TaskFilter()) -> list[Task]:
    """Every task a listing returns, page by page, failing on a cursor that does not end."""
    tasks: list[Task] = []
    cursor = None
    for _ in range(1000):
        page = storage.list_tasks(queue, status=status, limit=page_size, cursor=cursor, filter=filter)
        assert len(page.tasks) <= page_size
        tasks += page.tasks
        if page.next_cursor is None:
            return tasks
        assert page.tasks, "a page with a next cursor holds tasks"
        cursor = page.next_cursor
    raise AssertionError("the listing did not end")


def populate(storage: Storage, queue: str) -> dict[TaskStatus, list[str]]:
    """Tasks of ``queue`` in every status; per status their ids in the listing's order."""
    base = storage.now()
    # PENDING, due at distinct instants enqueued out of order, and two due at the same instant.
    delays = [300, 100, 200, 100, 400]
    pending = [new_task(queue, run_at=base + timedelta(seconds=d)) for d in delays]
    storage.enqueue(pending)
    by_due = sorted(pending, key=lambda t: (t.run_at, t.id))
    dead = dead_letter(storage, queue, 3, handler="fragile", error_type="boom.Fatal")
    to_run = enqueue_n(storage, queue, 4)
    claimed = storage.claim(queue, 4, 60)
    assert {c.task.id for c in claimed} == set(to_run)
    storage.settle([success(c) for c in claimed[:2]])
    cancelled = enqueue_n(storage, queue, 2, handler="dropped")
    for task_id in cancelled:
        storage.cancel(task_id)
    in_flight = [c.task.id for c in claimed[2:]]
    return {
        TaskStatus.PENDING: [t.id for t in by_due],
        TaskStatus.IN_FLIGHT: [t.id for t in sorted((must_get(storage, i) for i in in_flight),
                                                    key=lambda t: (t.lease_expires_at, t.id))],
        TaskStatus.DEAD: [t.id for t in sorted((must_get(storage, i) for i in dead), key=lambda t: (t.dead_at, t.id))],
        TaskStatus.SUCCEEDED: [t.id for t in sorted((must_get(storage, c.task.id) for c in claimed[:2]),
                                                    key=lambda t: (t.updated_at, t.id))],
        TaskStatus.CANCELLED: [t.id for t in sorted((must_get(storage, i) for i in cancelled),
                                                    key=lambda t: (t.updated_at, t.id))],
    }


class BrowsingCompliance:
    # -- listing ------------------------------------------------------------------------------
    def test_list_tasks_walks_each_status_in_its_order_each_task_once(self, storage: Storage) -> None:
        expected = populate(storage, "browse")
        enqueue_n(storage, "browse-other", 3)  # another queue's tasks never show
        for status, ids in expected.items():
            for page_size in (1, 2, 50):
                listed = walk(storage, "browse", page_size, status)
                assert [t.id for t in listed] == ids, (status, page_size)
                assert all(t.status is status and t.queue == "browse" for t in listed)
                assert all(t.attempts == () for t in listed), "listings carry no history"
        everything = [i for status in (TaskStatus.PENDING, TaskStatus.IN_FLIGHT, TaskStatus.DEAD, TaskStatus.SUCCEEDED,
                                       TaskStatus.CANCELLED) for i in expected[status]]
        for page_size in (1, 3, 4, 100):
            assert [t.id for t in walk(storage, "browse", page_size)] == everything, page_size

    def test_list_tasks_carries_each_tasks_fields(self, storage: Storage) -> None:
        (dead_id,) = dead_letter(storage, "browse-fields", 1, handler="fragile", error_type="boom.Fatal")
        (listed,) = storage.list_tasks("browse-fields", status=TaskStatus.DEAD, limit=10).tasks
        stored = must_get(storage, dead_id)
        assert listed.id == dead_id and listed.handler == "fragile" and listed.payload == stored.payload
        assert listed.dead_at == stored.dead_at and listed.attempt_count == 1
        assert listed.last_error is not None and listed.last_error.type == "boom.Fatal"

    def test_list_tasks_filters_by_handler_error_type_and_ids(self, storage: Storage) -> None:
        expected = populate(storage, "browse-filter")
        fragile = walk(storage, "browse-filter", 2, TaskStatus.DEAD, TaskFilter(handler="fragile"))
        assert [t.id for t in fragile] == expected[TaskStatus.DEAD]
        assert walk(storage, "browse-filter", 2, TaskStatus.DEAD, TaskFilter(handler="other")) == []
        by_error = walk(storage, "browse-filter", 1, None, TaskFilter(error_type="boom.Fatal"))
        assert [t.id for t in by_error] == expected[TaskStatus.DEAD]
        dropped = walk(storage, "browse-filter", 1, None, TaskFilter(handler="dropped"))
        assert [t.id for t in dropped] == expected[TaskStatus.CANCELLED]
        some = expected[TaskStatus.PENDING][1:3]
        by_ids = walk(storage, "browse-filter", 1, None, TaskFilter(ids=tuple(reversed(some))))
        assert [t.id for t in by_ids] == some
        assert storage.list_tasks("browse-filter", limit=5, filter=TaskFilter(ids=())).tasks == ()

    def test_list_tasks_pages_are_stable_while_tasks_arrive(self, storage: Storage) -> None:
        """Tasks that stay PENDING while pages are read appear exactly once, however many arrive."""
        initial = enqueue_n(storage, "browse-live", 30)
        seen: list[str] = []
        cursor = None
        while True:
            page = storage.list_tasks("browse-live", status=TaskStatus.PENDING, limit=7, cursor=cursor)
            seen += [t.id for t in page.tasks]
            storage.enqueue([new_task("browse-live", delay_seconds=0) for _ in range(5)])
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert len(seen) == len(set(seen)), "a task appeared twice"
        assert set(initial) <= set(seen)

    def test_list_tasks_refuses_foreign_forged_or_mismatched_cursors_and_bad_arguments(self, storage: Storage) -> None:
        dead_letter(storage, "browse-cursor", 2)
        enqueue_n(storage, "browse-cursor", 3)
        pending_cursor = storage.list_tasks("browse-cursor", status=TaskStatus.PENDING, limit=1).next_cursor
        assert pending_cursor is not None
        dead_cursor = storage.list_dead("browse-cursor", limit=1).next_cursor
        assert dead_cursor is not None
        for queue, status, cursor in (
            ("browse-elsewhere", TaskStatus.PENDING, pending_cursor),   # another queue's cursor
            ("browse-cursor", TaskStatus.DEAD, pending_cursor),          # another status's cursor
            ("browse-cursor", TaskStatus.DEAD, dead_cursor),            # a DLQ cursor is not a listing's
            ("browse-cursor", None, "not-a-cursor"),
            ("browse-cursor", None, ""),
        ):
            with pytest.raises(InvalidCursor):
                storage.list_tasks(queue, status=status, limit=5, cursor=cursor)
        with pytest.raises(InvalidCursor):
            storage.list_dead("browse-cursor", limit=1, cursor=pending_cursor)
        # A status listing's cursor continues a listing of every status.
        assert storage.list_tasks("browse-cursor", limit=10, cursor=pending_cursor).tasks
        for limit in (0, -1, True):
            with pytest.raises(InvalidInput):
                storage.list_tasks("browse-cursor", limit=limit)
        with pytest.raises(InvalidInput):
            storage.list_tasks("browse-cursor", status="RUNNING", limit=5)  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(InvalidInput):
            storage.list_tasks("browse-cursor", limit=5, filter=TaskFilter(handler={"$ne": ""}))  # type: ignore[arg-type]

    # -- counting and cancelling by filter ------------------------------------------------------
    def test_count_tasks_counts_what_the_filter_selects(self, storage: Storage) -> None:
        expected = populate(storage, "browse-count")
        for status, ids in expected.items():
            assert storage.count_tasks("browse-count", status) == len(ids)
        assert storage.count_tasks("browse-count", TaskStatus.DEAD, TaskFilter(error_type="boom.Fatal")) == 3
        assert storage.count_tasks("browse-count", TaskStatus.DEAD, TaskFilter(error_type="other")) == 0
        assert storage.count_tasks("browse-count", TaskStatus.CANCELLED, TaskFilter(handler="dropped")) == 2
        two = tuple(expected[TaskStatus.PENDING][:2])
        assert storage.count_tasks("browse-count", TaskStatus.PENDING, TaskFilter(ids=two + ("no-such-task",))) == 2
        assert storage.count_tasks("browse-count", TaskStatus.PENDING, TaskFilter(ids=())) == 0
        assert storage.count_tasks("browse-none", TaskStatus.PENDING) == 0

    def test_cancel_selected_cancels_only_matching_pending_tasks(self, storage: Storage) -> None:
        dead = dead_letter(storage, "browse-cancel", 1, handler="doomed")
        doomed = enqueue_n(storage, "browse-cancel", 4, handler="doomed")
        kept = enqueue_n(storage, "browse-cancel", 3, handler="kept")
        (held,) = storage.claim("browse-cancel", 1, 60)  # the oldest due: one of the doomed, now IN_FLIGHT
        assert held.task.id in doomed
        assert storage.cancel_selected("browse-cancel", TaskFilter(handler="doomed")) == 3
        for task_id in set(doomed) - {held.task.id}:
            assert must_get(storage, task_id).status is TaskStatus.CANCELLED
        assert must_get(storage, held.task.id).status is TaskStatus.IN_FLIGHT
        assert must_get(storage, dead[0]).status is TaskStatus.DEAD
        assert all(must_get(storage, i).status is TaskStatus.PENDING for i in kept)
        storage.settle([success(held)])  # the claim it did not touch still settles
        assert storage.cancel_selected("browse-cancel", TaskFilter(handler="doomed")) == 0
        assert storage.cancel_selected("browse-cancel", TaskFilter(ids=(kept[0], "no-such-task"))) == 1
        assert storage.cancel_selected("browse-cancel", TaskFilter()) == 2
        assert storage.stats("browse-cancel").pending == 0
        assert storage.claim("browse-cancel", 10, 60) == []

    # -- pausing ------------------------------------------------------------------------------
    def test_a_paused_queue_claims_nothing_and_still_takes_enqueues(self, storage: Storage, open_another: OpenStore) -> None:
        before = enqueue_n(storage, "browse-paused", 3)
        enqueue_n(storage, "browse-running", 2)
        storage.set_paused("browse-paused", True)
        storage.set_paused("browse-paused", True)  # pausing twice is pausing
        other = open_another()
        assert other.claim("browse-paused", 10, 60) == []
        after = enqueue_n(other, "browse-paused", 2)
        assert storage.claim("browse-paused", 10, 60) == []
        assert len(storage.claim("browse-running", 10, 60)) == 2, "other queues run on"
        assert "browse-paused" in other.paused_queues() and "browse-running" not in other.paused_queues()
        stats = other.stats("browse-paused")
        assert stats.paused and stats.pending == 5 and not other.stats("browse-running").paused
        storage.set_paused("browse-paused", False)
        assert "browse-paused" not in other.paused_queues()
        claimed = other.claim("browse-paused", 10, 60)
        assert sorted(c.task.id for c in claimed) == sorted(before + after)
        storage.set_paused("browse-never-paused", False)  # resuming a running queue changes nothing

    def test_a_queue_can_be_paused_before_it_holds_tasks(self, storage: Storage) -> None:
        storage.set_paused("browse-empty", True)
        assert "browse-empty" in storage.paused_queues()
        enqueue_n(storage, "browse-empty", 2)
        assert storage.claim("browse-empty", 10, 60) == []
        storage.set_paused("browse-empty", False)
        assert len(storage.claim("browse-empty", 10, 60)) == 2

    def test_a_claimed_task_of_a_paused_queue_still_settles_and_expires(self, storage: Storage) -> None:
        enqueue_n(storage, "browse-drain", 2)
        first, second = storage.claim("browse-drain", 2, 0.3)
        storage.set_paused("browse-drain", True)
        storage.settle([fail_permanently(first)])
        assert must_get(storage, first.task.id).status is TaskStatus.DEAD
        expired = wait_until(lambda: [c.task.id for c in storage.find_expired_leases(10, "browse-drain")],
                             what="the paused queue's expired lease")
        assert expired == [second.task.id], "a paused queue's leases still expire for the reaper"

    def test_set_paused_refuses_what_is_not_a_queue_or_a_bool(self, storage: Storage) -> None:
        with pytest.raises(InvalidInput):
            storage.set_paused({"$ne": ""}, True)  # type: ignore[arg-type]  # deliberately wrong type
        with pytest.raises(InvalidInput):
            storage.set_paused("browse-bad", "yes")  # type: ignore[arg-type]  # deliberately wrong type
        assert "browse-bad" not in storage.paused_queues()

    # -- the audit trail ----------------------------------------------------------------------
    def test_audit_entries_read_back_newest_first_by_queue(self, storage: Storage) -> None:
        written = []
        for n in range(5):
            written.append(storage.record_audit(actor=f"arn:aws:iam::123456789012:user/op{n}", action="redrive",
                                                queue="browse-audit-a" if n % 2 == 0 else "browse-audit-b",
                                                selection={"error_type": "boom.Fatal", "n": n}, count=n))
        assert [e.at for e in written] == sorted(e.at for e in written)
        newest_first = list(reversed(written))
        pages, cursor = [], None
        while True:
            page = storage.list_audit(limit=2, cursor=cursor)
            pages.append(page.entries)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        listed = [e for page in pages for e in page if e.queue.startswith("browse-audit-")]
        assert [e.id for e in listed] == [e.id for e in newest_first]
        assert listed[0] == written[-1]
        assert listed[0].selection == {"error_type": "boom.Fatal", "n": 4} and listed[0].count == 4
        only_a = storage.list_audit(queue="browse-audit-a", limit=10)
        assert [e.id for e in only_a.entries] == [written[4].id, written[2].id, written[0].id]
        assert only_a.next_cursor is None
        with pytest.raises(InvalidCursor):
            storage.list_audit(queue="browse-audit-b", limit=2, cursor=storage.list_audit(limit=1).next_cursor)
        with pytest.raises(InvalidInput):
            storage.list_audit(limit=0)

    def test_audit_keeps_undecodable_text_as_replacement_characters(self, storage: Storage) -> None:
        entry = storage.record_audit(actor="local-\udcff", action="purge", queue="browse-audit-text",
                                     selection={"handler": "h\udcff"}, count=1)
        (stored,) = storage.list_audit(queue="browse-audit-text", limit=5).entries
        assert stored.actor == entry.actor == "local-\ufffd"
        assert stored.selection == {"handler": "h\ufffd"}
