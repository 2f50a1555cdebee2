"""The shared record codec builds the same ``Task`` the dataclass's own ``__init__`` would."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from rdq_core.model import Task, TaskStatus
from rdq_core.storage.codec import RecordCodec, epoch_micros, instant


RECORD = {
    "id": "t1", "queue": "q", "handler": "h", "payload": '{"n": 1}', "status": "IN_FLIGHT",
    "headers": '{"k": "v"}', "attempt_count": "2", "redrive_count": "1", "max_attempts": "5",
    "backoff": None, "next_attempt_at": "1764806400000000", "lease_expires_at": "1764806430000000",
    "created_at": "1764806300000000", "updated_at": "1764806400000000", "dead_at": None, "result": None,
    "last_error": '{"type": "E", "message": "m"}', "claim_token": "tok", "claimed_at": "1764806400000000",
    "priority": "3", "concurrency_key": "c", "rate_key": "", "group": "g", "dedupe_key": None,
}


def test_a_decoded_task_is_the_task_its_constructor_makes():
    task = RecordCodec(time=epoch_micros).task(RECORD)
    rebuilt = Task(**{f.name: getattr(task, f.name) for f in dataclasses.fields(Task)})
    assert task == rebuilt and hash(task.id) == hash(rebuilt.id)
    assert set(vars(task)) == {f.name for f in dataclasses.fields(Task)}  # every field, nothing else
    assert task.status is TaskStatus.IN_FLIGHT and task.attempt_count == 2 and task.priority == 3
    assert task.headers == {"k": "v"} and task.rate_key is None and task.attempts == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.status = TaskStatus.DEAD  # type: ignore[misc]


def test_instants_come_back_as_aware_utc():
    utc = datetime(2026, 12, 3, 23, 0, tzinfo=timezone.utc)
    assert instant(utc) is utc
    assert instant(datetime(2026, 12, 3, 23, 0)) == utc
    assert instant("2026-12-04T00:00:00+01:00") == utc
    assert instant("2026-12-04T00:00:00+01:00").tzinfo is timezone.utc


def test_who_claimed_shows_only_while_in_flight_and_an_empty_name_is_none():
    codec = RecordCodec(time=epoch_micros)
    assert codec.task({**RECORD, "claimed_by": "host:1"}).claimed_by == "host:1"
    assert codec.task({**RECORD, "claimed_by": ""}).claimed_by is None, "a claimer that gave no name"
    assert codec.task(RECORD).claimed_by is None, "a store that keeps no such field"
    # A store may keep the last claim's name after it ends: a finished task shows none.
    assert codec.task({**RECORD, "status": "SUCCEEDED", "claimed_by": "host:1"}).claimed_by is None
    task = codec.task({**RECORD, "claimed_by": "host:1"})
    assert Task.from_dict(task.to_dict()) == task and task.to_dict()["claimed_by"] == "host:1"
