"""The API function end to end: the shipped events/*.json fed to the real handler on SQLite."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest

from rdq_core.errors import RdqError
from rdq_core.hosts.aws_lambda import api, connection
from rdq_core.hosts.aws_lambda.invoker import invoker
from rdq_core.hosts.aws_lambda.routes import ROUTES
from rdq_core.problems import ApiProblem

from .conftest import load_event


def call(event: dict[str, Any], context) -> tuple[int, str, Any]:
    result = api.lambda_handler(event, context("rdq-api", 29))
    headers = {k.lower(): v for k, v in (result.get("headers") or {}).items()}
    for name, values in (result.get("multiValueHeaders") or {}).items():
        headers.setdefault(name.lower(), values[0])
    body = result.get("body") or ""
    if result["statusCode"] >= 400:
        assert "Traceback" not in body and 'File "' not in body, "no stack trace in an error response"
    return result["statusCode"], headers.get("content-type", ""), json.loads(body) if body else None


def request(method: str, path: str, body: Any = None, *, raw: bytes | None = None, content_type: str = "application/json",
            headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A REST proxy event built from the shipped enqueue event, re-aimed at another route."""
    event = load_event("api-enqueue")
    event["httpMethod"] = method
    event["path"] = path
    event["requestContext"]["path"] = "/prod" + path
    event["queryStringParameters"] = None
    event["multiValueQueryStringParameters"] = None
    if "?" in path:
        event["path"], query = path.split("?", 1)
        event["queryStringParameters"] = dict(part.split("=", 1) for part in query.split("&"))
    payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    event["body"] = payload.decode() if payload is not None else None
    event["headers"] = {**event["headers"], "Content-Type": content_type, **(headers or {})}
    event["multiValueHeaders"] = {k: [v] for k, v in event["headers"].items()}
    return event


def test_enqueue_event_creates_then_repeats_idempotently_then_conflicts_on_another_queue(store_url, lambda_context):
    event = load_event("api-enqueue")
    status, ctype, task = call(event, lambda_context)
    assert (status, ctype) == (201, "application/json")
    assert task["id"] == "order-42" and task["queue"] == "emails" and task["status"] == "PENDING"
    assert task["headers"] == {"trace": "abc"}

    status, _, again = call(load_event("api-enqueue"), lambda_context)
    assert status == 200 and again["created_at"] == task["created_at"]

    other = request("POST", "/v1/queues/billing/tasks", {"handler": "greet", "id": "order-42"})
    status, ctype, problem = call(other, lambda_context)
    assert (status, ctype) == (409, "application/problem+json")
    assert problem["status"] == 409 and "order-42" in problem["detail"]


def test_flow_fields_are_taken_returned_and_kept(store_url, lambda_context):
    fields = {"priority": 7, "concurrency_key": "tenant:9", "rate_key": "smtp", "group": "tenant:9"}
    status, _, task = call(request("POST", "/v1/queues/emails/tasks", {"handler": "greet", "id": "flow-1", **fields}),
                           lambda_context)
    assert status == 201 and {k: task[k] for k in fields} == fields
    status, _, stored = call(request("GET", "/v1/tasks/flow-1"), lambda_context)
    assert status == 200 and {k: stored[k] for k in fields} == fields
    status, _, plain = call(request("POST", "/v1/queues/emails/tasks", {"handler": "greet"}), lambda_context)
    assert (plain["priority"], plain["concurrency_key"], plain["rate_key"], plain["group"]) == (0, None, None, None)


def test_batch_event_is_one_storage_round_trip_with_per_item_results(store_url, lambda_context):
    storage = connection.shared_storage()
    before = storage.round_trips
    call(request("POST", "/v1/queues/emails/tasks:batch", {"tasks": [{"handler": "quick"}]}), lambda_context)
    one_item = storage.round_trips - before

    call(load_event("api-enqueue"), lambda_context)
    before = storage.round_trips
    batch = load_event("api-enqueue-batch")
    body = json.loads(batch["body"])
    body["tasks"].append({"handler": "greet", "id": "order-42"})
    batch["body"] = json.dumps(body)
    status, _, result = call(batch, lambda_context)
    assert storage.round_trips - before == one_item, "a batch costs what a single enqueue costs"
    assert status == 200
    assert [r["result"] for r in result["results"]] == ["created", "created", "created", "existing"]
    assert (result["created"], result["existing"], result["conflict"]) == (3, 1, 0)


