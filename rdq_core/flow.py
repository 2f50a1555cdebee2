"""Flow control: the queue policies a claim honours (docs/flow-control.md).

Parsed once here from the same configuration as the retry policy (``RDQ_QUEUE_POLICIES`` and its
deployed equivalent)::

    {"emails": {"max_attempts": 8,
                "concurrency_limit": {"default": 2, "keys": {"big-customer": 5}},
                "max_in_flight": 50, "rate_limit": "10/s", "fair_groups": true,
                "priority_aging_seconds": 60}}

A backend's claim receives the queue's ``FlowPolicy``; ``NO_FLOW`` (no limits, no fairness, no
aging) keeps the claim what it always was: due tasks by priority, then due time, then id.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .errors import ConfigurationError

#: The policy keys this module reads (the retry policy reads its own beside them).
FLOW_POLICY_KEYS = ("concurrency_limit", "max_in_flight", "rate_limit", "fair_groups", "priority_aging_seconds")

_PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
            "h": 3600.0, "hour": 3600.0, "d": 86_400.0, "day": 86_400.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([a-z]+)\s*")


#: How soon after its claim comes back a worker must start a rate-keyed task, or release it
#: unstarted (which gives its rate slot back). A store counts a rate key's claims over the period
#: plus this, so starts -- each within this of its claim -- are at most the rate in any window of
#: the period (docs/flow-control.md, "Rate").
RATE_START_SLACK = 0.05


@dataclass(frozen=True)
class RateLimit:
    """At most ``count`` starts per ``period_seconds`` of one rate_key, in any window of that length."""

    count: int
    period_seconds: float

    @property
    def window_seconds(self) -> float:
        """The span a claim counts a rate key's earlier claims over: the period plus the slack a
        claimed task has to start in."""
        return self.period_seconds + RATE_START_SLACK

    def __str__(self) -> str:
        return f"{self.count}/{self.period_seconds:g}s"


@dataclass(frozen=True)
class FlowPolicy:
    """One queue's flow-control policy. Every limit is optional; the default limits nothing."""

    concurrency_limit: int | None = None
    concurrency_overrides: Mapping[str, int] = field(default_factory=dict)
    max_in_flight: int | None = None
    rate_limit: RateLimit | None = None
    fair_groups: bool = False
    priority_aging_seconds: float | None = None

    def limit_for(self, concurrency_key: str) -> int | None:
        """How many tasks of ``concurrency_key`` may be in flight at once (None: no limit)."""
        return self.concurrency_overrides.get(concurrency_key, self.concurrency_limit)

    @property
    def limits_concurrency(self) -> bool:
        return self.concurrency_limit is not None or bool(self.concurrency_overrides)

    @property
    def serialised(self) -> bool:
        """Whether a claim must read state other claims write (in-flight counts, the rate log,
        the fairness cursor): such claims of one queue are serialised by the store."""
        return (self.limits_concurrency or self.max_in_flight is not None or self.rate_limit is not None
                or self.fair_groups)

    @property
    def plain(self) -> bool:
        """No limit, no fairness, no aging: the claim of the queue is the plain ordered claim."""
        return not self.serialised and self.priority_aging_seconds is None


NO_FLOW = FlowPolicy()


@dataclass(frozen=True)
class FlowBook:
    """Each queue's flow policy (queues not named get ``NO_FLOW``)."""

    queues: Mapping[str, FlowPolicy] = field(default_factory=dict)

    def for_queue(self, queue: str) -> FlowPolicy:
        return self.queues.get(queue, NO_FLOW)


