"""Every enqueue input is checked before anything is written; errors name the field."""

import pytest

from rdq_core.client import build_new_task, build_new_tasks, dead_filter
from rdq_core.errors import InvalidInput
from rdq_core.validation import Limits


def field_of(queue, item):
    with pytest.raises(InvalidInput) as info:
        build_new_task(queue, item)
    return info.value.field


@pytest.mark.parametrize("queue", ["", "Upper", "-lead", "a" * 121, "sp ace", "semi;colon", "{tag}", "q:x", "é", None, 5])
def test_bad_queue_names_are_refused(queue):
    assert field_of(queue, {"handler": "h"}) == "queue"


@pytest.mark.parametrize("handler", ["", "Bad", "x" * 121, "a/b", None, ["h"]])
def test_bad_handler_names_are_refused(handler):
    assert field_of("q", {"handler": handler}) == "handler"


@pytest.mark.parametrize("task_id", ["", "has space", "a" * 129, "{x}", "a:b", {"$gt": ""}, 7, "../etc"])
def test_bad_ids_are_refused(task_id):
    assert field_of("q", {"handler": "h", "id": task_id}) == "id"


def test_valid_names_at_the_edges_pass():
    task = build_new_task("a" * 120, {"handler": "h.x-y_z", "id": "A" * 128, "payload": {"k": [1, None]}})
    assert task.queue == "a" * 120 and task.id == "A" * 128


def test_generated_ids_are_sortable_and_unique():
    ids = [build_new_task("q", {"handler": "h"}).id for _ in range(200)]
    assert len(set(ids)) == 200 and all(len(i) == 26 for i in ids)


def test_payload_limits():
    assert field_of("q", {"handler": "h", "payload": "x" * (Limits.payload_bytes + 1)}) == "payload"
    assert field_of("q", {"handler": "h", "payload": float("nan")}) == "payload"
    assert field_of("q", {"handler": "h", "payload": {"bad": object()}}) == "payload"
    assert field_of("q", {"handler": "h", "payload": "nul\x00byte"}) == "payload"
    deep: object = 1
    for _ in range(Limits.json_depth + 1):
        deep = [deep]
    assert field_of("q", {"handler": "h", "payload": deep}) == "payload"
    build_new_task("q", {"handler": "h", "payload": "\\u0000 is fine when it is text"})


def test_headers_limits():
    assert field_of("q", {"handler": "h", "headers": {"rdq.internal": "x"}}) == "headers"
    assert field_of("q", {"handler": "h", "headers": {"k": 1}}) == "headers"
    assert field_of("q", {"handler": "h", "headers": {f"k{i}": "v" for i in range(Limits.headers_count + 1)}}) == "headers"
    assert field_of("q", {"handler": "h", "headers": ["k"]}) == "headers"


def test_schedule_and_policy_fields():
    assert field_of("q", {"handler": "h", "delay_seconds": -1}) == "delay_seconds"
    assert field_of("q", {"handler": "h", "delay_seconds": True}) == "delay_seconds"
    assert field_of("q", {"handler": "h", "run_at": "tomorrow"}) == "run_at"
    assert field_of("q", {"handler": "h", "run_at": "2030-01-01T00:00:00"}) == "run_at"  # no offset
    assert field_of("q", {"handler": "h", "run_at": "2030-01-01T00:00:00Z", "delay_seconds": 1}) == "run_at"
    assert field_of("q", {"handler": "h", "max_attempts": 0}) == "max_attempts"
    assert field_of("q", {"handler": "h", "max_attempts": 1.5}) == "max_attempts"
    assert field_of("q", {"handler": "h", "backoff": {"factor": 0.5}}) == "backoff"
    assert field_of("q", {"handler": "h", "backoff": {"surprise": 1}}) == "backoff"
    assert field_of("q", {"handler": "h", "colour": "red"}) == "colour"
    task = build_new_task("q", {"handler": "h", "run_at": "2030-01-01T00:00:00Z", "backoff": {"initial_seconds": 3}})
    assert task.run_at.year == 2030 and task.backoff.initial_seconds == 3 and task.backoff.factor == 2


def test_batches_are_bounded_and_name_the_bad_item():
    with pytest.raises(InvalidInput):
        build_new_tasks("q", [])
    with pytest.raises(InvalidInput):
        build_new_tasks("q", [{"handler": "h"}] * (Limits.batch_items + 1))
    with pytest.raises(InvalidInput) as info:
        build_new_tasks("q", [{"handler": "h"}, {"handler": "BAD"}])
    assert info.value.field == "tasks[1].handler"
    with pytest.raises(InvalidInput) as info:
        build_new_tasks("q", [{"handler": "h", "id": "x"}, {"handler": "h", "id": "x"}])
    assert info.value.field == "tasks[1].id"


def test_dlq_filters_are_checked():
    with pytest.raises(InvalidInput):
        dead_filter(handler="{$ne: 1}")
    with pytest.raises(InvalidInput):
        dead_filter(error_type="")
    with pytest.raises(InvalidInput):
        dead_filter(ids=["ok", "not ok"])
    assert dead_filter(error_type="smtp.Refused").error_type == "smtp.Refused"