def test_get_cancel_stats_and_dlq_events(store_url, lambda_context):
    call(load_event("api-enqueue"), lambda_context)
    call(load_event("api-enqueue-batch"), lambda_context)

    status, _, task = call(load_event("api-get-task"), lambda_context)
    assert status == 200 and task["id"] == "order-42" and task["attempts"] == []

    status, _, cancelled = call(load_event("api-cancel-task"), lambda_context)
    assert status == 200 and cancelled["status"] == "CANCELLED"
    status, ctype, problem = call(load_event("api-cancel-task"), lambda_context)
    assert (status, ctype) == (409, "application/problem+json")

    status, _, stats = call(load_event("api-queue-stats"), lambda_context)
    assert status == 200 and stats["pending"] == 3 and stats["cancelled"] == 1

    # Make dead tasks the way production does: a worker runs a handler that refuses for good.
    call(request("POST", "/v1/queues/emails/tasks", {"handler": "reject", "id": "bad-1"}), lambda_context)
    call(request("POST", "/v1/queues/emails/tasks", {"handler": "reject", "id": "bad-2"}), lambda_context)
    from rdq_core.hosts.aws_lambda.worker import lambda_handler as worker_handler

    worker_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))

    status, _, page = call(load_event("api-dlq-list"), lambda_context)
    assert status == 200 and {t["id"] for t in page["tasks"]} == {"bad-1", "bad-2"}
    assert page["tasks"][0]["attempts"][0]["outcome"] == "PERMANENT_FAILURE"

    status, _, first = call(request("GET", "/v1/queues/emails/dlq?limit=1"), lambda_context)
    assert len(first["tasks"]) == 1 and first["next_cursor"]
    status, _, second = call(request("GET", f"/v1/queues/emails/dlq?limit=1&cursor={first['next_cursor']}"), lambda_context)
    assert {first["tasks"][0]["id"], second["tasks"][0]["id"]} == {"bad-1", "bad-2"}

    status, _, redriven = call(load_event("api-dlq-redrive"), lambda_context)
    assert status == 200 and redriven == {"redriven": 2}
    worker_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    status, _, purged = call(load_event("api-dlq-purge"), lambda_context)
    assert status == 200 and purged == {"purged": 2}
    status, _, _ = call(load_event("api-get-task") | {"path": "/v1/tasks/bad-1"}, lambda_context)
    assert status == 404


def test_openapi_event_serves_a_document_covering_every_route(store_url, lambda_context):
    status, _, doc = call(load_event("api-openapi"), lambda_context)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert doc["servers"] == [{"url": "/prod"}], "the stage prefix comes from the request context"
    assert set(doc["paths"]) == {
        "/v1/queues/{queue}/tasks", "/v1/queues/{queue}/tasks:batch", "/v1/tasks/{task_id}",
        "/v1/queues/{queue}/stats", "/v1/queues/{queue}/dlq", "/v1/queues/{queue}/dlq:redrive",
        "/v1/queues/{queue}/dlq:purge", "/v1/openapi.json", "/v1/queues", "/v1/queues/{queue}/tasks:cancel",
        "/v1/queues/{queue}:pause", "/v1/queues/{queue}:resume", "/v1/audit",
        "/v1/operations", "/v1/operations/{operation_id}", "/v1/operations/{operation_id}:cancel",
        "/v1/schedules", "/v1/schedules/{schedule}", "/v1/queues/{queue}/payloads", "/v1/tasks/{task_id}/objects",
        "/v1/queues/{queue}/metrics", "/v1/metrics",
    }
    assert set(doc["paths"]["/v1/tasks/{task_id}"]) == {"get", "delete"}
    openapi_spec_validator = pytest.importorskip("openapi_spec_validator")
    openapi_spec_validator.validate(doc)


def test_the_route_table_is_what_the_api_serves_and_documents(store_url, lambda_context):
    # The served document's operations are the table's, one for one.
    status, _, doc = call(load_event("api-openapi"), lambda_context)
    documented = {(path, method.upper(), op["operationId"]) for path, ops in doc["paths"].items() for method, op in ops.items()}
    assert documented == {(r.path, r.method, r.operation_id) for r in ROUTES}
    for route in ROUTES:
        path = re.sub(r"\{\w+\}", "some-id", route.path)
        # Each route reaches its own function: whatever it answers, it is not "no route" or 405.
        body = {"handler": "quick"} if route.operation_id == "enqueueTask" else {"all": True} if route.request_schema else None
        status, _, answer = call(request(route.method, path, body), lambda_context)
        assert status != 405 and not (status == 404 and answer["detail"].startswith("no route")), (
            route.operation_id, status, answer)
        # Another method on the same path is a 405 whose Allow lists the table's methods for it.
        result = api.lambda_handler(request("PATCH", path, {}), lambda_context("rdq-api", 29))
        # (the routes of the most specific template only: ``…/x:cancel`` is not ``…/{operation_id}``)
        best = max(len(re.sub(r"\{\w+\}", "", r.path)) for r in ROUTES if r.pattern.match(path))
        allow = ", ".join(dict.fromkeys(r.method for r in ROUTES
                                        if r.pattern.match(path) and len(re.sub(r"\{\w+\}", "", r.path)) == best))
        assert (result["statusCode"], result["multiValueHeaders"]["Allow"]) == (405, [allow]), route.operation_id
        assert json.loads(result["body"])["detail"] == f"PATCH is not allowed here; use {allow}"
    result = api.lambda_handler(request("PATCH", "/v1/tasks/abc/"), lambda_context("rdq-api", 29))
    assert result["multiValueHeaders"]["Allow"] == ["GET, DELETE"], "trailing slashes route as the resolver routes them"


