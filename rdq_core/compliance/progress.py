"""Progress: a due task that every limit allows is claimed, whatever sits ahead of it.

Safety (no limit exceeded, no task held twice) is checked elsewhere; this module checks the other
half of the promise (docs/flow-control.md#progress). The property, on every store:

    **A claim is work-conserving.** A claim of ``n`` that returns fewer than ``n`` tasks leaves no
    due PENDING task of its queue that every limit would still allow.

So a due, allowed task waits only behind allowed tasks that rank before it (in priority, aging
and group order), never behind blocked ones: with nothing new arriving ahead of it, it is claimed
within ``ceil(A / n) + 1`` claims of ``n``, where ``A`` is the number of allowed tasks that rank
before it -- and in the first claim when nothing allowed ranks before it, however many full keys,
spent rate keys, busy tenants or delayed-only groups sit in front. (The ``+ 1`` is a claim that
fills up exactly while the task still ranks behind.)

"Allowed" is judged from what the test itself did against the store: the concurrency keys whose
claims it holds, the claims of each rate key in the current period (rate limits here count per
hour, so every claim of the test is inside the period), ``max_in_flight`` and pause.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..flow import FlowPolicy, RateLimit
from ..model import ClaimedTask, NewTask, Task, TaskStatus
from ..storage.spi import Storage
from .capabilities import Capabilities
from .flow_control import done, flow_task, ids

#: Examples of the randomised property per store (each a fresh queue of the test's store).
PROGRESS_EXAMPLES = 30
HOUR = 3600.0


@dataclass
class ClaimLedger:
    """What the test holds in one queue: its claims by task id, and every claim it ever made."""

    queue: str
    flow: FlowPolicy
    held: dict[str, ClaimedTask] = field(default_factory=dict)
    rate_claims: Counter[str] = field(default_factory=Counter)
    paused: bool = False

    def record(self, claimed: Sequence[ClaimedTask]) -> None:
        for claim in claimed:
            assert claim.task.id not in self.held, f"{claim.task.id} claimed while the test still holds it"
            self.held[claim.task.id] = claim
            if claim.task.rate_key is not None:
                self.rate_claims[claim.task.rate_key] += 1

    def settle_some(self, storage: Storage, count: int) -> None:
        chosen = sorted(self.held)[:count]
        storage.settle(done(self.held.pop(task_id) for task_id in chosen))

    def running(self, key: str) -> int:
        return sum(1 for c in self.held.values() if c.task.concurrency_key == key)

    def allows(self, task: Task) -> bool:
        """Whether every limit of the queue's policy lets ``task`` start now."""
        flow = self.flow
        if self.paused:
            return False
        if flow.max_in_flight is not None and len(self.held) >= flow.max_in_flight:
            return False
        key = task.concurrency_key
        if key is not None and (limit := flow.limit_for(key)) is not None and self.running(key) >= limit:
            return False
        rate = task.rate_key
        if rate is not None and flow.rate_limit is not None and self.rate_claims[rate] >= flow.rate_limit.count:
            return False
        return True

    def check_limits(self) -> None:
        flow = self.flow
        if flow.max_in_flight is not None:
            assert len(self.held) <= flow.max_in_flight, "max_in_flight exceeded"
        for key, n in Counter(c.task.concurrency_key for c in self.held.values() if c.task.concurrency_key).items():
            limit = flow.limit_for(key)
            assert limit is None or n <= limit, f"key {key!r}: {n} in flight over its limit {limit}"
        if flow.rate_limit is not None:
            for rate, n in self.rate_claims.items():
                assert n <= flow.rate_limit.count, f"rate key {rate!r}: {n} claims in the period over {flow.rate_limit}"


def pending_due(storage: Storage, queue: str) -> list[Task]:
    """The queue's PENDING tasks that are due by the store's clock."""
    now = storage.now()
    tasks: list[Task] = []
    cursor: str | None = None
    while True:
        page = storage.list_tasks(queue, status=TaskStatus.PENDING, limit=500, cursor=cursor)
        due = [t for t in page.tasks if t.next_attempt_at is not None and t.next_attempt_at <= now]
        tasks += due
        if page.next_cursor is None or len(due) < len(page.tasks):  # PENDING pages go by due time
            return tasks
        cursor = page.next_cursor


