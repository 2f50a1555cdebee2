"""The charts' duration histogram (``rdq_core/storage/rollup.py``): what a percentile read from it
is worth, and the life of a task's attempts it counts."""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta, timezone

import pytest

from rdq_core.model import Attempt, Outcome, Task, TaskStatus
from rdq_core.storage import rollup


def nearest_rank(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(fraction * len(ordered))) - 1]


@pytest.mark.parametrize("seed", range(20))
def test_a_percentile_from_the_histogram_is_within_nine_percent_of_the_true_one(seed: int) -> None:
    rng = random.Random(seed)
    durations = [rng.lognormvariate(math.log(rng.choice([3, 40, 900, 20_000])), 0.8) + 1 for _ in range(rng.randint(1, 500))]
    histogram: dict[int, int] = {}
    for value in durations:
        slot = rollup.duration_bucket(value)
        histogram[slot] = histogram.get(slot, 0) + 1
    for fraction, read in zip((0.5, 0.95, 0.99), rollup.percentiles(histogram, (0.5, 0.95, 0.99)), strict=True):
        true = nearest_rank(durations, fraction)
        assert read is not None and abs(read - true) / true <= 0.0906, (fraction, read, true)


def test_percentiles_of_nothing_are_none_and_under_a_millisecond_reads_as_one() -> None:
    assert rollup.percentiles({}, (0.5, 0.99)) == [None, None]
    assert rollup.percentiles({rollup.duration_bucket(0.2): 3}, (0.5,)) == [1.0]


def _attempt(n: int, outcome: Outcome) -> Attempt:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=n)
    return Attempt(n, outcome, at, at + timedelta(seconds=1))


def test_the_current_life_is_the_trailing_budgeted_attempts_with_their_snoozes() -> None:
    history = (_attempt(1, Outcome.RETRYABLE_FAILURE), _attempt(2, Outcome.PERMANENT_FAILURE),  # died
               _attempt(3, Outcome.SNOOZED), _attempt(4, Outcome.LEASE_EXPIRED), _attempt(5, Outcome.SUCCESS))
    task = Task("t", "q", "h", None, TaskStatus.SUCCEEDED, attempt_count=2, redrive_count=1, attempts=history)
    assert [a.attempt_no for a in rollup._life(task)] == [3, 4, 5]
    fresh = Task("t", "q", "h", None, TaskStatus.SUCCEEDED, attempt_count=5, attempts=history)
    assert [a.attempt_no for a in rollup._life(fresh)] == [1, 2, 3, 4, 5]
