"""Signing secrets by reference: SSM and Secrets Manager (moto's in-process AWS), read when a
request is signed, kept for their max age, refreshed after it, and a failed refresh keeps the
last good value while a first read that fails is a retryable error."""

from __future__ import annotations

import pytest

from rdq_core.targets import SecretRef, TargetError
from rdq_core.targets.secret_refs import SecretSource

moto = pytest.importorskip("moto")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch):
    for name, value in {"AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "x"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SSM", "AWS_ENDPOINT_URL_SECRETS_MANAGER"):
        monkeypatch.delenv(name, raising=False)
    with moto.mock_aws():
        import boto3

        yield boto3.client("ssm"), boto3.client("secretsmanager")


def test_ssm_and_secrets_manager_values_are_read_cached_and_refreshed(aws):
    ssm, secrets = aws
    ssm.put_parameter(Name="/rdq/notify", Value="whsec_one", Type="SecureString")
    secrets.create_secret(Name="rdq-notify-next", SecretString="whsec_two\n")
    now = [0.0]
    source = SecretSource([SecretRef.parse("ssm:/rdq/notify"), SecretRef.parse("secretsmanager:rdq-notify-next")],
                          max_age_seconds=300, clock=lambda: now[0])
    assert source.values() == ["whsec_one", "whsec_two"]
    ssm.put_parameter(Name="/rdq/notify", Value="whsec_rotated", Type="SecureString", Overwrite=True)
    now[0] = 299.0
    assert source.values()[0] == "whsec_one"  # still within its max age
    now[0] = 301.0
    assert source.values()[0] == "whsec_rotated"
    ssm.delete_parameter(Name="/rdq/notify")
    now[0] = 700.0
    assert source.values()[0] == "whsec_rotated"  # the refresh failed: the last good value stays


def test_a_secret_that_cannot_be_read_the_first_time_is_a_retryable_error_naming_it(aws, monkeypatch):
    with pytest.raises(TargetError, match="ssm:/rdq/missing could not be read"):
        SecretSource([SecretRef.parse("ssm:/rdq/missing")]).values()
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    with pytest.raises(TargetError, match="env:NOT_SET_HERE is not set"):
        SecretSource([SecretRef.parse("env:NOT_SET_HERE")]).values()
