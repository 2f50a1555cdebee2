"""Large payloads over HTTP: HttpClient asks ``POST /v1/queues/{queue}/payloads`` for a presigned
URL, uploads, and enqueues by reference; the worker hands the handler the payload.

Against ``rdq dev`` (a subprocess on a free loopback port) twice: with a bucket on moto's server
(also a free loopback port), so presigned URLs are real HTTP requests to it; and with no bucket at
all, where ``rdq dev``'s local directory stands in for it (offline, the same references)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rdq_testing.servers import free_loopback_port
from rdq_core.compliance.support import wait_until
from rdq_core.http_client import HttpClient
from tests.rdq_servers import DevServer

moto_server = pytest.importorskip("moto.server")
BUCKET = "rdq-presigned-test"
HANDLERS = "tests.serverless.payload_handlers"


def _digest(value):
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "keys": sorted(value)}


def _finished(rdq: HttpClient, task_id: str):
    def done():
        task = rdq.get(task_id)
        return task if task.status.value in ("SUCCEEDED", "DEAD") else None

    return wait_until(done, 30, 0.1, what=f"task {task_id} to finish")


@pytest.fixture
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_loopback_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield url, client
    finally:
        server.stop()


@pytest.fixture
def dev_with_bucket(tmp_path: Path, s3_endpoint):
    url, _ = s3_endpoint
    server = DevServer(tmp_path, handlers=HANDLERS, env={
        "RDQ_PAYLOAD_BUCKET": BUCKET, "AWS_ENDPOINT_URL_S3": url, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dev_offline(tmp_path: Path):
    server = DevServer(tmp_path, handlers=HANDLERS)
    try:
        yield server
    finally:
        server.stop()


def test_http_client_uploads_through_a_presigned_url_and_the_handler_sees_the_payload(dev_with_bucket, s3_endpoint):
    _, s3 = s3_endpoint
    rdq = HttpClient(dev_with_bucket.url)
    big = {"text": "ü" * 200_000, "n": 7}  # 400,015 bytes: over the API's 256 KiB inline limit
    task = rdq.enqueue("emails", "digest", big, id="http-big")
    assert task.payload is None
    ref = json.loads(task.headers["rdq.payload_ref"])
    assert ref["bucket"] == BUCKET and ref["size"] == _digest(big)["size"]
    # The object went to the bucket through the presigned URL (not through the API).
    stored = s3.get_object(Bucket=BUCKET, Key=ref["key"])["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == ref["sha256"]

    done = _finished(rdq, "http-big")
    assert done.status.value == "SUCCEEDED" and done.result == _digest(big)
    assert rdq.get("http-big", resolve=True).payload == big

    # A large result comes back by reference; resolve downloads it through a presigned URL.
    rdq.enqueue("emails", "big-result", {"rows": 1000}, id="http-report")
    report = _finished(rdq, "http-report")
    assert set(report.result) == {"$rdq_s3"}
    assert rdq.get("http-report", resolve=True).result == {"rows": ["r" * 100] * 1000}


def test_enqueue_many_over_http_offloads_each_large_item(dev_with_bucket):
    rdq = HttpClient(dev_with_bucket.url)
    big = {"text": "x" * 300_000}
    results = rdq.enqueue_many("emails", [{"handler": "digest", "payload": big, "id": "batch-big"},
                                          {"handler": "digest", "payload": {"n": 1}, "id": "batch-small"}])
    assert [r.created for r in results] == [True, True]
    assert _finished(rdq, "batch-big").result == _digest(big)
    assert _finished(rdq, "batch-small").result == _digest({"n": 1})


def test_rdq_dev_without_a_bucket_keeps_large_payloads_in_its_local_directory(dev_offline, tmp_path: Path):
    rdq = HttpClient(dev_offline.url)
    big = {"text": "o" * 300_000}
    task = rdq.enqueue("emails", "digest", big, id="local-big")
    ref = json.loads(task.headers["rdq.payload_ref"])
    assert ref["bucket"] == "local" and ref["key"].startswith("payloads/emails/")
    path = tmp_path / "rdq-payloads" / ref["key"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"]

    assert _finished(rdq, "local-big").result == _digest(big)
    assert rdq.get("local-big", resolve=True).payload == big

    # A dead task's object goes with it when the DLQ is purged.
    dead = rdq.enqueue("emails", "refuse", {"text": "d" * 300_000}, id="local-dead")
    dead_path = tmp_path / "rdq-payloads" / json.loads(dead.headers["rdq.payload_ref"])["key"]
    assert _finished(rdq, "local-dead").status.value == "DEAD" and dead_path.exists()
    assert rdq.purge_dead("emails", ids=["local-dead"]) == 1
    assert not dead_path.exists() and path.exists()