def test_api_problem_is_an_rdq_error():
    assert issubclass(ApiProblem, RdqError)
    assert api.ApiProblem is ApiProblem


_BIG_PAYLOAD = "x" * (256 * 1024)
_BAD_REQUESTS = [
    ("malformed JSON", request("POST", "/v1/queues/emails/tasks", raw=b'{"handler": '), 400),
    ("NaN is not JSON", request("POST", "/v1/queues/emails/tasks", raw=b'{"handler": "quick", "payload": NaN}'), 400),
    ("empty body", request("POST", "/v1/queues/emails/tasks", raw=b""), 400),
    ("body over 1 MiB", request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "payload": "y" * (1024 * 1024)}), 413),
    ("payload over 256 KiB", request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "payload": _BIG_PAYLOAD}), 413),
    ("batch item payload over 256 KiB",
     request("POST", "/v1/queues/emails/tasks:batch", {"tasks": [{"handler": "quick", "payload": _BIG_PAYLOAD}]}), 413),
    ("text/plain", request("POST", "/v1/queues/emails/tasks", {"handler": "quick"}, content_type="text/plain"), 415),
    ("form encoded",
     request("POST", "/v1/queues/emails/dlq:redrive", {"all": True}, content_type="application/x-www-form-urlencoded"), 415),
    ("JSON array body", request("POST", "/v1/queues/emails/tasks", [1, 2]), 422),
    ("missing handler", request("POST", "/v1/queues/emails/tasks", {"payload": 1}), 422),
    ("unknown field", request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "urgency": 1}), 422),
    ("bad queue name", request("POST", "/v1/queues/Not_OK!/tasks", {"handler": "quick"}), 422),
    ("bad task id", request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "id": "../x"}), 422),
    ("negative delay", request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "delay_seconds": -1}), 422),
    ("delay and run_at",
     request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "delay_seconds": 1, "run_at": "2030-01-01T00:00:00Z"}), 422),
    ("batch of 501", request("POST", "/v1/queues/emails/tasks:batch", {"tasks": [{"handler": "quick"}] * 501}), 422),
    ("batch not a list", request("POST", "/v1/queues/emails/tasks:batch", {"tasks": {"handler": "quick"}}), 422),
    ("duplicate ids in batch",
     request("POST", "/v1/queues/emails/tasks:batch",
             {"tasks": [{"handler": "quick", "id": "a"}, {"handler": "quick", "id": "a"}]}), 422),
    ("empty redrive selection", request("POST", "/v1/queues/emails/dlq:redrive", {}), 422),
    ("all is not a boolean", request("POST", "/v1/queues/emails/dlq:purge", {"all": "yes"}), 422),
    ("ids is a string", request("POST", "/v1/queues/emails/dlq:purge", {"ids": "abc"}), 422),
    ("limit not a number", request("GET", "/v1/queues/emails/dlq?limit=ten"), 422),
    ("limit too large", request("GET", "/v1/queues/emails/dlq?limit=501"), 422),
    ("forged cursor", request("GET", "/v1/queues/emails/dlq?cursor=bm90LWEtY3Vyc29y"), 400),
    ("unknown task", request("GET", "/v1/tasks/no-such-task"), 404),
    ("cancel unknown task", request("DELETE", "/v1/tasks/no-such-task"), 404),
    ("unknown route", request("GET", "/v2/whatever"), 404),
    ("unknown verb suffix", request("POST", "/v1/queues/emails/tasks:explode", {"tasks": []}), 404),
    ("wrong method", request("PUT", "/v1/tasks/abc", {"x": 1}), 405),
]


