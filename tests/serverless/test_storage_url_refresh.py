"""The storage URL after its first resolution: a refresh that fails keeps the last good URL and
its open connection, is tried again after a backoff (not on every invocation), and a recovered
refresh picks up a rotated value. A first resolution that fails still fails."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
from aws_lambda_powertools.utilities.parameters.exceptions import GetParameterError

from rdq_core.hosts.aws_lambda import connection

SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rdq-url-AbCdEf"


class StubSecrets:
    """A Powertools provider whose answers the test sets: a URL, or an error to raise."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def get(self, name: str, **_: Any) -> Any:
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch, no_rdq_settings: None) -> Iterator[Clock]:
    monkeypatch.delenv("RDQ_STORAGE_URL", raising=False)
    monkeypatch.setenv("RDQ_STORAGE_URL_SECRET", SECRET)
    monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
    clock = Clock()
    monkeypatch.setattr(connection, "_clock", clock)
    connection.close_shared_storage()
    yield clock
    connection.close_shared_storage()


def _stub(answer: Any) -> StubSecrets:
    stub = StubSecrets(answer)
    connection._providers["secrets"] = stub
    return stub


def test_a_first_resolution_that_fails_raises(secret_env: Clock) -> None:
    _stub(GetParameterError("Secrets Manager is throttling"))
    with pytest.raises(GetParameterError):
        connection.resolve_storage_url()


def test_a_failed_refresh_keeps_the_last_good_url_and_its_connection(secret_env: Clock, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    first, rotated = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    stub = _stub(json.dumps({"url": first}))
    storage = connection.shared_storage()

    stub.answer = GetParameterError("Secrets Manager is unavailable")
    with caplog.at_level(logging.WARNING, logger="rdq"):
        assert connection.shared_storage() is storage, "the open connection stays in use"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "last good URL" in warning.getMessage() and first not in warning.getMessage()
    assert warning.__dict__["error_type"] == "GetParameterError"
    assert stub.calls == 2

    # Within the backoff, no invocation calls Secrets Manager again.
    secret_env.now += connection.REFRESH_BACKOFF_SECONDS - 0.5
    assert connection.resolve_storage_url() == first and stub.calls == 2
    # After it, one attempt; it fails again and the next wait is twice as long.
    secret_env.now += 1.0
    assert connection.resolve_storage_url() == first and stub.calls == 3
    secret_env.now += connection.REFRESH_BACKOFF_SECONDS + 0.5
    assert connection.resolve_storage_url() == first and stub.calls == 3
    secret_env.now += connection.REFRESH_BACKOFF_SECONDS
    # Recovered, with a rotated value: the next storage is opened on it.
    stub.answer = json.dumps({"url": rotated})
    assert connection.resolve_storage_url() == rotated and stub.calls == 4
    assert connection.shared_storage() is not storage
    # And once recovered, a later failure starts its backoff from the first step again.
    stub.answer = GetParameterError("blip")
    assert connection.resolve_storage_url() == rotated
    assert connection._last_good[f"secret {SECRET}"].failures == 1


def test_an_unreadable_rotated_value_keeps_the_last_good_url(secret_env: Clock) -> None:
    stub = _stub("postgresql://db/rdq")
    assert connection.resolve_storage_url() == "postgresql://db/rdq"
    stub.answer = json.dumps({"no": "url"})  # a rotation that wrote the wrong shape
    assert connection.resolve_storage_url() == "postgresql://db/rdq"


def test_with_secrets_manager_a_blip_after_expiry_keeps_serving_and_recovery_reads_the_rotation(
        secret_env: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto")
    import boto3
    from botocore.exceptions import ClientError

    monkeypatch.setenv("RDQ_STORAGE_URL_CACHE_SECONDS", "0")  # every resolution is a refresh
    with moto.mock_aws():
        secrets = boto3.client("secretsmanager", region_name="us-east-1")
        arn = secrets.create_secret(Name="rdq-url", SecretString=json.dumps({"url": "postgresql://db/one"}))["ARN"]
        monkeypatch.setenv("RDQ_STORAGE_URL_SECRET", arn)
        assert connection.resolve_storage_url() == "postgresql://db/one"

        client = connection._provider("secrets").client
        real = client.get_secret_value

        def throttled(**_: Any) -> Any:
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "GetSecretValue")

        monkeypatch.setattr(client, "get_secret_value", throttled)
        assert connection.resolve_storage_url() == "postgresql://db/one"

        monkeypatch.setattr(client, "get_secret_value", real)
        secrets.put_secret_value(SecretId=arn, SecretString=json.dumps({"url": "postgresql://db/two"}))
        assert connection.resolve_storage_url() == "postgresql://db/one", "still inside the backoff"
        secret_env.now += connection.REFRESH_BACKOFF_SECONDS
        assert connection.resolve_storage_url() == "postgresql://db/two"