def claim_and_check(storage: Storage, ledger: ClaimLedger, limit: int, lease: float = 60.0) -> list[ClaimedTask]:
    """One claim, then the property: a short claim leaves no due task the limits allow."""
    claimed = storage.claim(ledger.queue, limit, lease, ledger.flow)
    assert len(claimed) <= limit
    ledger.record(claimed)
    ledger.check_limits()
    if len(claimed) < limit:
        left = [t.id for t in pending_due(storage, ledger.queue) if ledger.allows(t)]
        assert not left, (f"a claim of {limit} under {ledger.flow} took {len(claimed)} ({ids(claimed)}) "
                          f"and left due tasks every limit allows: {sorted(left)[:10]}")
    return claimed


def enqueue_in_chunks(storage: Storage, tasks: Sequence[NewTask], chunk: int = 500) -> None:
    for start in range(0, len(tasks), chunk):
        storage.enqueue(tasks[start:start + chunk])


# -- the randomised scenario ----------------------------------------------------------------
@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    concurrency = draw(st.one_of(st.none(), st.integers(1, 2)))
    rate = draw(st.one_of(st.none(), st.integers(1, 3)))
    policy = FlowPolicy(
        concurrency_limit=concurrency,
        concurrency_overrides=draw(st.sampled_from([{}, {"k1": 3}])) if concurrency is not None else {},
        max_in_flight=draw(st.one_of(st.none(), st.integers(2, 12))),
        rate_limit=None if rate is None else RateLimit(rate, HOUR),
        fair_groups=draw(st.booleans()),
        priority_aging_seconds=draw(st.sampled_from([None, None, 30.0])),
    )
    tasks = draw(st.lists(st.fixed_dictionaries({
        "priority": st.integers(0, 2),
        "group": st.sampled_from([None, "a", "b", "c", "d"]),
        "delayed": st.booleans(),
        "concurrency_key": st.sampled_from([None, "k1", "k2", "k3"]),
        "rate_key": st.sampled_from([None, "r1", "r2"]),
    }), min_size=1, max_size=30))
    steps = draw(st.lists(st.tuples(st.sampled_from(["claim", "claim", "settle", "pause", "resume"]),
                                    st.integers(1, 5)), min_size=1, max_size=12))
    return {"policy": policy, "tasks": tasks, "steps": steps}


def run_scenario(storage: Storage, queue: str, scenario: dict[str, Any]) -> None:
    ledger = ClaimLedger(queue, scenario["policy"])
    enqueue_in_chunks(storage, [
        flow_task(f"{queue}-{n}", queue, priority=t["priority"], group=t["group"], concurrency_key=t["concurrency_key"],
                  rate_key=t["rate_key"], delay_seconds=HOUR if t["delayed"] else 0)
        for n, t in enumerate(scenario["tasks"])])
    try:
        for step, n in scenario["steps"]:
            if step == "claim":
                claim_and_check(storage, ledger, n)
            elif step == "settle":
                ledger.settle_some(storage, n)
            else:
                ledger.paused = step == "pause"
                storage.set_paused(queue, ledger.paused)
        # Then drain: with nothing new arriving, every allowed task is claimed and the rounds end.
        ledger.paused = False
        storage.set_paused(queue, False)
        for _ in range(len(scenario["tasks"]) + 2):
            if not claim_and_check(storage, ledger, 3):
                break
        else:
            raise AssertionError("claims kept returning tasks beyond the number of tasks enqueued")
    finally:
        storage.set_paused(queue, False)
        if ledger.held:
            storage.settle(done(ledger.held.values()))


def five_behind_a_blocked_head(storage: Storage, ledger: ClaimLedger, blocked: int, **key: str) -> None:
    """``blocked`` tasks of one key, then 5 without it: the first claim takes one of the key (which
    then blocks the rest), the next takes the 5 behind them all."""
    queue = ledger.queue
    enqueue_in_chunks(storage, [flow_task(f"hot-{n:05d}", queue, **key) for n in range(blocked)])
    storage.enqueue([flow_task(f"other-{n}", queue) for n in range(5)])
    assert ids(claim_and_check(storage, ledger, 1)) == ["hot-00000"]
    assert sorted(ids(claim_and_check(storage, ledger, 5))) == [f"other-{n}" for n in range(5)]


