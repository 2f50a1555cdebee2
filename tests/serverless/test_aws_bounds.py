"""Every AWS call rdq makes is bounded (rdq_core/aws/clients.py), and the best-effort ones (the
API's wake-up, the worker's fan-out) never delay an answer or a claim: proven against an
endpoint that accepts connections and never answers, and a Lambda client whose invoke hangs."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from rdq_core import Client
from rdq_core.aws.clients import aws_client
from rdq_core.errors import ConfigurationError
from rdq_core.hosts.aws_lambda import connection, worker
from rdq_core.hosts.aws_lambda.connection import _url_from_secret_value, resolve_storage_url
from rdq_core.hosts.aws_lambda.invoker import WAKE_WAIT_SECONDS, invoker

from .conftest import load_event
from .test_api import RecordingLambdaClient, call


class SilentEndpoint:
    """A TCP server that accepts every connection and never answers: an AWS endpoint behind a
    firewall that lets packets in and nothing out, the worst case for a client without timeouts."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.server.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    monkeypatch.setenv("RDQ_AWS_READ_TIMEOUT", "0.5")
    try:
        yield endpoint
    finally:
        endpoint.close()


@pytest.mark.parametrize("service", ["secretsmanager", "ssm", "lambda", "s3", "scheduler", "cloudwatch", "events"])
def test_every_client_has_short_timeouts_and_one_attempt(service, monkeypatch):
    monkeypatch.delenv("RDQ_AWS_READ_TIMEOUT", raising=False)
    config = aws_client(service).meta.config
    assert (config.connect_timeout, config.read_timeout) == (2.0, 5.0)
    assert config.retries["total_max_attempts"] == 1


def test_a_silent_endpoint_fails_the_call_within_the_read_timeout_after_one_attempt(silent_endpoint):
    from botocore.exceptions import ReadTimeoutError

    began = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        aws_client("lambda").invoke(FunctionName="rdq-worker", InvocationType="Event", Payload=b"{}")
    assert time.monotonic() - began < 3, "botocore's defaults would take minutes"
    assert len(silent_endpoint.accepted) == 1, "one attempt, no retry"


def test_a_storage_secret_behind_a_silent_endpoint_fails_the_cold_start_in_seconds(silent_endpoint, monkeypatch):
    monkeypatch.delenv("RDQ_STORAGE_URL", raising=False)
    monkeypatch.setenv("RDQ_STORAGE_URL_SECRET", "arn:aws:secretsmanager:us-east-1:123456789012:secret:rdq-url-AbCdEf")
    connection.close_shared_storage()  # a fresh container: fresh providers
    began = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - Powertools wraps the SDK's timeout in its own error
        resolve_storage_url()
    assert time.monotonic() - began < 3
    assert len(silent_endpoint.accepted) == 1
    connection.close_shared_storage()


