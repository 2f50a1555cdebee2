"""Targets on the deployed stack: handler names bound to two other Lambda functions deployed next
to rdq in LocalStack, one in JavaScript (Node) and one in Python.

What is real: the two functions created through LocalStack's Lambda API from the sources in
``target_functions/`` (LocalStack's local executor runs ``node`` for the first, a fork of its own
Python for the second); rdq's real template built and deployed as conftest.py does, with the
``Targets`` parameter binding ``js.add`` and ``thumbnail`` to the functions' ARNs and
``TargetFunctionArns`` naming them; tasks enqueued and redriven through the stack's API Gateway,
run by its worker, which invokes the bound function synchronously through LocalStack.

Run: ``python -m pytest -m localstack tests/localstack/test_targets_e2e.py``."""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core import open_storage
from rdq_testing import servers

from .conftest import Stack, aws, deploy, sam_build, wait_for
from .test_e2e import call, enqueue, task_in

pytestmark = [pytest.mark.localstack, pytest.mark.timeout(1500)]

FUNCTIONS = Path(__file__).with_name("target_functions")
#: A target's budget, and the bound functions' own timeout (no longer, as docs/targets.md asks):
#: ample for LocalStack to start a process per invocation on a busy machine.
TARGET_SECONDS = 20
QUEUE = "targets"


@dataclass
class Deployed:
    stack: Stack
    add_arn: str  # the JavaScript function
    thumbnail_arn: str  # the Python function
    bindings: dict[str, Any]


def _create_function(localstack: Any, name: str, runtime: str, source: Path, role_arn: str) -> str:
    """A one-file function named ``name``, its handler ``<module>.handler``; its ARN once active."""
    module = "index" if source.suffix == ".js" else "app"
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as package:
        package.write(source, f"{module}{source.suffix}")
    lam = aws(localstack, "lambda")
    arn = str(lam.create_function(FunctionName=name, Runtime=runtime, Handler=f"{module}.handler", Role=role_arn,
                                  Code={"ZipFile": archive.getvalue()}, Timeout=TARGET_SECONDS)["FunctionArn"])
    wait_for(f"function {name} active",
             lambda: lam.get_function_configuration(FunctionName=name).get("State", "Active") == "Active", 60)
    return arn


def _target_functions(localstack: Any) -> tuple[str, str]:
    iam = aws(localstack, "iam")
    trust = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
    role = iam.create_role(RoleName="rdq-target-functions", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    add = _create_function(localstack, "rdq-target-add-js", "nodejs18.x", FUNCTIONS / "add.js", role)
    thumbnail = _create_function(localstack, "rdq-target-thumbnail-py", "python3.11",
                                 FUNCTIONS / "fail_until_redriven.py", role)
    return add, thumbnail


@pytest.fixture(scope="module")
def deployed(localstack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    add_arn, thumbnail_arn = _target_functions(localstack)
    bindings = {"js.add": {"lambda": add_arn, "timeout_seconds": TARGET_SECONDS},
                "thumbnail": {"lambda": thumbnail_arn, "timeout_seconds": TARGET_SECONDS}}
    build_dir = sam_build(tmp_path_factory.mktemp("build-targets") / "build", "postgresql")
    with servers.pg_scratch_database(servers.SHARED_PG_URL, prefix="rdq_localstack_targets_") as url:
        storage = open_storage(url)
        try:
            storage.migrate()
        finally:
            storage.close()
        stack = deploy(localstack, "postgresql", url, build_dir, name="rdq-targets", extra_parameters={
            "Targets": json.dumps(bindings), "TargetFunctionArns": f"{add_arn},{thumbnail_arn}"})
        yield Deployed(stack, add_arn, thumbnail_arn, bindings)


def test_the_worker_gets_the_bindings_and_may_invoke_exactly_the_bound_functions(deployed: Deployed):
    localstack = deployed.stack.localstack
    worker = aws(localstack, "lambda").get_function_configuration(FunctionName=deployed.stack.worker)
    assert json.loads(worker["Environment"]["Variables"]["RDQ_TARGETS"]) == deployed.bindings
    role = worker["Role"].rsplit("/", 1)[-1]
    policy = aws(localstack, "iam").get_role_policy(RoleName=role, PolicyName="invoke-targets")["PolicyDocument"]
    document = json.loads(policy) if isinstance(policy, str) else policy
    assert document["Statement"] == [{"Effect": "Allow", "Action": "lambda:InvokeFunction",
                                      "Resource": [deployed.add_arn, deployed.thumbnail_arn]}], document


def test_a_task_enqueued_through_the_api_runs_the_node_function_and_keeps_its_result(deployed: Deployed):
    stack = deployed.stack
    task_id = enqueue(stack, QUEUE, "js.add", payload={"a": 2, "b": 3})
    done = wait_for("the worker to invoke the Node function", lambda: task_in(stack, task_id, "SUCCEEDED", "DEAD"), 120)
    assert done["status"] == "SUCCEEDED", done
    result = done["result"]
    # The function's own answer, computed from the envelope the worker sent it.
    assert result.pop("runtime").startswith("node "), result
    assert result == {"sum": 5, "task_id": task_id, "queue": QUEUE, "handler": "js.add", "attempt": 1}, result
    (attempt,) = done["attempts"]
    assert attempt["outcome"] == "SUCCESS" and attempt["error"] is None, attempt


def test_a_failing_function_is_retried_then_dead_and_a_redrive_through_the_api_runs_it_again(deployed: Deployed):
    stack = deployed.stack
    task_id = enqueue(stack, QUEUE, "thumbnail", payload={"image": "cat.png"}, max_attempts=2,
                      backoff={"initial_seconds": 0.1, "factor": 1.0, "max_seconds": 0.1, "jitter": 0.0})

    def dead() -> dict | None:
        if task_in(stack, task_id, "PENDING"):
            stack.invoke(stack.worker, "worker-scheduled.json")  # the retry is due: run it now, not at the tick
        return task_in(stack, task_id, "DEAD")

    task = wait_for("the failing target's task dead", dead, 180, every=1)
    assert [a["outcome"] for a in task["attempts"]] == ["RETRYABLE_FAILURE", "RETRYABLE_FAILURE"], task
    for number, attempt in enumerate(task["attempts"], 1):
        error = attempt["error"]
        # The history names the handler, the function, its error type and the function's message.
        assert error["type"].endswith("TargetFunctionError"), error
        assert error["message"].startswith("thumbnail -> lambda "), error
        assert "rdq-target-thumbnail-py" in error["message"], error
        assert "FunctionError (Unhandled) ThumbnailError" in error["message"], error
        assert f"attempt {number} of task {task_id}: the image store is down" in error["message"], error
        assert re.search(r" after \d+ ms$", error["message"]), error  # the call's latency
    status, _, page = call(stack, "GET", f"/v1/queues/{QUEUE}/dlq")
    assert status == 200 and task_id in {t["id"] for t in page["tasks"]}, page

    status, _, answer = call(stack, "POST", f"/v1/queues/{QUEUE}/dlq:redrive", {"ids": [task_id]})
    assert status == 200, answer
    done = wait_for("the redriven task", lambda: task_in(stack, task_id, "SUCCEEDED", "DEAD"), 120)
    assert done["status"] == "SUCCEEDED", done
    # The function succeeds once its envelope says the task was redriven: its answer is the result.
    assert done["result"] == {"thumbnail": "cat.png.small.png", "redrive_count": 1, "attempt": 1}, done
    assert [a["outcome"] for a in done["attempts"]] == ["RETRYABLE_FAILURE", "RETRYABLE_FAILURE", "SUCCESS"], done
