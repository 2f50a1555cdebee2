"""The dead-letter queue: keyset paging that is stable while tasks die, filters, cursors bound to
their queue, redrive that keeps history, purge that deletes it."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from ..errors import InvalidCursor, InvalidInput
from ..model import DeadFilter, ErrorInfo, Outcome, Settlement, Task, TaskStatus
from ..storage.spi import Storage
from .support import OpenStore, dead_letter, enqueue_n, must_get, new_task


class DeadLetterCompliance:
    def test_dlq_paging_is_stable_while_tasks_die_concurrently(self, storage: Storage, open_another: OpenStore) -> None:
        initial = dead_letter(storage, "dlq", 60)
        other = open_another()
        stop = threading.Event()

        def keep_dead_lettering() -> None:
            for _ in range(20):  # bounded, so the pager can catch up and finish
                if stop.is_set():
                    return
                dead_letter(other, "dlq", 3)

        producer = threading.Thread(target=keep_dead_lettering)
        producer.start()
        try:
            seen: list[str] = []
            cursor = None
            while True:
                page = storage.list_dead("dlq", limit=7, cursor=cursor)
                assert len(page.tasks) <= 7
                seen += [t.id for t in page.tasks]
                assert all(t.status is TaskStatus.DEAD and t.attempts for t in page.tasks)
                cursor = page.next_cursor
                if cursor is None:
                    break
                time.sleep(0.005)
        finally:
            stop.set()
            producer.join(60)
        duplicates = [i for i, n in Counter(seen).items() if n > 1]
        assert duplicates == []
        assert set(initial) <= set(seen), f"{len(set(initial) - set(seen))} dead task(s) skipped"

    def test_dlq_pages_walk_dead_at_then_id_each_task_once(self, storage: Storage) -> None:
        """Tasks dead-lettered by one settle may share ``dead_at``: the id breaks the tie, so a
        page boundary inside the tie neither repeats nor skips a task."""
        enqueue_n(storage, "ties", 25)
        claimed = storage.claim("ties", 25, 60)
        storage.settle([Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("Boom")) for c in claimed])
        walked: list[Task] = []
        cursor = None
        while True:
            page = storage.list_dead("ties", limit=4, cursor=cursor)
            walked += page.tasks
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert sorted(t.id for t in walked) == sorted(c.task.id for c in claimed)
        assert [(t.dead_at, t.id) for t in walked] == sorted((t.dead_at, t.id) for t in walked)

    def test_dlq_filters_and_rejects_foreign_or_forged_cursors(self, storage: Storage) -> None:
        a = dead_letter(storage, "filters", 3, handler="resize", error_type="img.Corrupt")
        b = dead_letter(storage, "filters", 2, handler="email", error_type="smtp.Refused")
        page = storage.list_dead("filters", limit=50, filter=DeadFilter(error_type="img.Corrupt"))
        assert {t.id for t in page.tasks} == set(a) and page.next_cursor is None
        page = storage.list_dead("filters", limit=50, filter=DeadFilter(handler="email"))
        assert {t.id for t in page.tasks} == set(b)
        page = storage.list_dead("filters", limit=1)
        assert page.next_cursor
        assert storage.list_dead("other", limit=10).tasks == ()
        for bad in (page.next_cursor + "x", "not-a-cursor", "eyJxIjoiZmlsdGVycyJ9"):
            with pytest.raises(InvalidCursor):
                storage.list_dead("filters", limit=5, cursor=bad)
        with pytest.raises(InvalidCursor):
            storage.list_dead("other", limit=5, cursor=page.next_cursor)

    def test_dlq_filters_page_past_entries_that_do_not_match(self, storage: Storage) -> None:
        enqueue_n(storage, "rare", 30)
        claimed = storage.claim("rare", 30, 60)
        storage.settle([Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("Rare" if i % 10 == 9 else "Common"))
                        for i, c in enumerate(claimed)])
        rare = {claimed[i].task.id for i in (9, 19, 29)}
        page = storage.list_dead("rare", limit=2, filter=DeadFilter(error_type="Rare"))
        rest = storage.list_dead("rare", limit=2, cursor=page.next_cursor, filter=DeadFilter(error_type="Rare"))
        assert (len(page.tasks), len(rest.tasks), rest.next_cursor) == (2, 1, None)
        assert {t.id for t in page.tasks + rest.tasks} == rare
        assert storage.redrive("rare", DeadFilter(error_type="Rare", handler="noop")) == 3
        assert storage.stats("rare").dead == 27

    def test_list_dead_refuses_a_limit_that_asks_for_nothing(self, storage: Storage) -> None:
        """A page of at most zero tasks is a caller's mistake, refused the same way everywhere."""
        dead_letter(storage, "limits", 1)
        for limit in (0, -1):
            with pytest.raises(InvalidInput) as refused:
                storage.list_dead("limits", limit=limit)
            assert refused.value.field == "limit"

    def test_redrive_by_ids_and_by_filter_keeps_history(self, storage: Storage) -> None:
        a = dead_letter(storage, "redrive", 2, error_type="e.A")
        b = dead_letter(storage, "redrive", 3, error_type="e.B")
        assert storage.redrive("redrive", DeadFilter(ids=(a[0], "no-such-task"))) == 1
        assert storage.redrive("redrive", DeadFilter(ids=(a[0],))) == 0  # no longer dead
        assert storage.redrive("redrive", DeadFilter(ids=())) == 0  # no ids: nothing, not everything
        assert storage.redrive("redrive", DeadFilter(error_type="e.B")) == 3
        for task_id in [a[0], *b]:
            task = must_get(storage, task_id)
            assert (task.status, task.attempt_count, task.redrive_count) == (TaskStatus.PENDING, 0, 1)
            assert task.dead_at is None and len(task.attempts) == 1
        assert storage.stats("redrive").dead == 1
        assert storage.redrive("redrive", DeadFilter()) == 1
        assert len(storage.claim("redrive", 10, 30)) == 5

    def test_purge_dead_by_ids_and_by_filter_deletes_history(self, storage: Storage) -> None:
        a = dead_letter(storage, "purge", 2, handler="h1")
        b = dead_letter(storage, "purge", 2, handler="h2")
        keep = enqueue_n(storage, "purge", 1)
        assert storage.purge_dead("purge", DeadFilter(ids=(a[0], keep[0]))) == 1
        assert storage.get(a[0]) is None
        assert storage.purge_dead("purge", DeadFilter(handler="h2")) == 2
        assert all(storage.get(i) is None for i in b)
        assert storage.purge_dead("purge", DeadFilter()) == 1
        assert must_get(storage, keep[0]).status is TaskStatus.PENDING
        assert storage.stats("purge").dead == 0
        # A purged id is free again, and a task enqueued under it inherits no history.
        (again,) = storage.enqueue([new_task("purge-reuse", id=a[0])])
        assert again.created and must_get(storage, a[0]).attempts == ()