@pytest.mark.parametrize("event, expected", [pytest.param(e, s, id=name) for name, e, s in _BAD_REQUESTS])
def test_bad_requests_get_a_precise_problem_and_write_nothing(store_url, lambda_context, event, expected):
    status, ctype, problem = call(copy.deepcopy(event), lambda_context)
    assert status == expected
    assert ctype == "application/problem+json"
    assert problem["status"] == expected and problem["title"] and problem["detail"]
    assert connection.shared_storage().list_queues() == []


def test_base64_encoded_bodies_are_decoded_and_bad_base64_is_a_400(store_url, lambda_context):
    event = request("POST", "/v1/queues/emails/tasks", {"handler": "quick"})
    event["body"] = base64.b64encode(event["body"].encode()).decode()
    event["isBase64Encoded"] = True
    assert call(event, lambda_context)[0] == 201
    event["body"] = "%%%not-base64"
    assert call(event, lambda_context)[0] == 400


def test_bearer_token_when_configured(store_url, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_API_TOKEN", "s3cret")
    status, ctype, problem = call(load_event("api-queue-stats"), lambda_context)
    assert (status, ctype) == (401, "application/problem+json")
    wrong = load_event("api-queue-stats")
    wrong["headers"]["Authorization"] = "Bearer nope"
    assert call(wrong, lambda_context)[0] == 401
    right = load_event("api-queue-stats")
    right["headers"]["authorization"] = "Bearer s3cret"
    assert call(right, lambda_context)[0] == 200


class RecordingLambdaClient:
    def __init__(self) -> None:
        self.invocations: list[dict[str, Any]] = []

    def invoke(self, **kwargs: Any) -> dict[str, Any]:
        self.invocations.append({**kwargs, "Payload": json.loads(kwargs["Payload"])})
        return {"StatusCode": 202}


def test_enqueue_wakes_a_worker_asynchronously_debounced_and_only_for_due_tasks(store_url, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    monkeypatch.setenv("RDQ_WAKE_DEBOUNCE_SECONDS", "60")
    client = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", client)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))

    call(request("POST", "/v1/queues/emails/tasks", {"handler": "quick", "delay_seconds": 3600}), lambda_context)
    assert client.invocations == [], "a delayed task does not need a worker now"
    call(request("POST", "/v1/queues/emails/tasks", {"handler": "quick"}), lambda_context)
    call(request("POST", "/v1/queues/emails/tasks", {"handler": "quick"}), lambda_context)
    assert len(client.invocations) == 1, "wake-ups are debounced"
    (invocation,) = client.invocations
    assert invocation["FunctionName"] == "rdq-worker" and invocation["InvocationType"] == "Event"
    assert invocation["Payload"]["detail"]["queues"] == ["emails"]

    monkeypatch.setenv("RDQ_WAKE_WORKER", "false")
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    call(request("POST", "/v1/queues/emails/tasks", {"handler": "quick"}), lambda_context)
    assert len(client.invocations) == 1


def test_a_redrive_wakes_a_worker_too(store_url, lambda_context, monkeypatch):
    from rdq_core.compliance.support import dead_letter
    from rdq_core.hosts.aws_lambda import connection

    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    client = RecordingLambdaClient()
    monkeypatch.setattr(invoker, "_client", client)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    (dead,) = dead_letter(connection.shared_storage(), "emails", 1)
    assert client.invocations == []
    status, _, body = call(request("POST", "/v1/queues/emails/dlq:redrive", {"ids": [dead]}), lambda_context)
    assert (status, body) == (200, {"redriven": 1})
    (invocation,) = client.invocations
    assert invocation["Payload"]["detail"]["queues"] == ["emails"]


def test_storage_url_from_secrets_manager_and_ssm(tmp_path, monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    from rdq_core.hosts.aws_lambda.connection import resolve_storage_url

    monkeypatch.delenv("RDQ_STORAGE_URL", raising=False)
    with moto.mock_aws():
        secrets = boto3.client("secretsmanager")
        arn = secrets.create_secret(Name=f"rdq-url-{tmp_path.name}", SecretString=json.dumps({"url": "postgresql://db/rdq"}))["ARN"]
        monkeypatch.setenv("RDQ_STORAGE_URL_SECRET", arn)
        assert resolve_storage_url() == "postgresql://db/rdq"

        monkeypatch.delenv("RDQ_STORAGE_URL_SECRET")
        name = f"/rdq/{tmp_path.name}/url"
        boto3.client("ssm").put_parameter(Name=name, Value="redis://cache:6379/0", Type="SecureString")
        monkeypatch.setenv("RDQ_STORAGE_URL_PARAMETER", name)
        assert resolve_storage_url() == "redis://cache:6379/0"