class ProgressCompliance:
    capabilities: Capabilities  # declared by the suite class this is mixed into

    # -- the property, randomised -----------------------------------------------------------
    def test_every_claim_is_work_conserving_under_any_mix_of_limits(self, storage: Storage) -> None:
        numbers = itertools.count()

        @settings(max_examples=PROGRESS_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(scenario=scenarios())
        def check(scenario: dict[str, Any]) -> None:
            run_scenario(storage, f"progress-{next(numbers)}", scenario)

        check()

    # -- adversarial heads ------------------------------------------------------------------
    def test_a_due_group_behind_groups_of_only_delayed_tasks_is_claimed_at_once(self, storage: Storage) -> None:
        fair = FlowPolicy(fair_groups=True)
        for queue, delayed_groups, batch in (("fair-1", 1, 1), ("fair-10", 10, 10), ("fair-250", 250, 1)):
            enqueue_in_chunks(storage, [flow_task(f"{queue}-late-{g:03d}", queue, group=f"a{g:03d}", delay_seconds=HOUR)
                                        for g in range(delayed_groups)]
                              + [flow_task(f"{queue}-z{n}", queue, group="z") for n in range(3)])
            ledger = ClaimLedger(queue, fair)
            first = claim_and_check(storage, ledger, batch)
            assert ids(first)[:1] == [f"{queue}-z0"], f"{delayed_groups} delayed-only groups hid the due group"
            for _ in range(3):
                claim_and_check(storage, ledger, batch)
            assert not any(t.id.startswith(f"{queue}-z") for t in pending_due(storage, queue))

    def test_an_idle_tenant_is_claimed_at_once_behind_busy_tenants(self, storage: Storage) -> None:
        flow = FlowPolicy(concurrency_limit=1, fair_groups=True)
        queue = "tenants"
        busy = [f"t{n:02d}" for n in range(12)]
        enqueue_in_chunks(storage, [flow_task(f"{t}-{n}", queue, group=t, concurrency_key=t) for t in busy for n in range(2)])
        ledger = ClaimLedger(queue, flow)
        while len(ledger.held) < len(busy):  # one task of every busy tenant running
            assert claim_and_check(storage, ledger, 5)
        storage.enqueue([flow_task("zz-idle", queue, group="zz", concurrency_key="zz")])
        assert ids(claim_and_check(storage, ledger, 1)) == ["zz-idle"]

    def test_thousands_of_tasks_of_a_full_key_do_not_hide_the_tasks_behind_them(self, storage: Storage) -> None:
        ledger = ClaimLedger("hot-key", FlowPolicy(concurrency_limit=1))
        five_behind_a_blocked_head(storage, ledger, 2500, concurrency_key="hot")
        assert claim_and_check(storage, ledger, 5) == []

    def test_one_claim_takes_the_tasks_behind_a_key_that_fills_up_during_it(self, storage: Storage) -> None:
        # The key is not full when the claim starts: it fills with the claim's own first task,
        # and the rest of whatever the claim read first is that key's. The claim still comes back
        # full, with the tasks behind them, at the same priority or a later one, aged or not.
        for queue, flow, priority in (("fills", FlowPolicy(concurrency_limit=1), 0),
                                      ("fills-later", FlowPolicy(concurrency_limit=2), 1),
                                      ("fills-aged", FlowPolicy(concurrency_limit=1, priority_aging_seconds=30.0), 1)):
            enqueue_in_chunks(storage, [flow_task(f"{queue}-hot-{n:05d}", queue, concurrency_key="hot")
                                        for n in range(1500)])
            storage.enqueue([flow_task(f"{queue}-other-{n}", queue, priority=priority) for n in range(5)])
            ledger = ClaimLedger(queue, flow)
            claimed = ids(claim_and_check(storage, ledger, 5 + (flow.concurrency_limit or 0)))
            assert sorted(claimed) == sorted([f"{queue}-hot-{n:05d}" for n in range(flow.concurrency_limit or 0)]
                                             + [f"{queue}-other-{n}" for n in range(5)]), claimed

    def test_a_spent_rate_key_does_not_hide_the_tasks_behind_it(self, storage: Storage) -> None:
        ledger = ClaimLedger("hot-rate", FlowPolicy(rate_limit=RateLimit(1, HOUR)))
        five_behind_a_blocked_head(storage, ledger, 1200, rate_key="hot")

    def test_hundreds_of_busy_keys_do_not_starve_an_idle_key(self, storage: Storage) -> None:
        flow = FlowPolicy(concurrency_limit=1)
        queue = "busy-keys"
        keys = [f"k{n:03d}" for n in range(150)]
        enqueue_in_chunks(storage, [flow_task(f"{k}-{n}", queue, concurrency_key=k) for n in range(2) for k in keys])
        ledger = ClaimLedger(queue, flow)
        for _ in range(math.ceil(len(keys) / 50)):
            claim_and_check(storage, ledger, 50)
        assert len(ledger.held) == len(keys), "one task of every key running"
        storage.enqueue([flow_task("idle-0", queue, concurrency_key="idle")])
        assert ids(claim_and_check(storage, ledger, 1)) == ["idle-0"]
