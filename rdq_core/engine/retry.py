"""Retry policy: how many attempts a task gets and how long it waits between them.

Numbers only; ``rdq_core.engine.outcomes`` turns them into a task's settlement.

Resolution order for every field: the task's own value, then its queue's policy, then the
defaults (5 attempts; backoff 1 s initial, x2, capped at 10 min, ±20 % jitter).

A queue's policy may also name exception types: ``dead_on`` (dead-letter at once) and
``retry_on`` (when given, only these are retried; any other exception dead-letters). See
``RetryPolicy.gives_up_on`` for the precedence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ConfigurationError
from ..flow import FLOW_POLICY_KEYS, FlowBook, FlowPolicy, flow_book_from_config, unknown_key_error
from ..model import Backoff, Task

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF = Backoff()

#: The policy keys this module reads.
RETRY_POLICY_KEYS = ("max_attempts", "backoff", "retry_on", "dead_on")
#: Every key a queue's policy may hold (``RDQ_QUEUE_POLICIES``): any other is refused.
POLICY_KEYS = RETRY_POLICY_KEYS + FLOW_POLICY_KEYS
#: The keys of a policy's ``backoff`` object.
BACKOFF_KEYS = tuple(DEFAULT_BACKOFF.to_dict())


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: Backoff = field(default_factory=Backoff)
    #: Exception type names that are retried; None retries every exception.
    retry_on: frozenset[str] | None = None
    #: Exception type names that dead-letter at once.
    dead_on: frozenset[str] = frozenset()

    def gives_up_on(self, exc: BaseException) -> bool:
        """True when a raised ``exc`` dead-letters at once under this policy: its type, or any of
        its base types, is named in ``dead_on``; or ``retry_on`` is given and names none of them.
        ``dead_on`` wins when both name it. A name is a class's bare name (``TimeoutError``) or
        its module-qualified one (``myapp.errors.Throttled``)."""
        if not self.dead_on and self.retry_on is None:
            return False
        names = exception_type_names(type(exc))
        if names & self.dead_on:
            return True
        return self.retry_on is not None and not names & self.retry_on

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
    #: Each queue's flow control (rdq_core/flow.py), from the same configuration.
    flows: FlowBook = field(default_factory=FlowBook)

    def flow_for(self, queue: str) -> FlowPolicy:
        return self.flows.for_queue(queue)

    def for_task(self, task: Task) -> RetryPolicy:
        queue_policy = self.queues.get(task.queue, self.default)
        return RetryPolicy(
            max_attempts=task.max_attempts or queue_policy.max_attempts,
            backoff=task.backoff or queue_policy.backoff,
            retry_on=queue_policy.retry_on,
            dead_on=queue_policy.dead_on,
        )

    def gives_up_on(self, task: Task, exc: BaseException) -> bool:
        """Whether ``exc`` raised by ``task``'s handler dead-letters at once (its queue's
        ``dead_on`` / ``retry_on``)."""
        return self.queues.get(task.queue, self.default).gives_up_on(exc)

    def retry_delay(self, task: Task, rng: random.Random | None = None) -> float | None:
        """Seconds before the next try after a failed attempt of ``task``, or None when that
        attempt spends its budget. ``task.attempt_count`` is the budget used *before* it."""
        policy = self.for_task(task)
        used = task.attempt_count + 1
        if used >= policy.max_attempts:
            return None
        return policy.delay_after(used, rng)


def exception_type_names(kind: type) -> frozenset[str]:
    """Every name ``retry_on`` / ``dead_on`` may use for ``kind``: bare and module-qualified, of
    the class and each of its bases."""
    names: set[str] = set()
    for base in kind.__mro__:
        names.add(base.__qualname__)
        names.add(f"{base.__module__}.{base.__qualname__}")
    return frozenset(names)


def _exception_names(queue: str, key: str, raw: object) -> frozenset[str]:
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not all(
            isinstance(name, str) and name.strip() == name and name for name in raw):
        raise ConfigurationError(f"policy for queue {queue!r}: {key} must be a list of exception type names")
    return frozenset(raw)


def _backoff(queue: str, raw: object) -> Backoff:
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"policy for queue {queue!r}: backoff must be an object of {', '.join(BACKOFF_KEYS)}")
    for key in raw:
        if key not in BACKOFF_KEYS:
            raise unknown_key_error(f"policy for queue {queue!r}: backoff: ", key, BACKOFF_KEYS)
    return Backoff(**{**DEFAULT_BACKOFF.to_dict(), **dict(raw)})


def policy_book_from_config(config: Mapping[str, object] | None) -> PolicyBook:
    """Build a PolicyBook from JSON-shaped config, e.g. ``RDQ_QUEUE_POLICIES``::

        {"emails": {"max_attempts": 8, "backoff": {"initial_seconds": 5},
                    "dead_on": ["ValueError"], "retry_on": ["TimeoutError", "myapp.Throttled"]}}

    A key no policy reads (``POLICY_KEYS``; ``concurrency_limt``, ``rate-limit``) is refused with
    a ``ConfigurationError`` naming the queue, the key and its nearest valid spelling.
    """
    if not config:
        return PolicyBook()
    queues: dict[str, RetryPolicy] = {}
    for queue, raw in config.items():
        if not isinstance(raw, Mapping):
            raise ConfigurationError(f"policy for queue {queue!r} must be an object")
        for key in raw:
            if key not in POLICY_KEYS:
                raise unknown_key_error(f"policy for queue {str(queue)!r}: ", key, POLICY_KEYS)
        backoff = DEFAULT_BACKOFF if raw.get("backoff") is None else _backoff(str(queue), raw["backoff"])
        retry_on = raw.get("retry_on")
        queues[str(queue)] = RetryPolicy(
            max_attempts=int(raw.get("max_attempts", DEFAULT_MAX_ATTEMPTS)), backoff=backoff,
            retry_on=None if retry_on is None else _exception_names(str(queue), "retry_on", retry_on),
            dead_on=_exception_names(str(queue), "dead_on", raw.get("dead_on") or []),
        )
    return PolicyBook(queues=queues, flows=flow_book_from_config(config))
