"""Large payloads and results through S3 (moto): Client -> bucket -> Lambda worker -> handler, the
hash check, results kept in the bucket, and DLQ purge deleting the objects.

The presigned flow over HTTP (HttpClient -> rdq dev -> moto's server) is in
test_payloads_presigned.py."""

from __future__ import annotations

import hashlib
import json

import pytest

from rdq_core import Client
from rdq_core.errors import InvalidInput
from rdq_core.hosts.aws_lambda import connection, worker

from .conftest import PAYLOAD_BUCKET, load_event
from .test_api import call, request

moto = pytest.importorskip("moto")
BUCKET = PAYLOAD_BUCKET


def _digest(value):
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return len(data), hashlib.sha256(data).hexdigest()


@pytest.fixture
def client(s3) -> Client:
    return Client(connection.shared_storage())


def _keys(s3, prefix=""):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def _run_worker(lambda_context):
    return worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 20))


def test_a_payload_over_the_threshold_goes_to_the_bucket_and_the_handler_sees_it(client, s3, lambda_context):
    big = {"text": "é" * 150_000, "n": 1}  # 300,013 bytes in UTF-8: over 200 KiB and over the 256 KiB limit
    size, sha256 = _digest(big)
    task = client.enqueue("emails", "digest", big, id="big-1")

    # The task holds a reference, not the payload.
    assert task.payload is None
    ref = json.loads(task.headers["rdq.payload_ref"])
    assert ref == {"bucket": BUCKET, "key": ref["key"], "size": size, "sha256": sha256}
    assert ref["key"].startswith("payloads/emails/") and _keys(s3) == [ref["key"]]
    stored = s3.get_object(Bucket=BUCKET, Key=ref["key"])["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == sha256

    # A small payload stays inline.
    small = client.enqueue("emails", "digest", {"n": 2}, id="small-1")
    assert small.payload == {"n": 2} and "rdq.payload_ref" not in small.headers and len(_keys(s3)) == 1

    summary = _run_worker(lambda_context)
    assert summary["outcomes"] == {"SUCCESS": 2}
    done = client.get("big-1")
    assert done.result == {"size": size, "sha256": sha256, "keys": ["n", "text"]}, "the handler saw the real payload"
    assert done.payload is None, "get returns the reference"
    assert client.get("big-1", resolve=True).payload == big
    # The succeeded task's payload object is tagged for the retention lifecycle rule.
    tags = s3.get_object_tagging(Bucket=BUCKET, Key=ref["key"])["TagSet"]
    assert tags == [{"Key": "rdq-finished", "Value": "true"}]


def test_a_changed_object_is_a_permanent_failure_that_names_it(client, s3, lambda_context):
    task = client.enqueue("emails", "digest", {"text": "a" * 250_000}, id="tampered", max_attempts=5)
    ref = json.loads(task.headers["rdq.payload_ref"])
    # Same size, other bytes: only the hash can tell.
    s3.put_object(Bucket=BUCKET, Key=ref["key"], Body=json.dumps({"text": "b" * 250_000}, separators=(",", ":")).encode())

    _run_worker(lambda_context)
    dead = client.get("tampered")
    assert dead.status.value == "DEAD" and dead.attempt_count == 1, "dead at once, no retries spent"
    assert dead.last_error.type == "rdq_core.engine.payloads.PayloadIntegrityError"
    assert ref["key"] in dead.last_error.message and "SHA-256" in dead.last_error.message
    assert ref["sha256"] in dead.last_error.message


def test_a_deleted_object_is_a_permanent_failure_too(client, s3, lambda_context):
    task = client.enqueue("emails", "digest", {"text": "a" * 250_000}, id="gone")
    s3.delete_object(Bucket=BUCKET, Key=json.loads(task.headers["rdq.payload_ref"])["key"])
    _run_worker(lambda_context)
    dead = client.get("gone")
    assert dead.status.value == "DEAD" and "does not exist" in dead.last_error.message


def test_a_large_result_is_kept_in_the_bucket_and_get_resolves_it(client, s3, lambda_context):
    client.enqueue("reports", "big-result", {"rows": 1000}, id="report-1")  # ~104 KB result: over 64 KiB
    client.enqueue("reports", "big-result", {"rows": 10}, id="report-2")
    _run_worker(lambda_context)

    task = client.get("report-1")
    assert task.status.value == "SUCCEEDED"
    ref = task.result["$rdq_s3"]
    assert set(task.result) == {"$rdq_s3"} and ref["key"].startswith("results/reports/report-1/")
    assert _keys(s3, "results/") == [ref["key"]]
    assert client.get("report-1", resolve=True).result == {"rows": ["r" * 100] * 1000}
    assert client.get("report-2").result == {"rows": ["r" * 100] * 10}, "a small result stays inline"


def test_a_handler_may_not_return_the_reserved_result_shape(client, s3, lambda_context):
    client.enqueue("reports", "reserved-result", id="sneaky", max_attempts=1)
    _run_worker(lambda_context)
    task = client.get("sneaky")
    assert task.status.value == "DEAD" and task.last_error.type == "rdq.InvalidResult"
    assert "$rdq_s3" in task.last_error.message


def test_dlq_purge_deletes_the_objects_of_the_purged_tasks_only(client, s3, lambda_context):
    for n in range(3):
        client.enqueue("emails", "refuse", {"text": "x" * 230_000, "n": n}, id=f"dead-{n}")
    keep = client.enqueue("emails", "digest", {"text": "y" * 230_000}, id="pending-1", delay_seconds=3600)
    _run_worker(lambda_context)
    assert [client.get(f"dead-{n}").status.value for n in range(3)] == ["DEAD"] * 3
    assert len(_keys(s3, "payloads/")) == 4

    assert client.purge_dead("emails", ids=["dead-0"]) == 1
    assert len(_keys(s3, "payloads/")) == 3
    assert client.purge_dead("emails", all=True, dry_run=True) == 2 and len(_keys(s3, "payloads/")) == 3
    assert client.purge_dead("emails", all=True) == 2
    assert _keys(s3, "payloads/") == [json.loads(keep.headers["rdq.payload_ref"])["key"]], \
        "the pending task keeps its object"
    entries = client.list_audit(queue="emails").entries
    assert [(e.action, e.count) for e in entries[:2]] == [("purge", 2), ("purge", 1)]


def test_an_idempotent_repeat_keeps_the_first_object_and_deletes_its_own(client, s3):
    first = client.enqueue("emails", "digest", {"text": "1" * 230_000}, id="same")
    again = client.enqueue("emails", "digest", {"text": "2" * 230_000}, id="same")
    assert again.headers == first.headers
    assert _keys(s3) == [json.loads(first.headers["rdq.payload_ref"])["key"]]


def test_enqueue_many_offloads_each_large_item(client, s3, lambda_context):
    results = client.enqueue_many("emails", [
        {"handler": "digest", "payload": {"text": "m" * 220_000}, "id": "many-1"},
        {"handler": "digest", "payload": {"n": 1}, "id": "many-2"},
    ])
    assert [r.created for r in results] == [True, True]
    assert "rdq.payload_ref" in results[0].task.headers and results[1].task.payload == {"n": 1}
    _run_worker(lambda_context)
    assert client.get("many-1").result["size"] == 220_000 + len('{"text":""}')


def test_the_offload_maximum_is_enforced_before_anything_is_written(client, s3, monkeypatch):
    monkeypatch.setenv("RDQ_PAYLOAD_MAX_BYTES", "300000")
    with pytest.raises(InvalidInput) as refused:
        client.enqueue("emails", "digest", {"text": "z" * 400_000})
    assert refused.value.field == "payload" and "300000" in str(refused.value)
    assert _keys(s3) == [] and client.stats("emails").pending == 0


def _api(method, path, body, lambda_context):
    status, _, answer = call(request(method, path, body), lambda_context)
    return status, answer


def test_the_api_checks_a_payload_ref_before_enqueueing_it(client, s3, lambda_context):
    data = json.dumps({"k": "v" * 1000}, separators=(",", ":")).encode()
    sha256 = hashlib.sha256(data).hexdigest()
    status, offer = _api("POST", "/v1/queues/emails/payloads", {"size": len(data), "sha256": sha256, "task_id": "by-ref"},
                         lambda_context)
    assert status == 201 and offer["upload"]["method"] == "PUT" and BUCKET in offer["upload"]["url"]
    ref = offer["payload_ref"]
    assert ref["key"].startswith("payloads/emails/by-ref/") and ref["size"] == len(data)
    mine = {"handler": "digest", "payload_ref": ref, "id": "by-ref"}

    # Not uploaded yet: a conflict with the bucket's state (409), not a malformed request.
    status, problem = _api("POST", "/v1/queues/emails/tasks", mine, lambda_context)
    assert status == 409 and "upload it first" in problem["detail"]
    s3.put_object(Bucket=BUCKET, Key=ref["key"], Body=data[:-1])
    status, problem = _api("POST", "/v1/queues/emails/tasks", mine, lambda_context)
    assert status == 409 and f"not {len(data)}" in problem["detail"]
    # Another queue's or another task's object (409), or a key this store never issues (422): refused.
    status, _ = _api("POST", "/v1/queues/other/tasks", mine, lambda_context)
    assert status == 409
    status, problem = _api("POST", "/v1/queues/emails/tasks", {"handler": "digest", "payload_ref": ref}, lambda_context)
    assert status == 409 and "issued for task" in problem["detail"]
    status, _ = _api("POST", "/v1/queues/emails/tasks",
                     {**mine, "payload_ref": {**ref, "key": "payloads/emails/../x"}}, lambda_context)
    assert status == 422
    status, problem = _api("POST", "/v1/queues/emails/tasks", {**mine, "payload": {"also": 1}}, lambda_context)
    assert status == 422 and "not both" in problem["detail"]

    s3.put_object(Bucket=BUCKET, Key=ref["key"], Body=data)
    status, task = _api("POST", "/v1/queues/emails/tasks", mine, lambda_context)
    assert status == 201 and task["payload"] is None and json.loads(task["headers"]["rdq.payload_ref"]) == ref
    # A caller cannot set the reserved header itself.
    status, problem = _api("POST", "/v1/queues/emails/tasks",
                           {"handler": "digest", "headers": {"rdq.payload_ref": json.dumps(ref)}}, lambda_context)
    assert status == 422 and problem["field"] == "headers"

    status, objects = _api("GET", "/v1/tasks/by-ref/objects", None, lambda_context)
    assert status == 200 and objects["result"] is None and objects["payload"]["payload_ref"] == ref
    assert ref["key"] in objects["payload"]["url"]
