"""Flow-control policies and task fields: parsed and validated once, with precise errors."""

from __future__ import annotations

import pytest

from rdq_core.client import build_new_task
from rdq_core.errors import ConfigurationError, InvalidInput
from rdq_core.flow import (
    NO_FLOW,
    Candidate,
    FlowPolicy,
    FlowState,
    RateLimit,
    choose,
    flow_book_from_config,
    full_keys,
    parse_rate,
)
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import DedupeMode, NewTask, TaskStatus
from rdq_core.engine.retry import policy_book_from_config
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig


def test_queue_policies_carry_flow_control_beside_the_retry_policy():
    book = policy_book_from_config({
        "emails": {"max_attempts": 8, "concurrency_limit": {"default": 2, "keys": {"big": 5}}, "max_in_flight": 50,
                   "rate_limit": "600/min", "fair_groups": True, "priority_aging_seconds": 30},
        "plain": {"max_attempts": 3},
    })
    flow = book.flow_for("emails")
    assert flow == FlowPolicy(concurrency_limit=2, concurrency_overrides={"big": 5}, max_in_flight=50,
                              rate_limit=RateLimit(600, 60.0), fair_groups=True, priority_aging_seconds=30.0)
    assert flow.limit_for("big") == 5 and flow.limit_for("other") == 2
    assert flow.serialised and not flow.plain
    assert book.flow_for("plain") is NO_FLOW and book.flow_for("unknown") is NO_FLOW
    assert NO_FLOW.plain and not NO_FLOW.serialised
    assert book.for_task  # the retry side is untouched
    assert policy_book_from_config({"q": {"concurrency_limit": 1}}).flow_for("q").limit_for("k") == 1


