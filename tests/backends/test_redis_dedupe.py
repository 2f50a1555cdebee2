"""Redis: the dedupe index of a key goes with the tasks it lists -- purged tasks leave no keys."""

from __future__ import annotations

from dataclasses import replace

from rdq_core.model import DeadFilter, Outcome, Settlement, TaskStatus

# test_redis skips the module when the redis client is missing; its fixtures serve here too.
from .test_redis import dead_letter_all, keys_under, new_tasks, storage, storage_url  # noqa: F401 - fixtures


def test_purged_keyed_tasks_leave_no_keys(storage, redis_client, redis_prefix):  # noqa: F811 - fixtures
    storage.enqueue([replace(t, dedupe_key=f"k{i % 2}") for i, t in enumerate(new_tasks(4))])
    assert storage.stats("q").pending == 2, "two keys: two tasks"
    assert any(":dedupe:" in key for key in keys_under(redis_client, redis_prefix))
    first = storage.claim("q", 1, 60)
    storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in first])
    dead_letter_all(storage, "q")
    assert storage.purge_succeeded(0, 100) == 1
    assert storage.purge_dead("q", DeadFilter()) == 1
    assert keys_under(redis_client, redis_prefix) == []
