"""Retry policy: defaults, backoff growth, cap, jitter, and per-queue/per-task overrides."""

import random

import pytest

from rdq_core.model import Backoff, ErrorInfo, Outcome, Task, TaskStatus
from rdq_core.engine.outcomes import failed_attempt
from rdq_core.engine.retry import PolicyBook, RetryPolicy, backoff_delay, policy_book_from_config


def make_task(**fields) -> Task:
    return Task(id="t", queue=fields.pop("queue", "q"), handler="h", payload=None, status=TaskStatus.IN_FLIGHT, **fields)


def test_defaults_are_five_attempts_one_second_doubling_capped_at_ten_minutes():
    policy = RetryPolicy()
    assert policy.max_attempts == 5
    assert policy.backoff == Backoff(initial_seconds=1.0, factor=2.0, max_seconds=600.0, jitter=0.2)


@pytest.mark.parametrize("attempts_used, expected", [(1, 1.0), (2, 2.0), (3, 4.0), (10, 512.0), (11, 600.0), (10_000, 600.0)])
def test_backoff_grows_exponentially_up_to_the_cap(attempts_used, expected):
    assert backoff_delay(Backoff(jitter=0.0), attempts_used) == expected


def test_jitter_stays_within_twenty_percent_and_under_the_cap():
    rng = random.Random(7)
    delays = [backoff_delay(Backoff(), 3, rng) for _ in range(2000)]
    assert min(delays) >= 3.2 and max(delays) <= 4.8
    assert max(delays) - min(delays) > 1.0  # it really spreads
    capped = [backoff_delay(Backoff(), 50, rng) for _ in range(500)]
    assert max(capped) <= 600.0 and min(capped) >= 480.0


def test_task_overrides_queue_overrides_default():
    book = PolicyBook(queues={"slow": RetryPolicy(max_attempts=9, backoff=Backoff(30, 3, 900, 0))})
    assert book.for_task(make_task()).max_attempts == 5
    assert book.for_task(make_task(queue="slow")).max_attempts == 9
    own = book.for_task(make_task(queue="slow", max_attempts=2, backoff=Backoff(1, 1, 1, 0)))
    assert (own.max_attempts, own.backoff.initial_seconds) == (2, 1)


def test_failure_retries_until_the_budget_is_spent_then_dead_letters():
    book = PolicyBook(RetryPolicy(max_attempts=3, backoff=Backoff(10, 2, 100, 0)))
    error = ErrorInfo("x")
    first = failed_attempt(book, make_task(attempt_count=0), "tok", Outcome.RETRYABLE_FAILURE, error)
    assert (first.status, first.retry_delay_seconds) == (TaskStatus.PENDING, 10)
    second = failed_attempt(book, make_task(attempt_count=1), "tok", Outcome.LEASE_EXPIRED, error)
    assert (second.status, second.retry_delay_seconds, second.outcome) == (TaskStatus.PENDING, 20, Outcome.LEASE_EXPIRED)
    third = failed_attempt(book, make_task(attempt_count=2), "tok", Outcome.RETRYABLE_FAILURE, error)
    assert third.status is TaskStatus.DEAD
    # The policy alone: a delay while budget is left, None for the attempt that spends it.
    assert [book.retry_delay(make_task(attempt_count=n)) for n in range(3)] == [10, 20, None]


def test_permanent_failure_dead_letters_at_once():
    book = PolicyBook()
    decision = failed_attempt(book, make_task(attempt_count=0), "tok", Outcome.PERMANENT_FAILURE, ErrorInfo("x"))
    assert decision.status is TaskStatus.DEAD


def test_policy_config_from_json():
    book = policy_book_from_config({"emails": {"max_attempts": 8, "backoff": {"initial_seconds": 5}}})
    policy = book.queues["emails"]
    assert policy.max_attempts == 8 and policy.backoff.initial_seconds == 5 and policy.backoff.factor == 2
    with pytest.raises(ValueError):
        policy_book_from_config({"emails": 3})


def test_retry_on_and_dead_on_are_lists_of_exception_type_names():
    book = policy_book_from_config({"q": {"retry_on": ["TimeoutError"], "dead_on": ["builtins.KeyError"]}})
    policy = book.queues["q"]
    assert policy.retry_on == frozenset({"TimeoutError"}) and policy.dead_on == frozenset({"builtins.KeyError"})
    assert policy.gives_up_on(KeyError("k")) and policy.gives_up_on(ValueError("v"))
    assert not policy.gives_up_on(TimeoutError()), "named in retry_on"
    assert policy.gives_up_on(ConnectionRefusedError()), "retry_on given and names none of its types"
    # No lists: nothing is given up on by type.
    assert not policy_book_from_config({"q": {"max_attempts": 2}}).queues["q"].gives_up_on(KeyError())
    for bad in ("TimeoutError", [1], [""], [" Padded"], {"TimeoutError": 1}):
        with pytest.raises(ValueError, match="list of exception type names"):
            policy_book_from_config({"q": {"dead_on": bad}})
        with pytest.raises(ValueError, match="list of exception type names"):
            policy_book_from_config({"q": {"retry_on": bad}})