@pytest.mark.parametrize("text, expected", [
    ("10/s", RateLimit(10, 1.0)), ("600/min", RateLimit(600, 60.0)), ("5/h", RateLimit(5, 3600.0)),
    ("100/10s", RateLimit(100, 10.0)), (" 3 / day ", RateLimit(3, 86_400.0)),
])
def test_rates_are_read_as_count_per_period(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize("config, needle", [
    ({"q": {"rate_limit": "10 per second"}}, "rate_limit"),
    ({"q": {"rate_limit": "0/s"}}, "rate_limit"),
    ({"q": {"rate_limit": "5/fortnight"}}, "rate_limit"),
    ({"q": {"concurrency_limit": 0}}, "concurrency_limit"),
    ({"q": {"concurrency_limit": "2"}}, "concurrency_limit"),
    ({"q": {"concurrency_limit": {"default": 1, "per": {}}}}, "concurrency_limit"),
    ({"q": {"concurrency_limit": {"keys": {"k": -1}}}}, "concurrency_limit.keys"),
    ({"q": {"max_in_flight": 1.5}}, "max_in_flight"),
    ({"q": {"fair_groups": "yes"}}, "fair_groups"),
    ({"q": {"priority_aging_seconds": -1}}, "priority_aging_seconds"),
    ({"q": []}, "must be an object"),
])
def test_a_bad_policy_is_refused_naming_the_queue_and_key(config, needle):
    with pytest.raises(ConfigurationError) as caught:
        flow_book_from_config(config)
    assert needle in str(caught.value)


def test_task_fields_are_validated_and_kept():
    task = build_new_task("q", {"handler": "h", "priority": 9, "concurrency_key": "Tenant:42", "rate_key": "api.x",
                                "group": "t-1", "dedupe_key": "order~7", "dedupe_for_seconds": 60,
                                "dedupe_states": ["PENDING", "SUCCEEDED"], "dedupe_mode": "debounce",
                                "dedupe_max_wait_seconds": 300})
    assert (task.priority, task.concurrency_key, task.rate_key, task.group) == (9, "Tenant:42", "api.x", "t-1")
    assert task.dedupe_states == (TaskStatus.PENDING, TaskStatus.SUCCEEDED)
    assert task.dedupe_mode is DedupeMode.DEBOUNCE and task.dedupe_max_wait_seconds == 300.0
    assert task.flow_fields()["dedupe_states"] == ["PENDING", "SUCCEEDED"]
    plain = build_new_task("q", {"handler": "h"})
    assert (plain.priority, plain.concurrency_key, plain.group, plain.flow_fields()) == (0, None, None, {})


@pytest.mark.parametrize("field, value", [
    ("priority", -1), ("priority", 10), ("priority", "1"), ("priority", True),
    ("concurrency_key", ""), ("concurrency_key", "a b"), ("rate_key", "x" * 129), ("group", 7),
    ("dedupe_key", "$where"), ("dedupe_for_seconds", -1), ("dedupe_states", []), ("dedupe_states", ["DONE"]),
    ("dedupe_states", "PENDING"), ("dedupe_mode", "merge"), ("dedupe_max_wait_seconds", float("inf")),
])
def test_a_bad_flow_field_is_refused_naming_it(field, value):
    with pytest.raises(InvalidInput) as caught:
        build_new_task("q", {"handler": "h", field: value})
    assert caught.value.field == field


# -- the decision a serialised claim makes ------------------------------------------------------

def _c(task_id: str, priority: int = 0, due: int = 0, key: str | None = None, rate: str | None = None,
       group: str | None = None) -> Candidate:
    return Candidate(task_id, priority, due, key, rate, group)


def test_choose_orders_by_priority_then_due_then_id_and_respects_the_batch():
    candidates = [_c("b", 1, 0), _c("a", 0, 5), _c("c", 0, 5), _c("d", 0, 1)]
    assert choose(NO_FLOW, FlowState(), candidates, 3).ids == ("d", "a", "c")


def test_choose_with_aging_ranks_by_due_plus_priority_times_aging():
    flow = FlowPolicy(priority_aging_seconds=1.0)
    candidates = [_c("urgent", 0, 10_000_000), _c("old-low", 5, 0), _c("recent-low", 5, 6_000_000)]
    assert choose(flow, FlowState(), candidates, 3).ids == ("old-low", "urgent", "recent-low")


def test_choose_skips_full_keys_and_takes_what_is_behind_them():
    flow = FlowPolicy(concurrency_limit=2, concurrency_overrides={"vip": 3})
    state = FlowState(in_flight=3, in_flight_by_key={"a": 2, "vip": 1})
    candidates = [_c("a1", key="a"), _c("v1", key="vip"), _c("v2", key="vip"), _c("v3", key="vip"),
                  _c("b1", key="b"), _c("b2", key="b"), _c("b3", key="b"), _c("free")]
    assert choose(flow, state, candidates, 10).ids == ("b1", "b2", "free", "v1", "v2")  # same due: by id
    assert full_keys(flow, state) == (["a"], [])


def test_choose_caps_the_queue_at_max_in_flight():
    flow = FlowPolicy(max_in_flight=5)
    candidates = [_c(f"t{n}") for n in range(10)]
    assert len(choose(flow, FlowState(in_flight=3), candidates, 10).ids) == 2
    assert choose(flow, FlowState(in_flight=5), candidates, 10).ids == ()


def test_choose_spends_at_most_the_rate_budget_left():
    flow = FlowPolicy(rate_limit=RateLimit(3, 1.0))
    candidates = [_c(f"r{n}", rate="api") for n in range(5)] + [_c("x", rate="other")]
    assert choose(flow, FlowState(recent_claims={"api": 1}), candidates, 10).ids == ("r0", "r1", "x")
    assert full_keys(flow, FlowState(recent_claims={"api": 3, "other": 2})) == ([], ["api"])


def test_choose_takes_groups_in_turn_from_the_one_after_the_last_served():
    flow = FlowPolicy(fair_groups=True)
    candidates = ([_c(f"big{n}", due=n, group="big") for n in range(10)] + [_c("m0", due=50, group="mid")]
                  + [_c("s0", due=60, group="small"), _c("s1", due=61, group="small")] + [_c("n0", due=70)])
    first = choose(flow, FlowState(), candidates, 5)
    assert first.ids == ("n0", "big0", "m0", "s0", "big1") and first.served_group == "big"
    after_mid = choose(flow, FlowState(last_group="mid"), candidates, 4)
    assert after_mid.ids == ("s0", "n0", "big0", "m0") and after_mid.served_group == "mid"


def test_a_worker_claims_under_its_queue_policy(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/w.db")
    running: list[str] = []
    registry = HandlerRegistry()
    registry.register("record", lambda payload, ctx: running.append(payload["key"]))
    storage.enqueue([NewTask(id=f"t{n}", queue="q", handler="record", payload={"key": "k" if n < 3 else f"o{n}"},
                             concurrency_key="k" if n < 3 else None) for n in range(5)])
    policies = policy_book_from_config({"q": {"concurrency_limit": 1, "max_attempts": 2}})
    worker = Worker(storage, WorkerConfig(queues=["q"], batch_size=10, lease_seconds=30), policies=policies,
                    registry=registry)
    try:
        assert worker.run_once() == 3, "one task of key k and the two without a key"
        assert sorted(running) == ["k", "o3", "o4"]
        assert worker.run_once() == 1 and worker.run_once() == 1 and worker.run_once() == 0
    finally:
        worker.stop()
        storage.close()
