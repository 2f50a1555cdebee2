"""Every documented limit (docs/limits.md), enforced with its exact error, at the boundary.

Each limit is checked at its maximum (accepted) and one past it (refused with the documented
status, problem type and field), over HTTP (the real API handler) and where it applies through
the Python ``Client`` (``InvalidInput`` naming the field) — so the docs table cannot drift.
"""

from __future__ import annotations


import pytest

from rdq_core import Client
from rdq_core.errors import InvalidInput
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Outcome, TaskStatus
from rdq_core.engine.runner import BatchRunner
from rdq_core.validation import Limits

from .conftest import REPO, assert_problem

KIB = 1024
UNPROCESSABLE = "urn:rdq:problem:unprocessable-content"
TOO_LARGE = "urn:rdq:problem:content-too-large"


def _payload_of(encoded_bytes: int) -> str:
    """A string payload whose JSON encoding is exactly ``encoded_bytes`` long."""
    return "x" * (encoded_bytes - 2)


def _refused(call, status: int, ptype: str, field: str) -> dict:
    problem = assert_problem(*call, status)
    assert (problem["type"], problem.get("field")) == (ptype, field), problem
    return problem


def test_payload_size(api_call):
    ok = api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", "payload": _payload_of(Limits.payload_bytes)})
    assert ok[0] == 201
    multibyte = "é" * ((Limits.payload_bytes - 2) // 2 + 1)  # counted in UTF-8 bytes, not characters
    for payload in (_payload_of(Limits.payload_bytes + 1), multibyte):
        _refused(api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", "payload": payload}), 413, TOO_LARGE, "payload")
        _refused(api_call("POST", "/v1/queues/q/tasks:batch",
                          {"tasks": [{"handler": "greet"}, {"handler": "greet", "payload": payload}]}),
                 413, TOO_LARGE, "tasks[1].payload")
    with _client(api_call) as client:
        with pytest.raises(InvalidInput) as caught:
            client.enqueue("q", "greet", _payload_of(Limits.payload_bytes + 1))
        assert caught.value.field == "payload"


def _client(api_call) -> Client:
    import os

    return Client(os.environ["RDQ_STORAGE_URL"])


def test_request_body_size(api_call, monkeypatch):
    limit = 1024 * KIB  # RDQ_MAX_BODY_BYTES default
    over = b'{"handler": "greet", "payload": null}' + b" " * (limit + 1 - 37)
    assert len(over) == limit + 1
    _refused(api_call("POST", "/v1/queues/q/tasks", raw=over), 413, TOO_LARGE, None)
    at_limit = b'{"handler": "greet", "payload": null}' + b" " * (limit - 37)
    assert api_call("POST", "/v1/queues/q/tasks", raw=at_limit)[0] == 201
    monkeypatch.setenv("RDQ_MAX_BODY_BYTES", "100")
    _refused(api_call("POST", "/v1/queues/q/tasks", raw=b'{"handler": "greet", "payload": "' + b"x" * 80 + b'"}'),
             413, TOO_LARGE, None)


def test_batch_size(api_call):
    items = [{"handler": "greet"} for _ in range(Limits.batch_items)]
    status, _, body = api_call("POST", "/v1/queues/q/tasks:batch", {"tasks": items})
    assert (status, body["created"]) == (200, Limits.batch_items)
    _refused(api_call("POST", "/v1/queues/q/tasks:batch", {"tasks": items + [{"handler": "greet"}]}), 422, UNPROCESSABLE, "tasks")
    _refused(api_call("POST", "/v1/queues/q/tasks:batch", {"tasks": []}), 422, UNPROCESSABLE, "tasks")
    ids = [f"t{i}" for i in range(Limits.batch_items + 1)]
    for action in ("redrive", "purge"):
        assert api_call("POST", f"/v1/queues/q/dlq:{action}", {"ids": ids[:-1]})[0] == 200
        _refused(api_call("POST", f"/v1/queues/q/dlq:{action}", {"ids": ids}), 422, UNPROCESSABLE, "ids")
    with _client(api_call) as client:
        with pytest.raises(InvalidInput) as caught:
            client.enqueue_many("q", items + [{"handler": "greet"}])
        assert caught.value.field == "tasks"


def test_page_size(api_call):
    assert api_call("GET", f"/v1/queues/q/dlq?limit={Limits.page_size}")[0] == 200
    for limit in (Limits.page_size + 1, 0, 99999):
        _refused(api_call("GET", f"/v1/queues/q/dlq?limit={limit}"), 422, UNPROCESSABLE, "limit")
    with _client(api_call) as client, pytest.raises(InvalidInput) as caught:
        client.list_dead("q", limit=Limits.page_size + 1)
    assert caught.value.field == "limit"


def test_task_headers_count_and_size(api_call):
    def enqueue(headers):
        return api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", "headers": headers})

    assert enqueue({f"h{i}": "v" for i in range(Limits.headers_count)})[0] == 201
    assert enqueue({"k" * Limits.header_key_chars: "v" * Limits.header_value_chars})[0] == 201
    for headers in ({f"h{i}": "v" for i in range(Limits.headers_count + 1)},
                    {"k" * (Limits.header_key_chars + 1): "v"}, {"k": "v" * (Limits.header_value_chars + 1)},
                    {"": "v"}, {"rdq.attempt": "1"}, {"k": 1}, {"k": None}, {"k": "a\u0000b"}, ["k", "v"]):
        _refused(enqueue(headers), 422, UNPROCESSABLE, "headers")


def test_queue_handler_and_id_length(api_call):
    name_max, id_max = "q" * 120, "i" * 128
    assert api_call("POST", f"/v1/queues/{name_max}/tasks", {"handler": name_max, "id": id_max})[0] == 201
    assert api_call("GET", f"/v1/tasks/{id_max}")[0] == 200
    _refused(api_call("POST", f"/v1/queues/{name_max}q/tasks", {"handler": "greet"}), 422, UNPROCESSABLE, "queue")
    _refused(api_call("GET", f"/v1/queues/{name_max}q/stats"), 422, UNPROCESSABLE, "queue")
    _refused(api_call("POST", "/v1/queues/q/tasks", {"handler": name_max + "h"}), 422, UNPROCESSABLE, "handler")
    _refused(api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", "id": id_max + "i"}), 422, UNPROCESSABLE, "id")
    _refused(api_call("GET", f"/v1/tasks/{id_max}i"), 422, UNPROCESSABLE, "id")
    _refused(api_call("GET", f"/v1/queues/q/dlq?handler={name_max}h"), 422, UNPROCESSABLE, "handler")


def test_other_documented_limits(api_call):
    def enqueue(**fields):
        return api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", **fields})

    assert enqueue(max_attempts=Limits.max_attempts)[0] == 201
    _refused(enqueue(max_attempts=Limits.max_attempts + 1), 422, UNPROCESSABLE, "max_attempts")
    assert enqueue(priority=Limits.max_priority)[0] == 201
    _refused(enqueue(priority=Limits.max_priority + 1), 422, UNPROCESSABLE, "priority")
    for field in ("concurrency_key", "rate_key", "group", "dedupe_key"):
        assert enqueue(**{field: "K" * 128})[0] == 201
        _refused(enqueue(**{field: "K" * 129}), 422, UNPROCESSABLE, field)
    assert enqueue(delay_seconds=Limits.delay_seconds)[0] == 201
    _refused(enqueue(delay_seconds=Limits.delay_seconds + 1), 422, UNPROCESSABLE, "delay_seconds")
    nested = []
    for _ in range(Limits.json_depth - 1):
        nested = [nested]
    assert enqueue(payload=nested)[0] == 201
    _refused(enqueue(payload=[nested]), 422, UNPROCESSABLE, "payload")
    assert api_call("GET", "/v1/queues/q/dlq?error_type=" + "E" * 256)[0] == 200
    _refused(api_call("GET", "/v1/queues/q/dlq?error_type=" + "E" * 257), 422, UNPROCESSABLE, "error_type")
    _refused(api_call("GET", "/v1/queues/q/dlq?cursor=" + "A" * 1025), 400, "urn:rdq:problem:bad-request", "cursor")


def test_handler_result_size_fails_the_attempt(tmp_path):
    """A result over Limits.result_bytes is not stored: the attempt fails (and is retried/dead)."""
    registry = HandlerRegistry()
    registry.register("big", lambda payload, ctx: "x" * (Limits.result_bytes - 1))  # encodes to result_bytes + 1
    registry.register("fits", lambda payload, ctx: "x" * (Limits.result_bytes - 2))
    with Client(f"sqlite:///{tmp_path}/r.db") as client:
        client.storage.migrate()
        client.enqueue("r", "big", id="big-1", max_attempts=1)
        client.enqueue("r", "fits", id="fits-1", max_attempts=1)
        runner = BatchRunner(client.storage, registry=registry)
        try:
            runner.run(client.storage.claim("r", 10, 60))
        finally:
            runner.close()
        big, fits = client.get("big-1"), client.get("fits-1")
    assert fits.status is TaskStatus.SUCCEEDED and len(fits.result) == Limits.result_bytes - 2
    assert big.status is TaskStatus.DEAD and big.result is None
    assert big.attempts[-1].outcome in (Outcome.PERMANENT_FAILURE, Outcome.RETRYABLE_FAILURE)
    assert str(Limits.result_bytes) in big.attempts[-1].error.message


def test_docs_list_every_limit_with_its_error():
    doc = (REPO / "docs" / "limits.md").read_text()
    for value in (Limits.payload_bytes, Limits.result_bytes, Limits.batch_items, Limits.page_size, Limits.headers_count,
                  Limits.header_key_chars, Limits.header_value_chars, Limits.max_attempts, Limits.delay_seconds,
                  Limits.json_depth):
        assert f"{value:,}".replace(",", " ") in doc or str(value) in doc, value
    for needle in ("413", "422", "400", "415", "431", UNPROCESSABLE, TOO_LARGE, "RDQ_MAX_BODY_BYTES", "10 240"):
        assert needle in doc, needle