class HangingLambdaClient:
    """An invoke that does not return until released: no route to Lambda from a private subnet."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def invoke(self, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        self.release.wait(60)
        return {"StatusCode": 202}


@pytest.fixture
def hanging_lambda(monkeypatch: pytest.MonkeyPatch) -> Iterator[HangingLambdaClient]:
    client = HangingLambdaClient()
    monkeypatch.setattr(invoker, "_client", client)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    try:
        yield client
    finally:
        client.release.set()


def test_a_hanging_wake_up_does_not_delay_the_answer_to_a_committed_enqueue(store_url, lambda_context, hanging_lambda):
    began = time.monotonic()
    status, _, task = call(load_event("api-enqueue"), lambda_context)
    elapsed = time.monotonic() - began
    assert status == 201 and task["id"] == "order-42"
    assert hanging_lambda.calls == 1, "the wake-up was attempted"
    assert elapsed < WAKE_WAIT_SECONDS + 1.5, f"answered after {elapsed:.2f}s"
    assert Client(connection.shared_storage()).get("order-42").status.value == "PENDING"


def test_a_cold_containers_first_wake_up_is_sent_before_the_answer(store_url, lambda_context, monkeypatch):
    """Building the Lambda client (boto3's import and service model) takes about 0.25 s of a whole
    core, longer than the wake-up's wait on a 512 MB function's share of one. Once the answer is
    sent the environment may freeze, so that wait must be spent on the invoke alone, not on the
    build: a wake-up still waiting for its client would be sent only when the next request thaws
    the container."""
    from rdq_core.hosts.aws_lambda import invoker as invoker_module

    recorder = RecordingLambdaClient()

    def slow_to_build(*args: Any, **kwargs: Any) -> RecordingLambdaClient:
        time.sleep(WAKE_WAIT_SECONDS + 0.5)  # the build on a small cold function, here slept
        return recorder

    monkeypatch.setattr(invoker_module, "aws_client", slow_to_build)
    monkeypatch.setattr(invoker, "_client", None)
    monkeypatch.setattr(invoker, "_prepared", False)
    monkeypatch.setattr(invoker, "_last_wake", float("-inf"))
    monkeypatch.setenv("RDQ_WORKER_FUNCTION", "rdq-worker")
    status, _, _ = call(load_event("api-enqueue"), lambda_context)
    assert status == 201 and len(recorder.invocations) == 1, "the wake-up was sent before the answer"


def test_a_hanging_fan_out_does_not_delay_the_workers_claims(store_url, lambda_context, hanging_lambda, monkeypatch):
    monkeypatch.setenv("RDQ_BATCH_SIZE", "2")
    client = Client(connection.shared_storage())
    client.enqueue_many("emails", [{"handler": "quick", "payload": n} for n in range(20)])
    began = time.monotonic()
    summary = worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 30))
    elapsed = time.monotonic() - began
    assert hanging_lambda.calls == 1, "the fan-out started, and stopped at the first invoke that did not answer"
    assert summary["claimed"] == 20 and summary["outcomes"] == {"SUCCESS": 20}
    assert summary["fanned_out"] == 0
    assert elapsed < 10, f"the worker took {elapsed:.2f}s"


@pytest.mark.parametrize("secret, endpoint, url", [
    ({"url": "postgresql://u:p@db/rdq"}, "", "postgresql://u:p@db/rdq"),
    # RDS-managed master secret: username and password only; the endpoint comes from the stack.
    ({"username": "rdq", "password": "p@ss/word:1"}, "postgresql://db.example.rds.amazonaws.com:5432/rdq?sslmode=require",
     "postgresql://rdq:p%40ss%2Fword%3A1@db.example.rds.amazonaws.com:5432/rdq?sslmode=require"),
    # A rotation-style database secret carries its own host, port and database.
    ({"engine": "postgres", "host": "db.internal", "port": 5432, "dbname": "jobs", "username": "rdq", "password": "pw"}, "",
     "postgresql://rdq:pw@db.internal:5432/jobs"),
])
def test_database_secrets_give_a_storage_url(secret, endpoint, url, monkeypatch):
    monkeypatch.setenv("RDQ_STORAGE_ENDPOINT", endpoint)
    assert _url_from_secret_value(json.dumps(secret)) == url


@pytest.mark.parametrize("secret, message", [
    ({"username": "rdq", "password": "pw"}, "StorageEndpoint"),
    ({"engine": "mysql", "host": "db", "username": "rdq", "password": "pw"}, "not PostgreSQL"),
    ({"user": "rdq"}, "without a 'url' key"),
])
def test_a_database_secret_without_what_a_url_needs_is_refused_precisely(secret, message, monkeypatch):
    monkeypatch.delenv("RDQ_STORAGE_ENDPOINT", raising=False)
    with pytest.raises(ConfigurationError, match=message):
        _url_from_secret_value(json.dumps(secret))


# -- no request path runs past API Gateway's 29 s (issue 19, item 4) ---------------------------------
def test_the_api_functions_statement_timeout_cancels_a_long_statement_well_before_the_gateway(fresh_pg_url, monkeypatch):
    """The API function sets RDQ_PG_STATEMENT_TIMEOUT (template.yaml: 10 s, its timeout 25 s);
    here 1 s, to show that the server cancels a statement that runs past it, and the client's
    deadline follows the setting."""
    from rdq_core.errors import StorageUnavailable
    from rdq_core.storage.postgres import PostgresStorage

    monkeypatch.setenv("RDQ_PG_STATEMENT_TIMEOUT", "1s")
    store = PostgresStorage(fresh_pg_url)
    try:
        assert store._fetch_all("SHOW statement_timeout")[0]["statement_timeout"] == "1s"
        assert store._pool.statement_deadline == 2.0  # 1 s + a quarter, at least 1 s
        began = time.monotonic()
        with pytest.raises(StorageUnavailable):
            with store.translated_errors():
                store._fetch_all("SELECT pg_sleep(5)")
        assert time.monotonic() - began < 2.5
    finally:
        store.close()
    monkeypatch.delenv("RDQ_PG_STATEMENT_TIMEOUT")
    store = PostgresStorage(fresh_pg_url)
    try:
        assert store._fetch_all("SHOW statement_timeout")[0]["statement_timeout"] == "30s", "other processes keep 30 s"
    finally:
        store.close()

