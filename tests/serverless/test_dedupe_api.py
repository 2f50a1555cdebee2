"""Dedupe and snooze over the API function (SQLite): the ``deduplicated`` flag on single and batch
enqueues, precise refusals of bad dedupe fields, and a snoozed task's SNOOZED timeline entry."""

from __future__ import annotations

from rdq_core.engine.handlers import HandlerRegistry, Snooze
from rdq_core.hosts.aws_lambda import connection
from rdq_core.engine.retry import PolicyBook
from rdq_core.engine.runner import BatchRunner

from .test_api import call, request


def enqueue(body: dict, lambda_context) -> tuple[int, dict]:
    status, _, answer = call(request("POST", "/v1/queues/dd/tasks", body), lambda_context)
    return status, answer


def test_a_matched_dedupe_key_answers_200_with_the_existing_task(store_url, lambda_context):
    status, first = enqueue({"handler": "greet", "dedupe_key": "cart-7", "payload": {"v": 1}}, lambda_context)
    assert status == 201 and (first["created"], first["deduplicated"]) == (True, False)
    assert first["dedupe_key"] == "cart-7"
    status, again = enqueue({"handler": "greet", "dedupe_key": "cart-7", "payload": {"v": 2}}, lambda_context)
    assert status == 200 and (again["created"], again["deduplicated"]) == (False, True)
    assert again["id"] == first["id"] and again["payload"] == {"v": 1}
    status, replaced = enqueue({"handler": "greet", "dedupe_key": "cart-7", "payload": {"v": 3},
                                "dedupe_mode": "replace"}, lambda_context)
    assert status == 200 and replaced["deduplicated"] and replaced["payload"] == {"v": 3}
    assert connection.shared_storage().stats("dd").pending == 1


def test_a_batch_reports_which_items_were_deduplicated(store_url, lambda_context):
    body = {"tasks": [{"handler": "greet", "dedupe_key": "k"}, {"handler": "greet", "dedupe_key": "k"},
                      {"handler": "greet"}, {"handler": "greet", "dedupe_key": "k"}]}
    status, _, result = call(request("POST", "/v1/queues/dd/tasks:batch", body), lambda_context)
    assert status == 200
    assert [(r["result"], r["deduplicated"]) for r in result["results"]] == [
        ("created", False), ("existing", True), ("created", False), ("existing", True)]
    assert result["results"][0]["id"] == result["results"][1]["id"] == result["results"][3]["id"]
    assert (result["created"], result["existing"], result["deduplicated"]) == (2, 2, 2)


def test_bad_dedupe_fields_are_a_precise_422_and_write_nothing(store_url, lambda_context):
    for body, field in (({"handler": "greet", "dedupe_key": "k", "dedupe_mode": "merge"}, "dedupe_mode"),
                        ({"handler": "greet", "dedupe_key": "k", "dedupe_states": ["DONE"]}, "dedupe_states"),
                        ({"handler": "greet", "dedupe_key": "k", "dedupe_for_seconds": -1}, "dedupe_for_seconds"),
                        ({"handler": "greet", "dedupe_key": "a key with spaces"}, "dedupe_key")):
        status, ctype, problem = call(request("POST", "/v1/queues/dd/tasks", body), lambda_context)
        assert (status, ctype) == (422, "application/problem+json"), (body, problem)
        assert field in problem["detail"], problem
    assert connection.shared_storage().list_queues() == []


def test_a_snoozed_task_shows_a_snoozed_entry_in_its_timeline(store_url, lambda_context):
    status, task = enqueue({"handler": "greet", "max_attempts": 1}, lambda_context)
    assert status == 201
    registry = HandlerRegistry()
    registry.register("greet", lambda payload, ctx: (_ for _ in ()).throw(Snooze(3600)))
    storage = connection.shared_storage()
    BatchRunner(storage, PolicyBook(), registry).run(storage.claim("dd", 1, 30))
    status, _, shown = call(request("GET", f"/v1/tasks/{task['id']}"), lambda_context)
    assert status == 200 and shown["status"] == "PENDING" and shown["attempt_count"] == 0
    assert [(a["attempt_no"], a["outcome"], a["error"]) for a in shown["attempts"]] == [(1, "SNOOZED", None)]
