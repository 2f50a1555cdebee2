"""A 100,000-task dead-letter queue redriven as a background operation at a set rate, on
PostgreSQL: every task redriven exactly once, and the rate checked from the tasks' own
timestamps (each redrive stamps ``updated_at`` with the database clock)."""

from __future__ import annotations

import time
from collections import Counter

from rdq_core.engine import operations
from rdq_core.model import ErrorInfo, NewTask, Outcome, Settlement, TaskFilter, TaskStatus
from rdq_core.ids import new_task_id
from rdq_core.storage import open_storage

TASKS = 100_000
RATE = 5_000.0


def test_a_100k_dlq_is_redriven_once_each_at_the_set_rate(fresh_pg_url: str) -> None:
    storage = open_storage(fresh_pg_url)
    storage.migrate()
    try:
        for _batch in range(TASKS // 500):
            storage.enqueue([NewTask(id=new_task_id(), queue="scale", handler="noop", max_attempts=1)
                             for _ in range(500)])
        while claimed := storage.claim("scale", 1000, 60):
            storage.settle([Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                       error=ErrorInfo("boom.Fatal", "dead on purpose")) for c in claimed])
        assert storage.stats("scale").dead == TASKS

        operation = operations.start_operation(storage, action="redrive", queue="scale",
                                               selection=TaskFilter(), all=True, rate_per_second=RATE)
        assert operation.matched == TASKS
        began = time.monotonic()
        report = operations.drive_operations(storage, deadline=began + 120)
        elapsed = time.monotonic() - began
        finished = operations.get_operation(storage, operation.id)
        assert (finished.status, finished.done) == ("SUCCEEDED", TASKS), report

        stats = storage.stats("scale")
        assert (stats.pending, stats.dead) == (TASKS, 0)
        stamps: list[float] = []
        counts: Counter[int] = Counter()
        cursor = None
        while True:
            page = storage.list_tasks("scale", status=TaskStatus.PENDING, limit=5000, cursor=cursor)
            for task in page.tasks:
                counts[task.redrive_count] += 1
                assert task.updated_at is not None
                stamps.append(task.updated_at.timestamp())
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert counts == {1: TASKS}, "every task redriven exactly once"
        # The rate from the tasks' own timestamps: no one-second window holds more than the rate
        # plus the one chunk a slot may start early with; the whole run takes at least what the
        # rate allows.
        stamps.sort()
        per_second = Counter(int((s - stamps[0])) for s in stamps)
        busiest = max(per_second.values())
        span = stamps[-1] - stamps[0]
        print(f"\n100k redrive at {RATE:g}/s: {elapsed:.1f} s wall, {span:.1f} s from first to last redrive, "
              f"busiest second {busiest} tasks, mean {TASKS / max(span, 1e-9):.0f}/s, chunks {report.chunks}")
        assert busiest <= RATE + operations.MAX_CHUNK
        assert span >= (TASKS - operations.MAX_CHUNK) / RATE * 0.95
    finally:
        storage.close()
