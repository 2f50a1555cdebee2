"""Hostile HTTP input: injection attempts, malformed and oversized bodies, wrong content types.

Most cases call the real API Lambda handler with real REST proxy events (fast, no socket); the
ones that live below the handler (HTTP methods, request line, header limits, Content-Length)
go over a socket to a real ``rdq dev``. Every refusal is a precise problem+json 4xx, and the
store is unchanged afterwards.
"""

from __future__ import annotations

import base64
import json
import socket
from urllib.parse import quote

import pytest

from rdq_core import Client
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus

from .conftest import PROBLEM_JSON, assert_problem
from .test_injection_storage import HOSTILE_FILTER_VALUES, HOSTILE_NAMES, OPERATOR_OBJECTS, SQL


@pytest.fixture
def seeded_api(api_store, api_call):
    """Two pending and two dead tasks on queue ``victim``; returns a snapshot function."""
    client = Client(api_store)
    client.enqueue_many("victim", [{"handler": "greet", "id": f"victim-{i}", "payload": {"n": i}} for i in range(4)])
    claimed = client.storage.claim("victim", 2, 60)
    client.storage.settle([Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                      error=ErrorInfo("Boom", "kaput")) for c in claimed])

    def snapshot() -> dict:
        tasks = {f"victim-{i}": client.get(f"victim-{i}").to_dict() for i in range(4)}
        for task in tasks.values():
            task.pop("updated_at", None)
        stats = client.stats("victim").to_dict()
        stats.pop("oldest_pending_age_seconds", None)
        return {"tasks": tasks, "stats": stats, "queues": sorted(client.storage.list_queues())}

    before = snapshot()
    yield snapshot, before
    client.close()


def _path(value: str) -> str:
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


# -- injection through the path, body and query string -----------------------------------------
def test_hostile_queue_names_and_ids_in_the_path(api_call, seeded_api):
    snapshot, before = seeded_api
    for name in HOSTILE_NAMES:
        if name in ("Q",) or name.startswith("aaaaaaaaaa"):
            continue  # valid task ids (but not queue names): covered below
        segment = _path(name)
        for method, target, body in [
            ("GET", f"/v1/queues/{segment}/stats", None),
            ("GET", f"/v1/queues/{segment}/dlq", None),
            ("POST", f"/v1/queues/{segment}/tasks", {"handler": "greet"}),
            ("POST", f"/v1/queues/{segment}/tasks:batch", {"tasks": [{"handler": "greet"}]}),
            ("POST", f"/v1/queues/{segment}/dlq:purge", {"all": True}),
            ("POST", f"/v1/queues/{segment}/dlq:redrive", {"all": True}),
            ("GET", f"/v1/tasks/{segment}", None),
            ("DELETE", f"/v1/tasks/{segment}", None),
        ]:
            status, headers, problem = api_call(method, target, body)
            assert status in (404, 405, 422), (method, target, status, problem)
            assert_problem(status, headers, problem, status)
            if status == 422:
                assert problem["field"] in ("queue", "id"), (target, problem)
    for name in ("Q", "a" * 121):  # valid ids that name nothing; invalid queues
        assert api_call("GET", f"/v1/tasks/{name}")[0] == 404
        assert_problem(*api_call("GET", f"/v1/queues/{name}/stats"), 422)
    assert snapshot() == before


def test_hostile_values_in_json_bodies(api_call, seeded_api):
    snapshot, before = seeded_api
    for name in HOSTILE_NAMES:
        problem = assert_problem(*api_call("POST", "/v1/queues/victim/tasks", {"handler": name}), 422)
        assert problem["field"] == "handler"
        if name not in ("Q",) and not name.startswith("aaaaaaaaaa"):
            problem = assert_problem(*api_call("POST", "/v1/queues/victim/tasks", {"handler": "greet", "id": name}), 422)
            assert problem["field"] == "id"
            for action in ("redrive", "purge"):
                problem = assert_problem(*api_call("POST", f"/v1/queues/victim/dlq:{action}", {"ids": [name]}), 422)
                assert problem["field"] == "ids"
        problem = assert_problem(*api_call("POST", "/v1/queues/victim/dlq:purge", {"handler": name}), 422)
        assert problem["field"] == "handler"
    for value in OPERATOR_OBJECTS:
        for body, field in [({"handler": "greet", "id": value}, "id"), ({"handler": value}, "handler"),
                            ({"handler": "greet", "headers": value}, "headers")]:
            if field == "headers" and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                continue  # {"$gt": ""} is a legal header map: stored literally (see the storage tests)
            assert assert_problem(*api_call("POST", "/v1/queues/victim/tasks", body), 422)["field"] == field, body
        for action in ("redrive", "purge"):
            for body, field in [({"ids": [value]}, "ids"), ({"ids": value}, "ids"), ({"error_type": value}, "error_type"),
                                ({"handler": value}, "handler"), ({"all": value}, "all")]:
                if (field == "all" and value is True) or (field == "ids" and value == ["Boom"]):
                    continue  # legal values: all=true is the whole DLQ, "Boom" is a valid (absent) id
                problem = assert_problem(*api_call("POST", f"/v1/queues/victim/dlq:{action}", body), 422)
                assert problem["field"] == field, (body, problem)
    assert snapshot() == before