def parse_rate(text: Any, where: str = "rate_limit") -> RateLimit:
    """``"10/s"``, ``"600/min"``, ``"5/h"``, ``"100/10s"`` → RateLimit."""
    match = _RATE.fullmatch(text) if isinstance(text, str) else None
    if match is None or match.group(3) not in _PERIODS:
        raise ConfigurationError(f"{where} must look like \"10/s\", \"600/min\" or \"5/h\", not {text!r}")
    count = int(match.group(1))
    multiple = float(match.group(2)) if match.group(2) else 1.0
    period = multiple * _PERIODS[match.group(3)]
    if count < 1 or period <= 0:
        raise ConfigurationError(f"{where} needs a count of at least 1 per a positive period, not {text!r}")
    return RateLimit(count=count, period_seconds=period)


def unknown_key_error(where: str, key: object, valid: Sequence[str]) -> ConfigurationError:
    """The refusal of a policy key nothing reads, naming the valid spelling nearest to it: a
    misspelled limit that is skipped would leave the queue running with no limit at all."""
    text = str(key)
    # "rate-limit", "Rate_Limit": the same words in another spelling.
    normalised = re.sub(r"[\s-]+", "_", text.strip()).lower()
    nearest = [normalised] if normalised in valid else difflib.get_close_matches(normalised, valid, n=1, cutoff=0.6)
    hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
    return ConfigurationError(f"{where}unknown key {text!r}{hint}; the valid keys are {', '.join(valid)}")


def _positive_int(value: Any, where: str) -> int:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"{where} must be a positive integer, not {value!r}")
    return value


def flow_policy_from_config(raw: Mapping[str, Any], queue: str = "") -> FlowPolicy:
    """One queue's policy object (the flow keys of it; other keys are the retry policy's, and a
    key neither reads is refused by ``rdq_core.engine.retry.policy_book_from_config``)."""
    where = f"policy for queue {queue!r}: " if queue else ""
    limit: int | None = None
    overrides: dict[str, int] = {}
    concurrency = raw.get("concurrency_limit")
    if isinstance(concurrency, Mapping):
        unknown = sorted(set(concurrency) - {"default", "keys"}, key=str)
        if unknown:
            raise unknown_key_error(f"{where}concurrency_limit: ", unknown[0], ("default", "keys"))
        if concurrency.get("default") is not None:
            limit = _positive_int(concurrency["default"], f"{where}concurrency_limit.default")
        keys = concurrency.get("keys") or {}
        if not isinstance(keys, Mapping):
            raise ConfigurationError(f"{where}concurrency_limit.keys must be an object of key to limit")
        overrides = {str(k): _positive_int(v, f"{where}concurrency_limit.keys[{k!r}]") for k, v in keys.items()}
    elif concurrency is not None:
        limit = _positive_int(concurrency, f"{where}concurrency_limit")
    max_in_flight = raw.get("max_in_flight")
    rate = raw.get("rate_limit")
    fair = raw.get("fair_groups", False)
    if not isinstance(fair, bool):
        raise ConfigurationError(f"{where}fair_groups must be true or false")
    aging = raw.get("priority_aging_seconds")
    if aging is not None and (type(aging) not in (int, float) or not 0 < aging <= 86_400 * 366):
        raise ConfigurationError(f"{where}priority_aging_seconds must be a positive number of seconds")
    return FlowPolicy(
        concurrency_limit=limit,
        concurrency_overrides=overrides,
        max_in_flight=None if max_in_flight is None else _positive_int(max_in_flight, f"{where}max_in_flight"),
        rate_limit=None if rate is None else parse_rate(rate, f"{where}rate_limit"),
        fair_groups=fair,
        priority_aging_seconds=None if aging is None else float(aging),
    )


def flow_book_from_config(config: Mapping[str, object] | None) -> FlowBook:
    """Build a FlowBook from the queue policies' JSON-shaped config (see module doc)."""
    if not config:
        return FlowBook()
    queues: dict[str, FlowPolicy] = {}
    for queue, raw in config.items():
        if not isinstance(raw, Mapping):
            raise ConfigurationError(f"policy for queue {queue!r} must be an object")
        policy = flow_policy_from_config(raw, str(queue))
        if policy != NO_FLOW:
            queues[str(queue)] = policy
    return FlowBook(queues=queues)


