"""Secrets and payloads stay out of logs, error bodies and task records.

A storage URL carrying a (fake) password is configured directly, through Secrets Manager (moto)
and for a real ``rdq dev`` on PostgreSQL (trust auth ignores the password, so the store works).
Everything the code prints — Powertools JSON logs on stdout, stdlib ``rdq.*`` loggers (caplog),
``rdq dev``'s own output — is captured across enqueue, validation errors, a worker run and an
unreachable store, and searched for the password and for a payload marker. The payload marker
appears only when the deployer opts in with ``RDQ_LOG_PAYLOADS=true`` (which proves the capture
would have seen it).
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from rdq_core.compliance.support import wait_until

PASSWORD = "Fake-S3cret-Pw-7c1e"
PAYLOAD_MARKER = "payload-marker-5d2a"

UNREACHABLE = {
    "postgresql": f"postgresql://rdq:{PASSWORD}@127.0.0.1:1/rdq?connect_timeout=1",
    "redis": f"redis://rdq:{PASSWORD}@127.0.0.1:1/0?socket_connect_timeout=1",
    "mongodb": f"mongodb://rdq:{PASSWORD}@127.0.0.1:1/rdq?serverSelectionTimeoutMS=500&connectTimeoutMS=500",
}


def _captured(capsys, caplog) -> str:
    out, err = capsys.readouterr()
    return out + err + "\n".join(f"{r.getMessage()} {r.exc_text or ''} {r.__dict__}" for r in caplog.records)


@pytest.mark.parametrize("backend", sorted(UNREACHABLE))
def test_unreachable_store_is_503_without_the_password(backend, api_call, monkeypatch, capsys, caplog):
    from rdq_core.hosts.aws_lambda import connection

    caplog.set_level(logging.DEBUG, logger="rdq")
    monkeypatch.setenv("POWERTOOLS_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("RDQ_STORAGE_URL", UNREACHABLE[backend])
    connection.close_shared_storage()
    bodies = []
    for method, target, body in [("POST", "/v1/queues/q/tasks", {"handler": "greet", "payload": {"m": PAYLOAD_MARKER}}),
                                 ("GET", "/v1/queues/q/stats", None), ("GET", "/v1/tasks/t-1", None)]:
        status, headers, problem = api_call(method, target, body)
        assert status == 503, (backend, status, problem)
        assert headers["content-type"] == "application/problem+json" and headers.get("retry-after")
        bodies.append(json.dumps(problem))
    logs = _captured(capsys, caplog)
    assert "storage unavailable" in logs, "the capture saw the incident"
    for text in bodies + [logs]:
        assert PASSWORD not in text
        assert PAYLOAD_MARKER not in text


def test_url_from_secrets_manager_never_leaks(api_call, monkeypatch, capsys, caplog):
    moto = pytest.importorskip("moto")
    import boto3

    from rdq_core.hosts.aws_lambda import connection

    # rdq's own loggers at DEBUG; botocore stays at its default (WARNING): at DEBUG botocore itself
    # prints response bodies, secret values included (docs/security.md says so).
    caplog.set_level(logging.DEBUG, logger="rdq")
    with moto.mock_aws():
        arn = boto3.client("secretsmanager", region_name="us-east-1").create_secret(
            Name="rdq-url", SecretString=json.dumps({"url": UNREACHABLE["postgresql"]}))["ARN"]
        capsys.readouterr()
        caplog.clear()
        monkeypatch.delenv("RDQ_STORAGE_URL")
        monkeypatch.setenv("RDQ_STORAGE_URL_SECRET", arn)
        monkeypatch.setenv("RDQ_STORAGE_URL_CACHE_SECONDS", "0")
        connection.close_shared_storage()
        status, _, problem = api_call("POST", "/v1/queues/q/tasks", {"handler": "greet", "payload": PAYLOAD_MARKER})
    assert status == 503, problem
    logs = _captured(capsys, caplog)
    assert PASSWORD not in json.dumps(problem) + logs
    assert PAYLOAD_MARKER not in logs


@pytest.mark.parametrize("log_payloads", [False, True], ids=["default", "opted-in"])
def test_rdq_dev_on_postgres_with_a_password_logs_neither(dev_server_factory, pg_database_url, log_payloads):
    from rdq_testing.servers import pg_fresh_schema as fresh_schema_url

    # Trust auth ignores the password: the store works, and the password is in every URL we pass.
    url = fresh_schema_url(pg_database_url).replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@", 1)
    assert PASSWORD in url
    env = {"RDQ_LOG_PAYLOADS": "true"} if log_payloads else {}
    server = dev_server_factory(storage_url=url, env=env)
    status, _, raw = server.request("POST", "/v1/queues/demo/tasks",
                                    {"handler": "greet", "payload": {"name": PAYLOAD_MARKER}, "id": "secret-1"})
    assert status == 201, raw
    server.request("POST", "/v1/queues/demo/tasks:batch", {"tasks": [{"handler": "greet", "payload": {"name": PAYLOAD_MARKER}}]})
    server.request("POST", "/v1/queues/demo/tasks", {"handler": "flaky", "payload": {"failures": 1, "m": PAYLOAD_MARKER},
                                                     "id": "secret-2", "backoff": {"initial_seconds": 0.2, "jitter": 0}})
    for bad in ({"handler": "BAD!", "payload": PAYLOAD_MARKER}, {"handler": "greet", "payload": PAYLOAD_MARKER, "nope": 1}):
        status, _, raw = server.request("POST", "/v1/queues/demo/tasks", bad)
        assert status == 422 and PASSWORD not in raw.decode() and PAYLOAD_MARKER not in raw.decode()
    server.request("GET", "/v1/tasks/unknown-task")

    def settled():
        tasks = [json.loads(server.request("GET", f"/v1/tasks/{t}")[2]) for t in ("secret-1", "secret-2")]
        return tasks if all(t["status"] == "SUCCEEDED" for t in tasks) else None

    tasks = wait_until(settled, 30, what="the worker to run both tasks")
    assert PASSWORD not in json.dumps(tasks), "task records never carry the storage URL"
    deadline = time.monotonic() + 5
    while "enqueued" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    output = server.output()
    assert "secret-1 demo/greet try 1/5 SUCCESS" in output and "enqueued" in output, "the capture saw the activity"
    assert PASSWORD not in output
    assert "postgres:***@" in output, "the banner shows the store with the password redacted"
    assert (PAYLOAD_MARKER in output) is log_payloads


def test_rdq_dev_failing_to_reach_its_store_does_not_print_the_password(tmp_path):
    import os
    import subprocess
    import sys

    from .conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RDQ_API_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "--storage", UNREACHABLE["postgresql"],
                             "dev", "--port", "0"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert PASSWORD not in result.stdout + result.stderr
