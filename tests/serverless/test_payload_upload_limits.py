"""Presigned uploads carry their limits: the URL ``POST /v1/queues/{queue}/payloads`` answers signs
the object's length, its SHA-256 checksum and the ``rdq-pending`` tag; an enqueue that names the
object clears the tag, and the bucket's lifecycle rule expires what stays pending.

The API runs in process against moto's server (a free loopback port), so the upload is a real HTTP
PUT of the presigned URL. moto does not check query-string signatures, so what S3 refuses (another
length, another checksum, no tag) is shown on LocalStack 2.3.2's S3, which does
(``S3_SKIP_SIGNATURE_VALIDATION=0``; marked ``localstack``)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.aws import s3_payloads
from rdq_core.engine import payloads
from rdq_testing.servers import free_loopback_port

from .test_api import call, request
from .test_template import transformed

BUCKET = "rdq-upload-limits"


def _put(url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One presigned PUT as any HTTP client sends it: the body's own length in Content-Length."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("PUT", f"{parts.path}?{parts.query}", body=body,
                           headers={**headers, "Content-Length": str(len(body))})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _signed_headers(url: str) -> set[str]:
    return set(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["X-Amz-SignedHeaders"][0].split(";"))


@pytest.fixture
def bucket(store_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's S3 on loopback, named by RDQ_PAYLOAD_BUCKET, as the API function sees it."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_loopback_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {"RDQ_PAYLOAD_BUCKET": BUCKET, "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
                        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    payloads.reset()
    try:
        yield client
    finally:
        payloads.reset()
        server.stop()


def _offer(lambda_context, task_id: str, data: bytes) -> dict[str, Any]:
    status, _, offer = call(request("POST", "/v1/queues/emails/payloads", {
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "task_id": task_id}), lambda_context)
    assert status == 201, offer
    return offer


def _tags(bucket: Any, key: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in bucket.get_object_tagging(Bucket=BUCKET, Key=key)["TagSet"]}


def _enqueue(lambda_context, task_id: str, ref: dict[str, Any]) -> tuple[int, Any]:
    status, _, answer = call(request("POST", "/v1/queues/emails/tasks",
                                     {"handler": "digest", "id": task_id, "payload_ref": ref}), lambda_context)
    return status, answer


def test_the_presigned_put_signs_length_checksum_and_the_pending_tag(bucket, lambda_context):
    data = json.dumps({"rows": ["r" * 64] * 50}, separators=(",", ":")).encode()
    offer = _offer(lambda_context, "signed-1", data)
    upload = offer["upload"]
    assert {"content-length", "x-amz-checksum-sha256", "x-amz-tagging"} <= _signed_headers(upload["url"])
    checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
    assert upload["headers"] == {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                 "x-amz-checksum-sha256": checksum, "x-amz-tagging": "rdq-pending=true"}

    status, body = _put(upload["url"], upload["headers"], data)
    assert status == 200, body
    key = offer["payload_ref"]["key"]
    assert _tags(bucket, key) == {"rdq-pending": "true"}, "until a task names it, the upload is pending"


def test_an_enqueue_clears_the_pending_tag_of_the_object_its_task_names(bucket, lambda_context):
    data = json.dumps({"text": "p" * 5000}, separators=(",", ":")).encode()
    first = _offer(lambda_context, "named-1", data)
    assert _put(first["upload"]["url"], first["upload"]["headers"], data)[0] == 200
    status, task = _enqueue(lambda_context, "named-1", first["payload_ref"])
    assert status == 201 and json.loads(task["headers"]["rdq.payload_ref"]) == first["payload_ref"]
    assert _tags(bucket, first["payload_ref"]["key"]) == {}, "the task's payload lives as long as the task"

    # A second upload for the same task id, enqueued again: an idempotent repeat answers the
    # first task, which does not name this object, so it stays pending (the lifecycle rule's).
    second = _offer(lambda_context, "named-1", data)
    assert _put(second["upload"]["url"], second["upload"]["headers"], data)[0] == 200
    status, task = _enqueue(lambda_context, "named-1", second["payload_ref"])
    assert status == 200 and task["created"] is False
    assert _tags(bucket, second["payload_ref"]["key"]) == {"rdq-pending": "true"}
    assert _tags(bucket, first["payload_ref"]["key"]) == {}

    # A batch clears the tags of the objects its new tasks name.
    third = _offer(lambda_context, "named-2", data)
    assert _put(third["upload"]["url"], third["upload"]["headers"], data)[0] == 200
    status, _, answer = call(request("POST", "/v1/queues/emails/tasks:batch", {"tasks": [
        {"handler": "digest", "id": "named-2", "payload_ref": third["payload_ref"]}]}), lambda_context)
    assert status == 200 and answer["created"] == 1
    assert _tags(bucket, third["payload_ref"]["key"]) == {}


def test_a_tag_that_cannot_be_cleared_answers_503_and_the_retry_clears_it(bucket, lambda_context, monkeypatch):
    data = json.dumps({"text": "r" * 3000}, separators=(",", ":")).encode()
    offer = _offer(lambda_context, "retried-1", data)
    assert _put(offer["upload"]["url"], offer["upload"]["headers"], data)[0] == 200
    # S3 away for the tag call only (a closed port; the size check before it still works): the
    # task is written, and the caller is told to retry.
    store = payloads.default_store()
    assert isinstance(store, s3_payloads.S3PayloadStore)
    import boto3

    away = s3_payloads.S3PayloadStore(BUCKET, client=boto3.client(
        "s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{free_loopback_port()}"))
    with monkeypatch.context() as patched:
        patched.setattr(store, "clear_pending", away.clear_pending)
        status, problem = _enqueue(lambda_context, "retried-1", offer["payload_ref"])
    assert status == 503, problem
    assert _tags(bucket, offer["payload_ref"]["key"]) == {"rdq-pending": "true"}
    status, task = _enqueue(lambda_context, "retried-1", offer["payload_ref"])
    assert status == 200 and task["created"] is False
    assert _tags(bucket, offer["payload_ref"]["key"]) == {}, "the repeat names the same object: its tag goes"


def test_an_upload_no_task_names_expires_with_the_pending_rule():
    resources = transformed()["Resources"]
    rules = {r["Id"]: r for r in resources["PayloadBucket"]["Properties"]["LifecycleConfiguration"]["Rules"]}
    pending = rules["never-enqueued-uploads"]
    assert pending["Status"] == "Enabled" and pending["Prefix"] == "payloads/"
    assert pending["TagFilters"] == [{"Key": s3_payloads.PENDING_TAG[0], "Value": s3_payloads.PENDING_TAG[1]}]
    assert pending["ExpirationInDays"] == s3_payloads.PENDING_UPLOAD_DAYS and 1 <= s3_payloads.PENDING_UPLOAD_DAYS <= 2
    # The API role signs the PUT with its tag, and clears the tag: both on payloads/ only.
    (grant,) = [s for s in resources["PayloadApiPolicy"]["Properties"]["PolicyDocument"]["Statement"]
                if "s3:DeleteObjectTagging" in s["Action"]]
    assert {"s3:PutObject", "s3:PutObjectTagging"} <= set(grant["Action"])
    assert grant["Resource"] == {"Fn::Sub": "${PayloadBucket.Arn}/payloads/*"}


# -- what S3 refuses (LocalStack 2.3.2 checks presigned signatures) ---------------------------------

@pytest.fixture(scope="module")
def signing_s3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """LocalStack's S3 alone, checking every presigned URL's signature, on a free loopback port.
    Like the LocalStack suite, only when selected with ``-m localstack``."""
    if "localstack" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("starts LocalStack: run with -m localstack")
    from tests.localstack.localstack_host import LocalStackProcess, ensure_venv

    class SigningS3(LocalStackProcess):
        def environment(self) -> dict[str, str]:
            return {**super().environment(), "SERVICES": "s3", "S3_SKIP_SIGNATURE_VALIDATION": "0"}

        def ready(self) -> bool:
            import urllib.request

            try:
                with urllib.request.urlopen(f"{self.endpoint}/_localstack/health", timeout=2) as reply:
                    return json.loads(reply.read()).get("services", {}).get("s3") in ("available", "running")
            except (OSError, ValueError):
                return False

    workdir: Path = tmp_path_factory.mktemp("signing-s3")
    process = SigningS3(workdir)
    process.start(ensure_venv())
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=process.endpoint, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test",
                          config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client
    finally:
        process.stop()


@pytest.mark.localstack
def test_s3_refuses_a_presigned_upload_of_another_length_checksum_or_without_the_tag(signing_s3):
    store = s3_payloads.S3PayloadStore(BUCKET, client=signing_s3)
    data = json.dumps({"text": "q" * 2000}, separators=(",", ":")).encode()
    target = store.upload_target("payloads/emails/t-1/" + "0" * 32, len(data), hashlib.sha256(data).hexdigest())
    headers = target["headers"]
    other = data.replace(b"q", b"w", 1)
    other_checksum = base64.b64encode(hashlib.sha256(other).digest()).decode()

    refusals = {
        "longer": _put(target["url"], headers, data + b" "),
        "shorter": _put(target["url"], headers, data[:-1]),
        "another checksum": _put(target["url"], {**headers, "x-amz-checksum-sha256": other_checksum}, other),
        "no pending tag": _put(target["url"], {k: v for k, v in headers.items() if k != "x-amz-tagging"}, data),
        "another tag": _put(target["url"], {**headers, "x-amz-tagging": "rdq-finished=true"}, data),
    }
    # (A body of the same length that does not hash to the checksum is S3's BadDigest; LocalStack
    # 2.3.2 does not compare the body with the checksum, and the worker's SHA-256 check refuses it.)
    for case, (status, body) in refusals.items():
        assert status == 403 and b"SignatureDoesNotMatch" in body, (case, status, body[:200])
    assert signing_s3.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0, "nothing was stored"

    status, body = _put(target["url"], headers, data)
    assert status == 200, body
    stored = signing_s3.get_object(Bucket=BUCKET, Key="payloads/emails/t-1/" + "0" * 32)["Body"].read()
    assert stored == data
    assert {t["Key"]: t["Value"] for t in signing_s3.get_object_tagging(
        Bucket=BUCKET, Key="payloads/emails/t-1/" + "0" * 32)["TagSet"]} == {"rdq-pending": "true"}