# -- the choice a serialised claim makes ------------------------------------------------------
#: Priorities run 0 (first) .. 9; the claim walks them in this order.
PRIORITIES = range(10)
#: How many due tasks a flow-controlled claim of ``limit`` looks at beyond the keys it already
#: knows are full: enough that a few busy keys at the head of the queue do not hide the allowed
#: tasks behind them (a busier head is passed over by the next claim, once those keys are full).
CANDIDATES_PER_CLAIMED = 8
MAX_CANDIDATES = 1000
#: How many groups a fair claim looks up (each one index probe) before it gives up finding more
#: groups with due tasks their keys allow.
MAX_GROUP_PROBES = 200


def candidate_count(limit: int) -> int:
    return min(max(limit * CANDIDATES_PER_CLAIMED, limit), MAX_CANDIDATES)


@dataclass(frozen=True)
class Candidate:
    """A due PENDING task a flow-controlled claim may take; ``due`` in the store's microseconds."""

    id: str
    priority: int
    due: int
    concurrency_key: str | None = None
    rate_key: str | None = None
    group: str | None = None


@dataclass(frozen=True)
class FlowState:
    """What the store holds now, read inside the claim's serialised step.

    ``in_flight``: IN_FLIGHT tasks of the queue; ``in_flight_by_key``: of each concurrency key
    (only keys with some); ``recent_claims``: per rate key, claims within the last period;
    ``last_group``: the group the previous fair claim served last."""

    in_flight: int = 0
    in_flight_by_key: Mapping[str, int] = field(default_factory=dict)
    recent_claims: Mapping[str, int] = field(default_factory=dict)
    last_group: str | None = None


@dataclass(frozen=True)
class FlowChoice:
    ids: tuple[str, ...]
    #: The group the last task taken belongs to ('' for no group), for the next fair claim.
    served_group: str | None = None


def rank(flow: FlowPolicy, candidate: Candidate) -> tuple[int, int, str]:
    """Claim order: priority, then due time, then id; with aging, due time + priority x aging."""
    if flow.priority_aging_seconds is not None:
        return (candidate.due + int(candidate.priority * flow.priority_aging_seconds * 1_000_000), 0, candidate.id)
    return (candidate.priority, candidate.due, candidate.id)


def full_keys(flow: FlowPolicy, state: FlowState) -> tuple[list[str], list[str]]:
    """Concurrency keys at their limit and rate keys out of budget: a claim need not read their tasks."""
    concurrency = [key for key, n in state.in_flight_by_key.items() if (limit := flow.limit_for(key)) is not None and n >= limit]
    rate = [key for key, n in state.recent_claims.items()
            if flow.rate_limit is not None and n >= flow.rate_limit.count]
    return concurrency, rate


