"""Fixtures for the serverless host: real event JSON, a Lambda context with a real deadline,
a fresh SQLite store per test, and offline AWS settings for the tooling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

# The offline AWS / Powertools environment is set once for the whole suite in tests/conftest.py.
from rdq_core.engine import payloads
from rdq_core.hosts.aws_lambda import connection
from rdq_core.hosts.aws_lambda.local_invoke import LocalLambdaContext

REPO = Path(__file__).resolve().parents[2]
EVENTS = REPO / "events"

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sam_build: runs `sam build` for python3.12 (slow; needs python3.12 on PATH or in pyenv)")
    config.addinivalue_line("filterwarnings", "ignore:No application metrics to publish")


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_rdq_settings: None) -> str:
    """A fresh, migrated SQLite store, configured the way the functions read it (and by nothing
    from the caller's environment: ``no_rdq_settings``)."""
    url = f"sqlite:///{tmp_path}/rdq.db"
    monkeypatch.setenv("RDQ_STORAGE_URL", url)
    monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
    monkeypatch.setenv("RDQ_HANDLERS", "tests.serverless.sample_handlers")
    yield url
    connection.close_shared_storage()


@pytest.fixture
def lambda_context() -> Callable[..., LocalLambdaContext]:
    def make(function_name: str = "rdq-api", timeout_seconds: float = 30.0) -> LocalLambdaContext:
        return LocalLambdaContext(function_name, timeout_seconds)

    return make


#: The payload bucket the ``s3`` fixture creates in moto.
PAYLOAD_BUCKET = "rdq-payloads-test"


@pytest.fixture
def s3(store_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A moto bucket named by RDQ_PAYLOAD_BUCKET, as the template sets it for the functions."""
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("RDQ_HANDLERS", "tests.serverless.payload_handlers")
    monkeypatch.setenv("RDQ_PAYLOAD_BUCKET", PAYLOAD_BUCKET)
    with moto.mock_aws():
        import boto3

        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=PAYLOAD_BUCKET)
        payloads.reset()
        yield client
    payloads.reset()


def load_event(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / f"{name}.json").read_text())
