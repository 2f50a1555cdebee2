"""The console's charts: the per-minute metrics the maintenance pass keeps (``storage/rollup.py``).

Each test does real work on the store (claims, retries, dead-lettering, cancels, redrives), closes
the current minute by rolling up *as of* a minute later (``as_of`` stands for the store's clock),
and checks the numbers the charts read back.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from ..errors import InvalidInput
from ..model import DeadFilter
from ..storage.rollup import minute_of
from ..storage.spi import Storage
from .support import OpenStore, dead_letter, enqueue_n, retry, success

#: Past the current minute and the rollup's grace: every minute the test touched is closed.
CLOSE = timedelta(seconds=66)


def _sum(series: dict[str, Any], name: str) -> int:
    return sum(value for value in series[name] if value is not None)


def _last(series: dict[str, Any], name: str) -> Any:
    values = [value for value in series[name] if value is not None]
    return values[-1] if values else None


def _handler(series: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [h for h in series["handlers"] if h["handler"] == name]
    assert found, f"no series for handler {name}: {[h['handler'] for h in series['handlers']]}"
    return found[0]


class ChartsCompliance:
    def test_charts_count_each_outcome_per_minute_with_depth_and_handler_latency(self, storage: Storage) -> None:
        queue = "charts"
        dead_letter(storage, queue, 2, handler="fragile")
        ok = enqueue_n(storage, queue, 3, handler="ok")
        flaky = enqueue_n(storage, queue, 2, handler="flaky")
        started = time.monotonic()
        first = storage.claim(queue, 10, 60)
        assert {c.task.id for c in first} == set(ok + flaky)
        storage.settle([success(c) if c.task.handler == "ok" else retry(c) for c in first])
        again = storage.claim(queue, 10, 60)
        assert {c.task.id for c in again} == set(flaky)
        storage.settle([success(c) for c in again])
        longest_ms = (time.monotonic() - started) * 1000
        dropped = enqueue_n(storage, queue, 1, handler="dropped")
        storage.cancel(dropped[0])
        enqueue_n(storage, queue, 1, handler="busy")
        assert len(storage.claim(queue, 1, 60)) == 1
        enqueue_n(storage, queue, 4, handler="waiting")

        as_of = storage.now() + CLOSE
        assert storage.roll_up_metrics(as_of) >= 1
        series = storage.queue_metrics(queue, "hour", as_of)
        assert len(series["minutes"]) == 60 and series["step_seconds"] == 60
        assert series["minutes"] == sorted(series["minutes"]) and all(m % 60 == 0 for m in series["minutes"])
        assert _sum(series, "succeeded") == 5
        assert _sum(series, "retried") == 2
        assert _sum(series, "dead_lettered") == 2
        assert _sum(series, "cancelled") == 1
        assert (_last(series, "pending"), _last(series, "in_flight"), _last(series, "dead")) == (4, 1, 2)
        assert _last(series, "oldest_pending_age_seconds") >= 0

        flaky_series = _handler(series, "flaky")["summary"]
        assert (flaky_series["attempts"], flaky_series["failures"], flaky_series["failure_rate"]) == (4, 2, 0.5)
        fragile = _handler(series, "fragile")["summary"]
        assert (fragile["attempts"], fragile["failures"], fragile["failure_rate"]) == (2, 2, 1.0)
        quick = _handler(series, "ok")["summary"]
        assert (quick["attempts"], quick["failures"], quick["failure_rate"]) == (3, 0, 0.0)
        assert quick["p50_ms"] <= quick["p95_ms"] <= quick["p99_ms"]
        # A percentile reads as its bucket's middle: within 19 % above the longest true duration.
        assert quick["p99_ms"] <= max(1.0, longest_ms * 1.19)
        assert {h["handler"] for h in series["handlers"]} == {"ok", "flaky", "fragile"}

        overview = storage.metrics_overview("hour", as_of)
        assert sum(overview["succeeded"]) == 5 and sum(overview["dead_lettered"]) == 2
        assert overview["totals"] == {"succeeded": 5, "retried": 2, "dead_lettered": 2, "cancelled": 1}
        assert series["totals"] == overview["totals"]
        assert [q["queue"] for q in overview["queues"]] == [queue]

    def test_charts_second_pass_over_the_same_minutes_counts_nothing_twice(self, storage: Storage) -> None:
        queue = "charts-again"
        enqueue_n(storage, queue, 3)
        storage.settle([success(c) for c in storage.claim(queue, 3, 60)])
        as_of = storage.now() + CLOSE
        storage.roll_up_metrics(as_of)
        assert storage.roll_up_metrics(as_of) == 0
        assert _sum(storage.queue_metrics(queue, "hour", as_of), "succeeded") == 3

    def test_charts_racing_passes_count_each_minute_once(self, storage: Storage, open_another: OpenStore) -> None:
        queue = "charts-race"
        enqueue_n(storage, queue, 6)
        storage.settle([success(c) for c in storage.claim(queue, 6, 60)])
        as_of = storage.now() + CLOSE
        rivals = [open_another() for _ in range(4)]
        with ThreadPoolExecutor(len(rivals)) as pool:
            list(pool.map(lambda store: store.roll_up_metrics(as_of), rivals))
        series = storage.queue_metrics(queue, "hour", as_of)
        assert series["totals"]["succeeded"] == 6
        assert _handler(series, "noop")["summary"]["attempts"] == 6

    def test_charts_redriven_task_counts_the_attempts_of_its_current_life(self, storage: Storage) -> None:
        queue = "charts-lives"
        [task_id] = dead_letter(storage, queue, 1, handler="phoenix")
        assert storage.redrive(queue, DeadFilter(ids=(task_id,))) == 1
        storage.settle([success(c) for c in storage.claim(queue, 1, 60)])
        as_of = storage.now() + CLOSE
        storage.roll_up_metrics(as_of)
        series = storage.queue_metrics(queue, "hour", as_of)
        assert _sum(series, "succeeded") == 1
        summary = _handler(series, "phoenix")["summary"]
        assert (summary["attempts"], summary["failures"]) == (1, 0)

    def test_charts_minutes_older_than_a_day_are_deleted_and_a_day_reads_288_points(self, storage: Storage) -> None:
        queue = "charts-old"
        enqueue_n(storage, queue, 2)
        storage.settle([success(c) for c in storage.claim(queue, 2, 60)])
        as_of = storage.now() + CLOSE
        storage.roll_up_metrics(as_of)
        day = storage.queue_metrics(queue, "day", as_of)
        # A point every five minutes, each the per-minute average of its closed minutes.
        assert day["step_seconds"] == 300 and len(day["minutes"]) in (288, 289)
        assert all(b - a == 300 for a, b in zip(day["minutes"], day["minutes"][1:], strict=False))
        assert day["totals"]["succeeded"] == 2 and 0 < _sum(day, "succeeded") <= 2
        assert _last(day, "pending") == 0 and _handler(day, "noop")["summary"]["attempts"] == 2
        later = as_of + timedelta(days=1, minutes=10)
        storage.roll_up_metrics(later)
        assert storage.queue_metrics(queue, "day", as_of)["totals"]["succeeded"] == 0
        # What is left is the later pass's own depth sample, nothing from a day before it.
        kept = storage.list_documents("queue-minute", limit=10)
        assert kept and all(doc.body["minute"] >= minute_of(later) - 24 * 60 for doc in kept)
        # A queue that no longer holds a task is forgotten once its last minute has expired.
        storage.purge_succeeded(0, 10)
        assert storage.list_queues() == []
        storage.roll_up_metrics(later + timedelta(days=1, minutes=10))
        for kind in ("queue-minute", "queue-5min", "queue-minute-mark"):
            assert storage.list_documents(kind, limit=10) == [], kind

    @pytest.mark.parametrize("queue, window, field", [
        ("Not A Queue", "hour", "queue"), ("", "hour", "queue"), ("charts", "week", "window"), ("charts", 7, "window"),
    ])
    def test_charts_refuse_a_bad_queue_or_window(self, storage: Storage, queue: Any, window: Any, field: str) -> None:
        with pytest.raises(InvalidInput) as refused:
            storage.queue_metrics(queue, window)
        assert refused.value.field == field
