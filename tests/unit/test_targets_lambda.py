"""Lambda targets end to end: a real store, the real ``Client`` and ``Worker``, and the bound
function running in the project's Lambda emulator (``bench/lambda_fleet``), reached by rdq's own
boto3 client through ``AWS_ENDPOINT_URL_LAMBDA``: the Invoke API, its 429 at the concurrency
limit, and FunctionError answers as Lambda gives them."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.aws.clients import client_config
from rdq_core.client import Client
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Outcome, TaskStatus
from rdq_core.targets import bind_targets, parse_targets

from .test_targets_https import QUEUE, outcomes, run_until_settled

pytest.importorskip("boto3")

from bench.lambda_fleet.emulator import Emulator, Fleet, function_environment
from bench.lambda_fleet.template import FunctionConfig

FUNCTION = "rdq-target-fn"

#: The bound function: what it does is in the task's payload; it sees only the envelope.
FUNCTION_SOURCE = '''
import time


class PermanentError(Exception):
    pass


def handler(event, context):
    payload = event["payload"] or {}
    do = payload.get("do")
    if do == "fail":
        raise ValueError("cannot resize a " + str(payload.get("what")))
    if do == "fail_first" and event["attempt"] == 1:
        raise RuntimeError("first attempt fails")
    if do == "permanent":
        raise PermanentError("bad image")
    if do == "dead_shape":
        return {"rdq_outcome": {"dead": "unsupported format"}}
    if do == "sleep":
        time.sleep(payload["seconds"])
    return {"seen": {k: event[k] for k in ("task_id", "queue", "handler", "attempt", "redrive_count")},
            "payload": payload, "budget": event["timeout_seconds"]}
'''


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "target_fn.py").write_text(textwrap.dedent(FUNCTION_SOURCE))
    config = FunctionConfig(name=FUNCTION, code_dir=code, handler="target_fn.handler", timeout_s=30, memory_mb=128,
                            environment={}, reserved_concurrency=1, max_event_age_s=60, max_retry_attempts=0,
                            architecture="x86_64")
    emulator = Emulator().start()
    fleet = emulator.add(Fleet(config, function_environment(config, emulator.endpoint, {}), tmp_path,
                               account_concurrency=10))
    # rdq's worker, in this process, reaches the emulator the way it reaches Lambda.
    monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", emulator.endpoint)
    for name, value in {"AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "x"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    try:
        yield fleet
    finally:
        fleet.close()
        emulator.stop()


def bound(function: str = FUNCTION, **extra: Any) -> HandlerRegistry:
    registry = HandlerRegistry()
    bind_targets(parse_targets({"resize": {"lambda": function, "timeout_seconds": 8, **extra}}), into=registry)
    return registry


def test_a_returned_value_is_the_result_and_the_function_gets_the_envelope(storage, fleet):
    task = Client(storage).enqueue(QUEUE, "resize", {"w": 200}, id="img-1")
    (done,) = run_until_settled(storage, bound(), [task.id])
    assert done.status is TaskStatus.SUCCEEDED and outcomes(done) == [Outcome.SUCCESS]
    assert done.result["seen"] == {"task_id": "img-1", "queue": QUEUE, "handler": "resize", "attempt": 1,
                                   "redrive_count": 0}
    assert done.result["payload"] == {"w": 200}
    assert 1 <= done.result["budget"] <= 8  # fitted to the binding's timeout


def test_a_function_error_is_retried_and_then_dead_and_a_redrive_runs_it_again(storage, fleet):
    client = Client(storage)
    flaky = client.enqueue(QUEUE, "resize", {"do": "fail_first"}).id
    failing = client.enqueue(QUEUE, "resize", {"do": "fail", "what": "tiff"}).id
    flaky_done, failing_done = run_until_settled(storage, bound(), [flaky, failing], max_attempts=2)
    assert flaky_done.status is TaskStatus.SUCCEEDED
    assert outcomes(flaky_done) == [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS]
    assert failing_done.status is TaskStatus.DEAD and outcomes(failing_done) == [Outcome.RETRYABLE_FAILURE] * 2
    error = failing_done.last_error
    assert error is not None and error.type.endswith("TargetFunctionError")
    # The history names the target, the function's error and the latency.
    assert error.message.startswith(f"resize -> lambda {FUNCTION}: FunctionError (Unhandled) ValueError: "
                                    "cannot resize a tiff after ")
    client.redrive(QUEUE, ids=[failing])
    (again,) = run_until_settled(storage, bound(), [failing], max_attempts=2)
    assert again.status is TaskStatus.DEAD and again.redrive_count == 1
    assert len(again.attempts) == 4


@pytest.mark.parametrize(("payload", "error_type"), [
    ({"do": "permanent"}, "TargetFunctionDeadLetter"),  # a named error type (PermanentError by default)
    ({"do": "dead_shape"}, "TargetFunctionDeadLetter"),  # the opt-in shape
])
def test_a_named_error_type_or_the_opt_in_shape_dead_letters_at_once(storage, fleet, payload, error_type):
    task = Client(storage).enqueue(QUEUE, "resize", payload)
    (done,) = run_until_settled(storage, bound(), [task.id], max_attempts=5)
    assert done.status is TaskStatus.DEAD and outcomes(done) == [Outcome.PERMANENT_FAILURE]
    assert done.last_error is not None and done.last_error.type.endswith(error_type)


def test_a_binding_can_name_its_own_dead_error_types(storage, fleet):
    task = Client(storage).enqueue(QUEUE, "resize", {"do": "fail", "what": "gif"})
    (done,) = run_until_settled(storage, bound(dead_on_errors=["ValueError"]), [task.id], max_attempts=5)
    assert done.status is TaskStatus.DEAD and outcomes(done) == [Outcome.PERMANENT_FAILURE]


def test_a_throttled_invoke_snoozes_without_spending_an_attempt(storage, fleet):
    """The function's only slot is held by another caller: the worker's invoke gets Lambda's 429."""
    import boto3

    holder = boto3.client("lambda", config=client_config(read_timeout=30))
    hold = threading.Thread(target=holder.invoke, kwargs={
        "FunctionName": FUNCTION, "Payload": json.dumps({"payload": {"do": "sleep", "seconds": 1.5}, "attempt": 1,
                                                          "task_id": "x", "queue": "q", "handler": "h",
                                                          "redrive_count": 0, "timeout_seconds": 5})})
    hold.start()
    deadline = time.monotonic() + 10
    while fleet.idle():
        assert time.monotonic() < deadline, "the holding call never started"
        time.sleep(0.01)
    try:
        task = Client(storage).enqueue(QUEUE, "resize", {"w": 1})
        (done,) = run_until_settled(storage, bound(), [task.id], max_attempts=1)
    finally:
        hold.join(30)
    assert done.status is TaskStatus.SUCCEEDED
    assert outcomes(done)[0] is Outcome.SNOOZED and outcomes(done)[-1] is Outcome.SUCCESS
    assert done.attempt_count == 1  # max_attempts=1, yet it ran: the throttles spent nothing
    assert sum(fleet.throttled_sync.values()) >= 1


def test_a_function_slower_than_the_budget_is_a_failed_attempt_ended_on_time(storage, fleet):
    task = Client(storage).enqueue(QUEUE, "resize", {"do": "sleep", "seconds": 6})
    registry = HandlerRegistry()
    bind_targets(parse_targets({"resize": {"lambda": FUNCTION, "timeout_seconds": 2}}), into=registry)
    began = time.monotonic()
    (done,) = run_until_settled(storage, registry, [task.id], max_attempts=1)
    assert time.monotonic() - began < 5
    assert done.status is TaskStatus.DEAD and done.last_error is not None
    assert done.last_error.type.endswith("TargetTimeout")


def test_a_missing_function_is_a_failed_attempt_naming_it(storage, fleet):
    task = Client(storage).enqueue(QUEUE, "resize", {})
    (done,) = run_until_settled(storage, bound("no-such-function"), [task.id], max_attempts=1)
    assert done.status is TaskStatus.DEAD and done.last_error is not None
    assert "resize -> lambda no-such-function: ResourceNotFoundException" in done.last_error.message
