"""Retry policy: how many attempts a task gets and how long it waits between them.

Numbers only; ``rdq_core.outcomes`` turns them into a task's settlement.

Resolution order for every field: the task's own value, then its queue's policy, then the
defaults (5 attempts; backoff 1 s initial, x2, capped at 10 min, ±20 % jitter).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping

from .errors import ConfigurationError
from .model import Backoff, Task

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF = Backoff()


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: Backoff = field(default_factory=Backoff)

    def delay_after(self, attempts_used: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempts_used``-th failed attempt (1-based)."""
        return backoff_delay(self.backoff, attempts_used, rng)


def backoff_delay(backoff: Backoff, attempts_used: int, rng: random.Random | None = None) -> float:
    exponent = max(attempts_used - 1, 0)
    # Grow step by step and stop at the cap, so huge attempt counts cannot overflow a float.
    base = backoff.initial_seconds
    for _ in range(exponent):
        base *= backoff.factor
        if base >= backoff.max_seconds:
            break
    base = min(base, backoff.max_seconds)
    spread = base * backoff.jitter
    draw = (rng or random).uniform(-spread, spread)
    # The cap is a promise to operators ("never wait longer than 10 min"), so it bounds the jitter too.
    return min(max(0.0, base + draw), backoff.max_seconds)


@dataclass(frozen=True)
class PolicyBook:
    """Queue-level overrides on top of the defaults. Hosts build one from configuration."""

    default: RetryPolicy = field(default_factory=RetryPolicy)
    queues: Mapping[str, RetryPolicy] = field(default_factory=dict)

    def for_task(self, task: Task) -> RetryPolicy:
        queue_policy = self.queues.get(task.queue, self.default)
        return RetryPolicy(
            max_attempts=task.max_attempts or queue_policy.max_attempts,
            backoff=task.backoff or queue_policy.backoff,
        )

    def retry_delay(self, task: Task, rng: random.Random | None = None) -> float | None:
        """Seconds before the next try after a failed attempt of ``task``, or None when that
        attempt spends its budget. ``task.attempt_count`` is the budget used *before* it."""
        policy = self.for_task(task)
        used = task.attempt_count + 1
        if used >= policy.max_attempts:
            return None
        return policy.delay_after(used, rng)


def policy_book_from_config(config: Mapping[str, object] | None) -> PolicyBook:
    """Build a PolicyBook from JSON-shaped config, e.g. ``RDQ_QUEUE_POLICIES``::

        {"emails": {"max_attempts": 8, "backoff": {"initial_seconds": 5}}}
    """
    if not config:
        return PolicyBook()
    queues: dict[str, RetryPolicy] = {}
    for queue, raw in config.items():
        if not isinstance(raw, Mapping):
            raise ConfigurationError(f"policy for queue {queue!r} must be an object")
        backoff = DEFAULT_BACKOFF
        if raw.get("backoff") is not None:
            backoff = Backoff(**{**DEFAULT_BACKOFF.to_dict(), **dict(raw["backoff"])})
        queues[str(queue)] = RetryPolicy(
            max_attempts=int(raw.get("max_attempts", DEFAULT_MAX_ATTEMPTS)), backoff=backoff
        )
    return PolicyBook(queues=queues)
