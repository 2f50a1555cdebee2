"""The storage core's part for selections of one queue's tasks: the dead-letter queue (list,
redrive, purge) and browsing (list, count, cancel what a filter selects). ``DeadFilter`` and the
keyset cursor become one ``Selection`` the backend translates; paging (one record beyond the
page) and cursors are done here.
"""

from __future__ import annotations

import abc
from typing import Sequence

from ..errors import InvalidCursor
from ..model import DeadFilter, DeadPage, Task, TaskFilter, TaskPage, TaskStatus
from .codec import Record
from .core_base import CoreBase
from .cursors import decode_dead_cursor, decode_task_cursor, encode_dead_cursor, encode_task_cursor
from .guards import require_limit, require_status, require_text
from .primitives import LISTING_ORDER, ORDER_FIELD, DeadSelection, Selection


class BrowsingCore(CoreBase, abc.ABC):
    """The DLQ and browsing SPI over the backend's selection primitives."""

    # -- primitives a backend writes (one atomic store operation each) -----------------------
    @abc.abstractmethod
    def _page(self, selection: Selection, limit: int, history: bool) -> Sequence[Record]:
        """Up to ``limit`` selected records of ``selection.status`` ordered by
        ``(selection.order_field, id)``, after ``selection.after``; with their ``attempts`` when
        ``history`` (else none need be loaded)."""

    @abc.abstractmethod
    def _count(self, selection: Selection) -> int:
        """How many tasks the selection (status and filter; never ``after``) holds."""

    @abc.abstractmethod
    def _cancel_selected(self, selection: Selection) -> int:
        """Selected PENDING → CANCELLED (``selection.status`` is PENDING); the count."""

    @abc.abstractmethod
    def _redrive(self, selection: DeadSelection) -> int:
        """Selected DEAD → PENDING due now, budget reset, ``redrive_count + 1``; the count."""

    @abc.abstractmethod
    def _purge_dead(self, selection: DeadSelection) -> int:
        """Delete selected dead tasks and their history; the count."""

    # -- the SPI ---------------------------------------------------------------------------
    def list_dead(
        self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()
    ) -> DeadPage:
        require_limit(limit)
        after = decode_dead_cursor(queue, cursor) if cursor is not None else None
        selection = self._selection(queue, filter, after)
        if selection.matches_nothing:
            return DeadPage(tasks=(), next_cursor=None)
        # One record beyond the page tells whether another page exists.
        with self.translated_errors():
            records = self._page(selection, limit + 1, True)
        tasks = tuple(self.codec.task(r) for r in records[:limit])
        next_cursor = None
        if len(records) > limit:
            last = tasks[-1]
            assert last.dead_at is not None, "a dead task has a dead_at"
            next_cursor = encode_dead_cursor(queue, last.dead_at, last.id)
        return DeadPage(tasks=tasks, next_cursor=next_cursor)

    def redrive(self, queue: str, filter: DeadFilter) -> int:
        selection = self._selection(queue, filter)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return self._redrive(selection)

    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        selection = self._selection(queue, filter)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return self._purge_dead(selection)

    def list_tasks(
        self, queue: str, *, status: TaskStatus | None = None, limit: int, cursor: str | None = None,
        filter: TaskFilter = TaskFilter(),
    ) -> TaskPage:
        require_limit(limit)
        statuses = LISTING_ORDER if status is None else (require_status(status),)
        start, after = 0, None
        if cursor is not None:
            cursor_status, micros, after_id = decode_task_cursor(queue, cursor)
            if cursor_status not in statuses:
                raise InvalidCursor()
            start, after = statuses.index(cursor_status), (micros, after_id)
        # Each status is asked for what the page still needs plus one: one record beyond the page
        # tells whether another page exists, so a page costs at most len(statuses) store calls.
        found: list[tuple[TaskStatus, Task]] = []
        for listed in statuses[start:]:
            selection = self._selection(queue, filter, after, listed)
            after = None
            if selection.matches_nothing:
                break
            with self.translated_errors():
                records = self._page(selection, limit - len(found) + 1, False)
            found.extend((listed, self.codec.task(r)) for r in records)
            if len(found) > limit:
                break
        next_cursor = None
        if len(found) > limit:
            last_status, last = found[limit - 1]
            at = getattr(last, ORDER_FIELD[last_status])
            assert at is not None, f"a {last_status.value} task has a {ORDER_FIELD[last_status]}"
            next_cursor = encode_task_cursor(queue, last_status, at, last.id)
        return TaskPage(tasks=tuple(task for _, task in found[:limit]), next_cursor=next_cursor)

    def count_tasks(self, queue: str, status: TaskStatus, filter: TaskFilter = TaskFilter()) -> int:
        selection = self._selection(queue, filter, None, require_status(status))
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return int(self._count(selection))

    def cancel_selected(self, queue: str, filter: TaskFilter) -> int:
        selection = self._selection(queue, filter, None, TaskStatus.PENDING)
        if selection.matches_nothing:
            return 0
        with self.translated_errors():
            return int(self._cancel_selected(selection))

    def _history_page(self, selection: Selection, limit: int) -> list[Task]:
        """One keyset page of ``selection`` with each task's history (what the rollup counts)."""
        with self.translated_errors():
            records = self._page(selection, limit, True)
        return [self.codec.task(r) for r in records]

    @staticmethod
    def _selection(queue: str, filter: DeadFilter, after: tuple[int, str] | None = None,
                   status: TaskStatus = TaskStatus.DEAD) -> Selection:
        require_text(queue, "queue")
        for field in ("error_type", "handler"):
            if getattr(filter, field) is not None:
                require_text(getattr(filter, field), field)
        ids = None
        if filter.ids is not None:
            for task_id in filter.ids:
                require_text(task_id, "ids")
            ids = tuple(dict.fromkeys(filter.ids))  # order kept, repeats dropped
        return Selection(queue=queue, status=status, ids=ids, error_type=filter.error_type, handler=filter.handler,
                         after=after)
