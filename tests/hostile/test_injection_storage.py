"""Nothing a request sends is interpreted as query syntax — on EVERY backend.

The same hostile values the HTTP tests send (SQL, MongoDB operators, Redis key separators, hash
tags and glob characters, path traversal, Unicode tricks) go through the public ``Client`` into
a real SQLite file, PostgreSQL scratch schema, Redis key prefix and MongoDB-wire database. Each
must end in a precise ``InvalidInput`` (naming the field) or a literal no-match, and the store
must be exactly as it was: same tasks, same statuses, same dead letters, tables/keys intact.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone

import pytest

from rdq_core import Client
from rdq_core.errors import InvalidCursor, InvalidInput, TaskNotFound
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus

SQL = "'; DROP TABLE rdq_tasks; --"
#: Names that must never be accepted as a queue, handler or task id.
HOSTILE_NAMES = [
    SQL, "q' OR '1'='1", 'q" OR 1=1 --', "q; DELETE FROM rdq_tasks",
    '{"$gt": ""}', "$gt", "$where", "q.$ne",
    "a:b", "{x}", "q{victim}", "*", "q*", "q?", "q[a-z]",
    "../../etc/passwd", "..", "q/../victim", "q%2F..", "q\\..",
    "Q", "ｑ", "q\u200b", "q\u0000", "q\ud800", "victim\n", " victim", "é",
    "", "a" * 121,
]
#: Strings that are valid *values* (an error type filter) and must match only themselves.
HOSTILE_FILTER_VALUES = [SQL, '{"$gt": ""}', "$gt", "*", "Boom*", "B?om", "[B]oom", "a:b", "{x}", ".*", "%", "Boom' OR '1'='1",
                         "ｂoom"]
#: Non-string values that would become operators if passed through to a query.
OPERATOR_OBJECTS = [{"$gt": ""}, {"$ne": None}, {"$regex": ".*"}, ["Boom"], 1, True]


def _dead_letter(client: Client, queue: str, count: int) -> list[str]:
    claimed = client.storage.claim(queue, count, 60)
    client.storage.settle([
        Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo("Boom", "kaput"))
        for c in claimed
    ])
    return sorted(c.task.id for c in claimed)


def _snapshot(client: Client, ids: list[str]) -> dict:
    tasks = {}
    for task_id in ids:
        task = client.get(task_id)
        tasks[task_id] = (task.queue, task.handler, task.status, task.attempt_count, task.payload, dict(task.headers),
                          len(task.attempts))
    dead = [t.id for t in client.list_dead("victim", limit=500).tasks]
    stats = client.stats("victim").to_dict()
    stats.pop("oldest_pending_age_seconds", None)
    return {"tasks": tasks, "dead": dead, "stats": stats}


@pytest.fixture
def seeded(any_store_url):
    client = Client(any_store_url)
    ids = ["victim-1", "victim-2", "victim-3", "victim-4"]
    client.enqueue_many("victim", [{"handler": "work", "id": i, "payload": {"n": n}} for n, i in enumerate(ids)])
    dead = _dead_letter(client, "victim", 2)
    assert len(dead) == 2
    try:
        yield client, ids, _snapshot(client, ids)
    finally:
        client.close()


def _invalid(call, field_prefix: str) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        call()
    assert caught.value.field and caught.value.field.startswith(field_prefix), (caught.value.field, str(caught.value))
    return caught.value


def test_hostile_names_are_refused_and_change_nothing(seeded):
    client, ids, before = seeded
    for name in HOSTILE_NAMES:
        _invalid(lambda name=name: client.enqueue(name, "work", {}), "queue")
        _invalid(lambda name=name: client.enqueue("victim", name, {}), "handler")
        _invalid(lambda name=name: client.enqueue_many(name, [{"handler": "work"}]), "queue")
        _invalid(lambda name=name: client.stats(name), "queue")
        _invalid(lambda name=name: client.list_dead(name), "queue")
        _invalid(lambda name=name: client.list_dead("victim", handler=name), "handler")
        _invalid(lambda name=name: client.redrive(name, all=True), "queue")
        _invalid(lambda name=name: client.purge_dead(name, all=True), "queue")
        _invalid(lambda name=name: client.redrive("victim", handler=name), "handler")
        _invalid(lambda name=name: client.purge_dead("victim", handler=name), "handler")
        if name not in ("Q",) and not name.startswith("a" * 10):  # "Q" and long names are fine ids... but not these
            _invalid(lambda name=name: client.get(name), "id")
            _invalid(lambda name=name: client.cancel(name), "id")
            _invalid(lambda name=name: client.enqueue("victim", "work", {}, id=name), "id")
            _invalid(lambda name=name: client.redrive("victim", ids=[name]), "ids")
            _invalid(lambda name=name: client.purge_dead("victim", ids=[name]), "ids")
    assert _snapshot(client, ids) == before


def test_operator_objects_are_refused_where_a_string_is_expected(seeded):
    client, ids, before = seeded
    for value in OPERATOR_OBJECTS:
        _invalid(lambda value=value: client.get(value), "id")
        _invalid(lambda value=value: client.cancel(value), "id")
        _invalid(lambda value=value: client.enqueue("victim", "work", {}, id=value), "id")
        _invalid(lambda value=value: client.enqueue(value, "work", {}), "queue")
        _invalid(lambda value=value: client.enqueue("victim", value, {}), "handler")
        _invalid(lambda value=value: client.list_dead("victim", error_type=value), "error_type")
        _invalid(lambda value=value: client.list_dead("victim", handler=value), "handler")
        _invalid(lambda value=value: client.redrive("victim", error_type=value), "error_type")
        _invalid(lambda value=value: client.purge_dead("victim", error_type=value), "error_type")
        _invalid(lambda value=value: client.redrive("victim", ids=[value]), "ids")
        _invalid(lambda value=value: client.purge_dead("victim", ids=[value]), "ids")
        _invalid(lambda value=value: client.list_dead("victim", cursor=value), "cursor")
    assert _snapshot(client, ids) == before


def test_hostile_filter_values_match_only_themselves(seeded):
    client, ids, before = seeded
    for value in HOSTILE_FILTER_VALUES:
        page = client.list_dead("victim", error_type=value)
        assert page.tasks == () and page.next_cursor is None, value
        assert client.redrive("victim", error_type=value) == 0, value
        assert client.purge_dead("victim", error_type=value) == 0, value
    # Unicode that cannot be stored as text is refused, not sent to the store.
    for value in ("Boom\u0000", "Boom\ud800"):
        _invalid(lambda value=value: client.list_dead("victim", error_type=value), "error_type")
        _invalid(lambda value=value: client.purge_dead("victim", error_type=value), "error_type")
    # Ids that look like patterns but are valid ids name nothing.
    assert client.purge_dead("victim", ids=["victim-9", "victim-1.", "victim-~"]) == 0
    with pytest.raises(TaskNotFound):
        client.get("victim-")
    assert _snapshot(client, ids) == before
    # And the real filter still works: the selection is literal, not disabled.
    assert [t.id for t in client.list_dead("victim", error_type="Boom").tasks] == before["dead"]


def _cursor(data: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def test_forged_and_garbage_cursors_are_invalid_cursor(seeded):
    client, ids, before = seeded
    first = client.list_dead("victim", limit=1)
    assert first.next_cursor and len(first.tasks) == 1
    forged = [
        "", "x", "*", SQL, '{"$gt": ""}', "a:b", "{x}", "../..", "ｑ", "\u0000", "A" * 1025,
        _cursor({"q": "other", "t": 1, "id": "victim-1"}),            # another queue's position
        _cursor({"q": "victim", "t": 10**30, "id": "victim-1"}),      # overflows every store
        _cursor({"q": "victim", "t": -10**30, "id": "victim-1"}),
        _cursor({"q": "victim", "t": 1, "id": {"$gt": ""}}),          # operator as the keyset id
        _cursor({"q": "victim", "t": 1, "id": SQL}),
        _cursor({"q": "victim", "t": 1, "id": "a\u0000b"}),
        _cursor({"q": "victim", "t": "1", "id": "victim-1"}),
        _cursor({"q": "victim", "t": True, "id": "victim-1"}),
        _cursor(["victim", 1, "victim-1"]),
        base64.urlsafe_b64encode(b"\xff\xfe\xfd").decode(),
    ]
    for cursor in forged:
        with pytest.raises(InvalidCursor):
            client.list_dead("victim", cursor=cursor)
    # The cursor the store issued still pages to the second dead task.
    second = client.list_dead("victim", limit=1, cursor=first.next_cursor)
    assert [t.id for t in first.tasks + second.tasks] == before["dead"]
    assert _snapshot(client, ids) == before


def test_hostile_payload_and_headers_are_stored_as_literal_data(seeded):
    client, ids, before = seeded
    payload = {"$gt": "", "$where": "sleep(1000)", SQL: [SQL], "a:b": "{x}", "*": None, "..": "../../etc/passwd",
               "ｑ": "\u200b", "nested": {"$ne": None, "$regex": ".*"}}
    headers = {"$gt": "", "a:b": "{x}", "*": "*", "x-sql": SQL, "{victim}": "..", "ｑ": "\u200b"}
    task = client.enqueue("literal", "work", payload, headers=headers, id="literal-1")
    again = client.get("literal-1")
    assert (task.payload, dict(task.headers)) == (payload, headers)
    assert (again.payload, dict(again.headers), again.queue) == (payload, headers, "literal")
    assert client.stats("literal").pending == 1
    # Values the stores cannot hold as text are refused up front on every backend (not a 5xx in one).
    for bad in ({"a": "\u0000"}, {"\u0000": "a"}, {"a": "\ud800"}, {"\udfff": "a"}):
        _invalid(lambda bad=bad: client.enqueue("literal", "work", {}, headers=bad), "headers")
    for bad in ("\u0000", {"k\u0000": 1}, "\ud800", ["ok", {"k": "\udc00"}]):
        _invalid(lambda bad=bad: client.enqueue("literal", "work", bad), "payload")
    assert client.stats("literal").pending == 1
    assert _snapshot(client, ids) == before


@pytest.mark.parametrize("run_at", ["0001-01-01T00:00:00+00:01", "9999-12-31T23:59:59-00:01", "0001-01-01T00:00:00Z",
                                    "9999-12-31T23:59:59.999999Z"])
def test_extreme_run_at_is_clamped_not_a_crash(any_store_url, run_at):
    """A valid RFC 3339 instant outside datetime's UTC range is clamped (long ago = due now)."""
    with Client(any_store_url) as client:
        task = client.enqueue("edge", "work", {}, run_at=run_at, id="edge-1")
        assert client.get("edge-1").status is TaskStatus.PENDING
        due = task.next_attempt_at <= datetime.now(timezone.utc)
        assert due == run_at.startswith("0001")
        assert [c.task.id for c in client.storage.claim("edge", 10, 60)] == (["edge-1"] if due else [])
