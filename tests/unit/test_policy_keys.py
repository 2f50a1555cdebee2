"""A queue policy key nothing reads is refused at start-up, naming the queue, the key and the
valid spelling: a misspelled limit that were skipped would run the queue with no limit at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdq_core.errors import ConfigurationError
from rdq_core.flow import FLOW_POLICY_KEYS
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.hosts.aws_lambda.local_invoke import LocalLambdaContext
from rdq_core.hosts.aws_lambda.settings import Settings
from rdq_core.hosts.aws_lambda.worker import lambda_handler
from rdq_core.engine.retry import POLICY_KEYS, policy_book_from_config
from rdq_core.storage import open_storage
from rdq_core.hosts.process.worker import Worker, WorkerConfig

REPO = Path(__file__).resolve().parents[2]

#: (policies, the refused key as the message quotes it, the spelling it suggests)
MISSPELLED = [
    ({"q1": {"concurrency_limt": 1}}, "'concurrency_limt'", "'concurrency_limit'"),
    ({"q1": {"rate-limit": "1/s"}}, "'rate-limit'", "'rate_limit'"),
    ({"q1": {"Max_In_Flight": 3}}, "'Max_In_Flight'", "'max_in_flight'"),
    ({"q1": {"max_attempts": 3, "max_attempt": 2}}, "'max_attempt'", "'max_attempts'"),
    ({"q1": {"fair_group": True}}, "'fair_group'", "'fair_groups'"),
    ({"q1": {"dead-on": ["ValueError"]}}, "'dead-on'", "'dead_on'"),
    ({"q1": {"backoff": {"initial_second": 1}}}, "'initial_second'", "'initial_seconds'"),
    ({"q1": {"concurrency_limit": {"default": 1, "key": {"a": 2}}}}, "'key'", "'keys'"),
]


def _names_it(message: str, key: str, spelling: str) -> None:
    assert "'q1'" in message, "the queue"
    assert f"unknown key {key}" in message, "the key"
    assert f"did you mean {spelling}" in message, "the valid spelling"


@pytest.mark.parametrize("policies, key, spelling", MISSPELLED)
def test_a_misspelled_key_is_refused_with_the_valid_spelling(policies: dict[str, Any], key: str, spelling: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        policy_book_from_config(policies)
    _names_it(str(caught.value), key, spelling)


def test_a_key_like_no_other_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError) as caught:
        policy_book_from_config({"q1": {"speed": "fast"}})
    message = str(caught.value)
    assert "unknown key 'speed'" in message and "did you mean" not in message
    assert all(key in message for key in POLICY_KEYS)


def test_every_key_the_hosts_read_is_accepted() -> None:
    assert set(FLOW_POLICY_KEYS) < set(POLICY_KEYS)
    book = policy_book_from_config({"q1": {
        "max_attempts": 3, "backoff": {"initial_seconds": 0.5, "factor": 3, "max_seconds": 9, "jitter": 0},
        "retry_on": ["TimeoutError"], "dead_on": ["KeyError"], "concurrency_limit": {"default": 1, "keys": {"k": 2}},
        "max_in_flight": 4, "rate_limit": "5/s", "fair_groups": True, "priority_aging_seconds": 10}})
    assert book.queues["q1"].max_attempts == 3 and book.flow_for("q1").limit_for("k") == 2


def test_a_worker_built_from_a_misspelled_policy_never_starts(tmp_path: Path) -> None:
    """The embedding path: a Python host builds its PolicyBook from configuration, then its worker."""
    with open_storage(f"sqlite:///{tmp_path}/rdq.db") as storage:
        storage.migrate()
        with pytest.raises(ConfigurationError) as caught:
            Worker(storage, WorkerConfig(queues=["q1"]), registry=HandlerRegistry(),
                   policies=policy_book_from_config({"q1": {"concurrency_limt": 1}}))
    _names_it(str(caught.value), "'concurrency_limt'", "'concurrency_limit'")


@pytest.mark.parametrize("policies, key, spelling", MISSPELLED[:2])
def test_rdq_worker_exits_at_start_up_naming_the_key(tmp_path: Path, policies: dict[str, Any], key: str,
                                                     spelling: str) -> None:
    store = tmp_path / "rdq.db"
    env = {**os.environ, "RDQ_QUEUE_POLICIES": json.dumps(policies), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "--storage", f"sqlite:///{store}", "worker",
                           "--handlers", "rdq_core.examples", "--queues", "q1"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    _names_it(done.stderr, key, spelling)
    assert "Traceback" not in done.stderr
    assert not store.exists(), "refused before the store was opened"


@pytest.mark.parametrize("policies, key, spelling", MISSPELLED[:2])
def test_the_lambda_worker_refuses_its_settings(monkeypatch: pytest.MonkeyPatch, no_rdq_settings: None,
                                                tmp_path: Path, policies: dict[str, Any], key: str,
                                                spelling: str) -> None:
    store = tmp_path / "rdq.db"
    monkeypatch.setenv("RDQ_STORAGE_URL", f"sqlite:///{store}")
    monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
    monkeypatch.setenv("RDQ_QUEUES", "q1")
    monkeypatch.setenv("RDQ_QUEUE_POLICIES", json.dumps(policies))
    with pytest.raises(ConfigurationError) as caught:
        Settings.from_env()
    _names_it(str(caught.value), key, spelling)
    with pytest.raises(ConfigurationError):
        lambda_handler({"source": "aws.events", "detail-type": "Scheduled Event"}, LocalLambdaContext("rdq-worker", 30))
    assert not store.exists(), "no invocation reaches the store"


def test_the_lambda_worker_refuses_policies_that_are_not_json(monkeypatch: pytest.MonkeyPatch,
                                                              no_rdq_settings: None) -> None:
    monkeypatch.setenv("RDQ_QUEUE_POLICIES", "{'q1': {}}")
    with pytest.raises(ConfigurationError, match="RDQ_QUEUE_POLICIES is not valid JSON"):
        Settings.from_env()