def test_dlq_filters_and_cursors_in_the_query_string(api_call, seeded_api):
    snapshot, before = seeded_api
    status, _, page = api_call("GET", "/v1/queues/victim/dlq?error_type=Boom")
    assert status == 200 and len(page["tasks"]) == 2  # the filter really filters
    for value in HOSTILE_FILTER_VALUES:
        status, _, page = api_call("GET", f"/v1/queues/victim/dlq?error_type={_path(value)}")
        assert (status, page["tasks"], page["next_cursor"]) == (200, [], None), value
        for action, key in (("redrive", "redriven"), ("purge", "purged")):
            status, _, body = api_call("POST", f"/v1/queues/victim/dlq:{action}", {"error_type": value})
            assert (status, body) == (200, {key: 0}), value
    # qs / PHP-style operator smuggling is an unknown parameter, not a nested query.
    for query in ("error_type[$gt]=", "error_type%5B%24ne%5D=x", "handler[$regex]=.*", "limit[$gt]=0", "%24where=1"):
        assert_problem(*api_call("GET", f"/v1/queues/victim/dlq?{query}"), 422)
    for value in ("*", SQL, '{"$gt": ""}', "a:b", "../x"):
        assert assert_problem(*api_call("GET", f"/v1/queues/victim/dlq?handler={_path(value)}"), 422)["field"] == "handler"
    for value in ("-1", "0", "501", "1e3", "0x10", "1;DROP", " 5", "５"):
        assert assert_problem(*api_call("GET", f"/v1/queues/victim/dlq?limit={_path(value)}"), 422)["field"] == "limit"
    forged = lambda data: base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")  # noqa: E731 - a one-line helper
    for cursor in ("x", "*", SQL, '{"$gt": ""}', forged({"q": "victim", "t": 10**30, "id": "victim-0"}),
                   forged({"q": "victim", "t": 1, "id": {"$gt": ""}}), forged({"q": "other", "t": 1, "id": "a"}), "A" * 2000):
        problem = assert_problem(*api_call("GET", f"/v1/queues/victim/dlq?cursor={_path(cursor)}"), 400)
        assert problem["field"] == "cursor"
    assert snapshot() == before


