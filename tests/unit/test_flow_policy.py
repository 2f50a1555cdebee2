"""Flow-control policies and task fields: parsed and validated once, with precise errors."""

from __future__ import annotations

import pytest

from rdq_core.client import build_new_task
from rdq_core.errors import ConfigurationError, InvalidInput
from rdq_core.flow import NO_FLOW, FlowPolicy, RateLimit, flow_book_from_config, parse_rate
from rdq_core.model import DedupeMode, TaskStatus
from rdq_core.retry import policy_book_from_config


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