def choose(flow: FlowPolicy, state: FlowState, candidates: Sequence[Candidate], limit: int) -> FlowChoice:
    """Which candidates one claim of ``limit`` takes under ``flow``, given ``state``.

    Over-limit tasks are passed over (left PENDING, nothing spent) and the allowed ones behind
    them taken. With ``fair_groups`` the claim takes one task per group in turn, groups in name
    order starting after ``state.last_group`` (tasks without a group form the group '')."""
    budget = limit if flow.max_in_flight is None else min(limit, flow.max_in_flight - state.in_flight)
    if budget <= 0:
        return FlowChoice(())
    running = dict(state.in_flight_by_key)
    recent = dict(state.recent_claims)
    rate_count = flow.rate_limit.count if flow.rate_limit is not None else None

    def allowed(candidate: Candidate) -> bool:
        key = candidate.concurrency_key
        if key is not None:
            key_limit = flow.limit_for(key)
            if key_limit is not None and running.get(key, 0) >= key_limit:
                return False
        if rate_count is not None and candidate.rate_key is not None and recent.get(candidate.rate_key, 0) >= rate_count:
            return False
        return True

    def take(candidate: Candidate) -> None:
        if candidate.concurrency_key is not None:
            running[candidate.concurrency_key] = running.get(candidate.concurrency_key, 0) + 1
        if candidate.rate_key is not None:
            recent[candidate.rate_key] = recent.get(candidate.rate_key, 0) + 1
        taken.append(candidate.id)

    taken: list[str] = []
    ordered = sorted(candidates, key=lambda c: rank(flow, c))
    if not flow.fair_groups:
        for candidate in ordered:
            if len(taken) >= budget:
                break
            if allowed(candidate):
                take(candidate)
        return FlowChoice(tuple(taken))

    lanes: dict[str, list[Candidate]] = {}
    for candidate in ordered:
        lanes.setdefault(candidate.group or "", []).append(candidate)
    names = sorted(lanes)
    last = state.last_group
    if last is not None:
        # Round robin across claims: the groups after the one served last come first.
        names = [n for n in names if n > last] + [n for n in names if n <= last]
    queues = {name: iter(lanes[name]) for name in names}
    served: str | None = None
    while len(taken) < budget and queues:
        for name in list(queues):
            if len(taken) >= budget:
                break
            for candidate in queues[name]:
                if allowed(candidate):
                    take(candidate)
                    served = name
                    break
            else:
                del queues[name]  # nothing more this group may run now
    return FlowChoice(tuple(taken), served)


def keys_filled(flow: FlowPolicy, state: FlowState, candidates: Sequence[Candidate],
                choice: FlowChoice) -> tuple[set[str], set[str]]:
    """The concurrency keys at their limit and the rate keys out of budget once ``choice`` is
    claimed (those already so in ``state`` included)."""
    by_id = {c.id: c for c in candidates}
    running = Counter(state.in_flight_by_key)
    recent = Counter(state.recent_claims)
    for task_id in choice.ids:
        candidate = by_id[task_id]
        if candidate.concurrency_key is not None:
            running[candidate.concurrency_key] += 1
        if candidate.rate_key is not None:
            recent[candidate.rate_key] += 1
    concurrency, rate = full_keys(flow, FlowState(state.in_flight, running, recent, state.last_group))
    return set(concurrency), set(rate)


#: Reads a claim's candidates: due tasks whose keys are not among the (concurrency, rate) keys given.
CandidateReader = Callable[[list[str], list[str]], Sequence[Candidate]]


def choose_work_conserving(flow: FlowPolicy, state: FlowState, read: CandidateReader, limit: int) -> FlowChoice:
    """``choose`` over candidates read by ``read``, re-reading while the claim comes back short
    only because keys filled up *during* the choice.

    A read looks at a bounded number of due tasks whose keys are not known to be full. When most
    of them belong to a few keys that fill up as the claim takes them, the allowed tasks further
    back were never read; each re-read leaves out every key found full so far, so it reaches them
    (docs/flow-control.md#progress). Every re-read adds at least one key to what it leaves out,
    so the loop ends; a claim that comes back short has no due, allowed task left."""
    full_concurrency, full_rate = (sorted(keys) for keys in full_keys(flow, state))
    seen: dict[str, Candidate] = {}
    while True:
        for candidate in read(full_concurrency, full_rate):
            seen.setdefault(candidate.id, candidate)
        choice = choose(flow, state, list(seen.values()), limit)
        budget = limit if flow.max_in_flight is None else min(limit, flow.max_in_flight - state.in_flight)
        if len(choice.ids) >= budget or not seen:
            return choice
        filled_concurrency, filled_rate = keys_filled(flow, state, list(seen.values()), choice)
        new_concurrency = filled_concurrency - set(full_concurrency)
        new_rate = filled_rate - set(full_rate)
        if not new_concurrency and not new_rate:
            return choice
        full_concurrency = sorted(set(full_concurrency) | new_concurrency)
        full_rate = sorted(set(full_rate) | new_rate)