# -- malformed bodies --------------------------------------------------------------------------
@pytest.mark.parametrize("raw, why", [
    (b'{"handler": "greet", "payload": "\xff"}', "invalid UTF-8 byte"),
    (b'{"handler": "greet", "payload": "\xc0\xaf"}', "overlong UTF-8"),
    (b'{"handler": "greet", "payload": "\xed\xa0\x80"}', "UTF-8-encoded surrogate (CESU-8)"),
    (b'\xfe\xff\x00{', "UTF-16 BOM"),
    (b'{"handler": "greet",}', "trailing comma"),
    (b'{"handler": "greet", "payload": NaN}', "NaN"),
    (b'{"handler": "greet", "payload": Infinity}', "Infinity"),
    (b'{"handler": "greet", "handler": "evil"}', "duplicate key"),
    (b'{"handler": "greet", "payload": {"a": 1, "a": 2}}', "duplicate key in the payload"),
    (b"", "empty"),
    (b"   ", "blank"),
    (b"{" * 100_000, "unbalanced deep nesting"),
    (b'{"handler": "greet", "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "100k-deep nesting"),
])
def test_malformed_bodies_are_400(api_call, seeded_api, raw, why):
    snapshot, before = seeded_api
    problem = assert_problem(*api_call("POST", "/v1/queues/victim/tasks", raw=raw), 400)
    assert "Traceback" not in problem["detail"], why
    assert snapshot() == before


def test_invalid_base64_body_is_400(api_call):
    from rdq_core.hosts.aws_lambda.local_invoke import api_proxy_event

    event = api_proxy_event("POST", "/v1/queues/victim/tasks", {"Content-Type": "application/json"}, b"{}")
    event.update(body="not base64!!", isBase64Encoded=True)
    assert_problem(*api_call("POST", "", event=event), 400)


def test_nesting_depth_around_every_boundary_is_never_a_5xx(api_call):
    """64 levels of payload are accepted, 65 are 422, and near the interpreter's recursion
    limit the parser refuses with 400 — never a RecursionError turned 500."""
    def nested(depth: int) -> bytes:
        return b'{"handler": "greet", "payload": ' + b"[" * depth + b"]" * depth + b"}"

    assert api_call("POST", "/v1/queues/deep/tasks", raw=nested(64))[0] == 201
    assert assert_problem(*api_call("POST", "/v1/queues/deep/tasks", raw=nested(65)), 422)["field"] == "payload"
    for depth in range(900, 1100, 7):
        status, headers, body = api_call("POST", "/v1/queues/deep/tasks", raw=nested(depth))
        assert status in (400, 422), (depth, status)
        assert_problem(status, headers, body, status)


def test_top_level_json_that_is_not_an_object_is_422(api_call):
    for raw in (b"[]", b'"handler"', b"42", b"null", b"true"):
        assert assert_problem(*api_call("POST", "/v1/queues/q/tasks", raw=raw), 422)["field"] == "body"


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/xml", "application/jsonx", "text/json", "application/javascript", "*/*", "application/json\x00",
])
def test_wrong_content_types_are_415(api_call, seeded_api, content_type):
    snapshot, before = seeded_api
    for target in ("/v1/queues/victim/tasks", "/v1/queues/victim/tasks:batch", "/v1/queues/victim/dlq:purge"):
        status, headers, problem = api_call("POST", target, raw=b'{"handler": "greet", "all": true}', content_type=content_type)
        assert_problem(status, headers, problem, 415)
        assert headers.get("accept-post") == "application/json"
    assert snapshot() == before


def test_json_with_parameters_and_suffix_types_is_accepted(api_call):
    for content_type in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/problem+json"):
        assert api_call("POST", "/v1/queues/q/tasks", {"handler": "greet"}, content_type=content_type)[0] == 201


# -- below the handler: the local HTTP server ---------------------------------------------------
def _raw_http(server, data: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
            if _ and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(rest) >= length:
                    break
    response = b"".join(chunks)
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def test_rdq_dev_answers_every_refusal_below_the_handler_as_problem_json(dev_server):
    auth = f"Authorization: Bearer {dev_server.token}\r\n".encode()
    bad_utf8 = b'{"handler": "greet", "payload": "\xff\xfe"}'
    cases = [
        (b"TRACE /v1/tasks/x HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n", 405),
        (b"PROPFIND /v1/queues/q/stats HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n", 405),
        (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n", 404),
        (b"GET /v1/queues/q/stats HTTP/9.9\r\n\r\n", 505),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v1/queues/q/stats HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"GET /v1/queues/q/stats HTTP/1.1\r\nHost: x\r\n" + auth + b"X-Big: " + b"a" * 10_300 + b"\r\n\r\n", 431),
        (b"GET /v1/queues/q/stats HTTP/1.1\r\nHost: x\r\n" + b"X-Line: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /v1/queues/q/tasks HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 7000000\r\n\r\n", 413),
        (b"POST /v1/queues/q/tasks HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: -5\r\n\r\n", 413),
        (b"POST /v1/queues/q/tasks HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: abc\r\n\r\n", 400),
        (b"POST /v1/queues/q/tasks HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        (b"POST /v1/queues/q/tasks HTTP/1.1\r\nHost: x\r\n" + auth
         + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(bad_utf8) + bad_utf8, 400),
    ]
    for request, expected in cases:
        status, headers, body = _raw_http(dev_server, request)
        assert status == expected, (request[:80], status, body[:200])
        assert headers.get("Content-Type") == PROBLEM_JSON, (request[:80], headers)
        assert json.loads(body)["status"] == expected
    assert "Traceback" not in dev_server.output()
