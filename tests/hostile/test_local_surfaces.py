"""Attacks on rdq's local surfaces (issue 27, item 11): ``rdq console`` signing for any local
process or forwarding dot segments, ``rdq dev`` without a token driven by another loopback page,
tampered cursors, one task's purge deleting another's payload, and the smaller hardening points
(non-ASCII paths, methods, response headers, ``Allow``, the OpenAPI document's 401).

Each test performs the attack; on the code before the fix each one fails."""

from __future__ import annotations

import base64
import json
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.engine import payload_retention, payloads
from rdq_core.client import Client
from rdq_core.hosts.console.server import ConsoleServer
from rdq_core.errors import InvalidCursor
from rdq_core.http_client import BearerToken
from rdq_core.storage import open_storage

from tests.loopback import Answer, ScriptedHttpServer
from tests.loopback import raw_request as send

from .conftest import assert_problem


# -- an upstream that records what reached it ----------------------------------------------------
class Upstream(ScriptedHttpServer):
    """A stand-in for the deployed API: answers every request 200 ``{}`` and records it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []

        def answer(method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
            self.seen.append((method, path, headers))
            return 200, {"Content-Type": "application/json"}, b"{}"

        super().__init__(answer)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.stop()


@pytest.fixture
def console(upstream: Upstream) -> Iterator[ConsoleServer]:
    server = ConsoleServer(upstream.url, BearerToken("operator-credential-1"), port=0)
    server.start()
    yield server
    server.stop()


def _port(console: ConsoleServer) -> int:
    return int(console.server.server_address[1])


def raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request sent byte for byte; a dropped connection raises."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError("the server closed the connection without an answer")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    return int(lines[0].split()[1]), headers, body




# -- (a) rdq console signs only for the page that holds this run's secret -----------------------
def test_a_local_process_without_the_session_token_gets_nothing_signed(console: ConsoleServer,
                                                                      upstream: Upstream) -> None:
    port = _port(console)
    for headers in ({}, {"Authorization": "Bearer guessed"}, {"Authorization": f"Basic {console.session_token}"},
                    {"Cookie": f"token={console.session_token}"}):
        for method, path in (("GET", "/v1/queues"), ("POST", "/v1/queues/q:pause"), ("POST", "/v1/queues/q/dlq:purge"),
                             ("DELETE", "/v1/tasks/t1")):
            status, answer_headers, body = send(port, method, path, {"Content-Type": "application/json", **headers},
                                                b"{}" if method == "POST" else None)
            assert_problem(status, answer_headers, json.loads(body), 401)
            assert answer_headers["www-authenticate"].lower().startswith("bearer")
    assert upstream.seen == []  # nothing was forwarded, so nothing was signed

    status, _, body = send(port, "GET", "/v1/queues", {"Authorization": f"Bearer {console.session_token}"})
    assert (status, body) == (200, b"{}")
    (method, path, arrived), = upstream.seen
    assert arrived["Authorization"] == "Bearer operator-credential-1"  # the operator's, not the page's
    assert console.session_token not in json.dumps(upstream.seen)


def test_each_run_has_its_own_secret_and_prints_it_in_the_address(upstream: Upstream) -> None:
    first, second = (ConsoleServer(upstream.url, None, port=0) for _ in range(2))
    try:
        assert first.session_token != second.session_token and len(first.session_token) >= 32
        assert first.login_url == f"{first.url}?token={first.session_token}"
    finally:
        first.server.server_close()
        second.server.server_close()


def test_the_token_in_the_pages_address_is_not_logged(console: ConsoleServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="rdq.console")
    assert send(_port(console), "GET", f"/?token={console.session_token}")[0] == 200
    assert "token=***" in caplog.text and console.session_token not in caplog.text


# -- (f) no dot segments or encoded slashes upstream ------------------------------------------------
@pytest.mark.parametrize("path", [
    "/v1/%2e%2e/admin", "/v1/queues/%2E%2E/%2e%2e/x", "/v1/queues/%2e/stats", "/v1/tasks/a%2fb",
    "/v1/tasks/a%2F..%2Fb", "/v1/tasks/a%5cb", "/v1/tasks/a\\b", "/v1/tasks/..%5c..%5cadmin", "/v1/queues/q/../x",
    "/v1/tasks/%ff%fe",
])
def test_the_console_forwards_no_dot_segment_or_encoded_separator(console: ConsoleServer, upstream: Upstream,
                                                                  path: str) -> None:
    status, headers, body = send(_port(console), "GET", path, {"Authorization": f"Bearer {console.session_token}"})
    assert_problem(status, headers, json.loads(body), 404)
    assert upstream.seen == []


# -- (g) methods, non-ASCII paths --------------------------------------------------------------------
@pytest.mark.parametrize("method", ["PUT", "PATCH", "OPTIONS", "TRACE", "PROPFIND", "CONNECT"])
def test_the_console_forwards_only_the_apis_methods(console: ConsoleServer, upstream: Upstream, method: str) -> None:
    status, headers, body = send(_port(console), method, "/v1/queues",
                                 {"Authorization": f"Bearer {console.session_token}"})
    assert_problem(status, headers, json.loads(body), 405)
    assert headers["allow"] == "GET, POST, DELETE"
    assert upstream.seen == []


def test_a_non_ascii_path_is_a_400_on_the_console_not_a_dropped_connection(console: ConsoleServer,
                                                                         upstream: Upstream) -> None:
    request = (f"GET /v1/tasks/caf\u00e9 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {console.session_token}\r\n"
               "Connection: close\r\n\r\n").encode()
    status, headers, body = raw(_port(console), request)
    assert_problem(status, headers, json.loads(body), 400)
    assert upstream.seen == []


def test_rdq_dev_answers_a_non_ascii_path_with_a_400_and_its_api_headers(dev_server_factory) -> None:
    server = dev_server_factory(token=None)
    for path in ("/v1/tasks/caf\u00e9", "/\u00e9", "/v1/queues/\u2603/stats"):
        request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        status, headers, body = raw(server.port, request)
        assert_problem(status, headers, json.loads(body), 400)
    # Every API answer and every refusal says no-store and nosniff.
    for method, path, extra in (("GET", "/v1/queues", {}), ("GET", "/v1/tasks/nope", {}), ("PUT", "/v1/queues", {}),
                                ("GET", "/v1/events", {}), ("GET", "/v1/queues", {"Host": "attacker.example"})):
        status, headers, _ = send(server.port, method, path, extra)
        assert headers["cache-control"] == "no-store" and headers["x-content-type-options"] == "nosniff", (path, status)


# -- (c) rdq dev without a token: another loopback page cannot change anything ----------------------
def test_rdq_dev_without_a_token_refuses_other_loopback_pages_and_non_json_posts(dev_server_factory) -> None:
    server = dev_server_factory(token=None)
    port = server.port
    assert server.request("POST", "/v1/queues/victim/tasks", {"handler": "greet", "delay_seconds": 3600})[0] == 201

    def paused() -> bool:
        return bool(json.loads(server.request("GET", "/v1/queues/victim/stats")[2])["paused"])

    # A page on another loopback port (its fetch or form carries its own Origin): refused as such.
    for origin in (f"http://127.0.0.1:{port + 1}", "http://localhost:3000", "null"):
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "application/json"):
            headers = {"Origin": origin, **({"Content-Type": content_type} if content_type else {})}
            status, answer_headers, body = send(port, "POST", "/v1/queues/victim:pause", headers, b"")
            assert_problem(status, answer_headers, json.loads(body), 403)
    status, answer_headers, body = send(port, "POST", "/v1/queues/victim:pause", {"Sec-Fetch-Site": "same-site"}, b"")
    assert_problem(status, answer_headers, json.loads(body), 403)
    # Whatever the Origin: a POST that is not JSON (what a form or a no-cors fetch can send) is a 415.
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}):
        for path in ("/v1/queues/victim:pause", "/v1/queues/victim:resume", "/v1/operations/abc:cancel"):
            for body_bytes in (b"", b"{}"):
                status, answer_headers, body = send(port, "POST", path, headers, body_bytes)
                assert_problem(status, answer_headers, json.loads(body), 415)
    assert not paused()
    # The console's own page (same origin, JSON) and curl still work.
    own = {"Origin": f"http://127.0.0.1:{port}", "Content-Type": "application/json"}
    assert send(port, "POST", "/v1/queues/victim:pause", own, b"{}")[0] == 200 and paused()
    assert send(port, "POST", "/v1/queues/victim:resume", {"Content-Type": "application/json"}, b"")[0] == 200
    assert not paused()


def test_the_api_wants_json_on_every_body_less_post_too(api_call) -> None:
    for path in ("/v1/queues/q:pause", "/v1/queues/q:resume", "/v1/operations/abc:cancel"):
        assert_problem(*api_call("POST", path, raw=b"", content_type=None), 415)
        assert_problem(*api_call("POST", path, raw=b"", content_type="text/plain"), 415)
    status, _, body = api_call("POST", "/v1/queues/q:pause", event=None, raw=b"{}")
    assert status == 200 and body["paused"] is True


# -- (d) tampered cursors --------------------------------------------------------------------------
def _cursor(data: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


#: Cursors whose fields hold objects, lists or numbers where the stores expect text: each was a 500.
TAMPERED = [
    {"q": "q", "s": {"$gt": ""}, "t": 1, "id": "a"},
    {"q": "q", "s": ["PENDING"], "t": 1, "id": "a"},
    {"q": "q", "s": 1, "t": 1, "id": "a"},
    {"q": {"$gt": ""}, "s": "PENDING", "t": 1, "id": "a"},
    {"q": ["q"], "t": 1, "id": "a"},
    {"a": {"$ne": None}, "t": 1, "id": "a"},
    {"a": [""], "t": 1, "id": "a"},
    {"q": "q", "s": "PENDING", "t": True, "id": "a"},
    {"q": "q", "s": "PENDING", "t": 1.5, "id": "a"},
    ["q", 1, "a"],
    "q",
]


@pytest.mark.parametrize("data", TAMPERED, ids=range(len(TAMPERED)))
def test_a_tampered_cursor_is_a_400_problem_on_every_listing_route(api_call, data: object) -> None:
    cursor = _cursor(data)
    for target in (f"/v1/queues/q/tasks?cursor={cursor}", f"/v1/queues/q/tasks?status=PENDING&cursor={cursor}",
                   f"/v1/queues/q/dlq?cursor={cursor}", f"/v1/audit?cursor={cursor}",
                   f"/v1/audit?queue=q&cursor={cursor}"):
        problem = assert_problem(*api_call("GET", target), 400)
        assert problem["field"] == "cursor", target


def test_a_tampered_cursor_is_invalid_cursor_on_every_backend(any_store_url: str) -> None:
    storage = open_storage(any_store_url)
    client = Client(storage)
    try:
        client.enqueue("q", "h", {}, id="a")
        for data in TAMPERED:
            cursor = _cursor(data)
            for call in (lambda: client.list_tasks("q", cursor=cursor),  # noqa: B023 - called at once
                         lambda: client.list_tasks("q", status="PENDING", cursor=cursor),  # noqa: B023
                         lambda: client.list_dead("q", cursor=cursor),  # noqa: B023
                         lambda: client.list_audit(cursor=cursor)):  # noqa: B023
                with pytest.raises(InvalidCursor):
                    call()
    finally:
        client.close()
        storage.close()


def test_rdq_devs_events_route_refuses_a_tampered_position(dev_server_factory) -> None:
    server = dev_server_factory(token=None)
    for query in ("after=%7B%22%24gt%22%3A%22%22%7D", "after[$gt]=", "after=1&after=2", "limit=-1", "after=%E2%91%A0"):
        status, headers, body = server.request("GET", f"/v1/events?{query}")
        assert_problem(status, headers, body, 400)


# -- (e) one task's purge never deletes another's payload -------------------------------------------
@pytest.fixture
def payload_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "rdq-payloads"
    monkeypatch.delenv("RDQ_PAYLOAD_BUCKET", raising=False)
    monkeypatch.setenv("RDQ_PAYLOAD_DIR", str(directory))
    payloads.reset()
    yield directory
    payloads.reset()


def _upload(api_call, queue: str, task_id: str, data: bytes) -> dict[str, Any]:
    import hashlib

    status, _, offer = api_call("POST", f"/v1/queues/{queue}/payloads",
                                {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "task_id": task_id})
    assert status == 201, offer
    payloads.default_store().write(offer["payload_ref"]["key"], data)  # what the presigned PUT does
    return dict(offer["payload_ref"])


def test_a_producer_cannot_point_a_task_at_another_tasks_payload(api_call, payload_dir: Path) -> None:
    data = json.dumps({"secret": "x" * 1000}).encode()
    ref = _upload(api_call, "q", "owner", data)
    assert ref["key"].startswith("payloads/q/owner/")
    status, _, created = api_call("POST", "/v1/queues/q/tasks", {"id": "owner", "handler": "h", "payload_ref": ref})
    assert status == 201, created

    # Another task, on its own or in a batch, with the owner's reference: refused, nothing enqueued.
    assert_problem(*api_call("POST", "/v1/queues/q/tasks", {"id": "thief", "handler": "h", "payload_ref": ref}), 409)
    assert_problem(*api_call("POST", "/v1/queues/q/tasks", {"handler": "h", "payload_ref": ref}), 409)
    assert_problem(*api_call("POST", "/v1/queues/q/tasks:batch",
                             {"tasks": [{"id": "thief", "handler": "h", "payload_ref": ref}]}), 409)
    assert api_call("GET", "/v1/tasks/thief")[0] == 404
    # An upload is asked for one task id; one without it is refused.
    assert_problem(*api_call("POST", "/v1/queues/q/payloads", {"size": 10, "sha256": "a" * 64}), 422)


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Any]:
    store = open_storage(f"sqlite:///{tmp_path}/purge.db")
    store.migrate()
    yield store
    store.close()


def test_purging_a_task_never_deletes_an_object_another_task_owns(storage: Any, tmp_path: Path) -> None:
    from dataclasses import replace

    from rdq_core.compliance.support import wait_until
    from rdq_core.engine.handlers import HandlerRegistry
    from rdq_core.model import NewTask
    from rdq_core.hosts.process.worker import Worker, WorkerConfig

    store = payloads.LocalPayloadStore(tmp_path / "objects")
    payloads.configure(store)  # the worker's store
    try:
        client = Client(storage, payload_store=store)
        owner = client.enqueue("q", "h", {"t": "x" * 300_000}, id="owner", delay_seconds=3600)
        ref = payloads.payload_ref(owner)
        assert ref is not None and ref.key.startswith("payloads/q/owner/")
        # A task written around the API's checks (a store writer, or data from before them) that
        # names the owner's object: it dies, and is purged.
        storage.enqueue([NewTask(id="thief", queue="q", handler="fail", max_attempts=1,
                                 headers={payloads.REF_HEADER: ref.to_header()})])
        registry = HandlerRegistry()

        def fail(payload: Any, ctx: Any) -> None:
            raise ValueError("no")

        registry.register("fail", fail)
        worker = Worker(storage, WorkerConfig(queues=["q"], lease_seconds=5, idle_poll_seconds=0.05), registry=registry)
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        try:
            wait_until(lambda: client.stats("q").dead == 1, timeout=20, what="the thief to die")
        finally:
            worker.stop()
            thread.join(10)
        thief = client.get("thief")
        assert payload_retention.object_refs([thief]) == []  # not the thief's to delete
        assert payload_retention.object_refs([replace(thief, result={payloads.RESULT_KEY: ref.to_dict()})]) == []
        payloads.finished(thief, store)  # nor to tag for expiry

        assert client.purge_dead("q", ids=["thief"]) == 1
        assert store.read(ref.key) is not None  # the owner's payload is still there
        assert client.get("owner").headers[payloads.REF_HEADER] == ref.to_header()
        assert payload_retention.object_refs([owner]) == [ref]  # and the owner's own purge would delete it
    finally:
        payloads.reset()


# -- (g) the Lambda API's headers, Allow and its document ---------------------------------------------
def test_every_lambda_api_answer_says_no_store_and_nosniff(api_call, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [api_call("GET", "/v1/queues"), api_call("GET", "/v1/tasks/nope"), api_call("PUT", "/v1/queues"),
               api_call("GET", "/v1/queues/q/tasks?cursor=x"), api_call("GET", "/v1/openapi.json"),
               api_call("POST", "/v1/queues/q/tasks", {"handler": "greet"})]
    monkeypatch.setenv("RDQ_API_TOKEN", "local-token-3")
    answers.append(api_call("GET", "/v1/queues"))  # the token check's own 401
    assert [status for status, _, _ in answers] == [200, 404, 405, 400, 200, 201, 401]
    for status, headers, _ in answers:
        assert headers["cache-control"] == "no-store" and headers["x-content-type-options"] == "nosniff", status


def test_allow_on_an_operations_cancel_lists_only_post(api_call) -> None:
    for method in ("PUT", "PATCH", "DELETE"):
        status, headers, body = api_call(method, "/v1/operations/abc:cancel")
        assert_problem(status, headers, body, 405)
        assert headers["allow"] == "POST", method
    assert api_call("PUT", "/v1/operations/abc")[1]["allow"] == "GET"
    assert api_call("PUT", "/v1/tasks/t1")[1]["allow"] == "GET, DELETE"


def test_the_document_says_openapi_json_answers_401_and_stays_valid(api_call) -> None:
    status, _, document = api_call("GET", "/v1/openapi.json")
    assert status == 200
    responses = document["paths"]["/v1/openapi.json"]["get"]["responses"]
    assert responses["401"] == {"$ref": "#/components/responses/Problem"}
    for path in ("/v1/queues/{queue}:pause", "/v1/queues/{queue}:resume", "/v1/operations/{operation_id}:cancel"):
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True and "application/json" in body["content"], path
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(document)
