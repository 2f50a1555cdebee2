"""The deployed functions keep Powertools JSON logs and EMF metrics; only ``rdq dev`` changes.

Run in a fresh interpreter: Powertools binds its output at import, and the rest of the suite
imports the Lambda host with other settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from .conftest import REPO

SCRIPT = textwrap.dedent("""
    import sys
    from rdq_core import Client, handler
    from rdq_core.hosts.aws_lambda import worker
    from rdq_core.hosts.aws_lambda.connection import shared_storage
    from rdq_core.hosts.aws_lambda.local_invoke import LocalLambdaContext, scheduled_event
    from rdq_core.hosts.aws_lambda.observability import logger

    @handler("say-hello", timeout_seconds=2)
    def say_hello(payload, ctx):
        logger.info("hello from the handler")
        return None

    client = Client(shared_storage())
    client.enqueue("demo", "say-hello", id="hello-1")
    client.enqueue("demo", "reject", {"reason": "bad address"}, id="reject-1")
    worker.lambda_handler(scheduled_event("rdq-worker-schedule"), LocalLambdaContext("rdq-worker", 30))
""")


def test_the_lambda_worker_logs_powertools_json_with_task_keys_and_publishes_emf(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    env.update({
        "PYTHONPATH": str(REPO), "RDQ_STORAGE_URL": f"sqlite:///{tmp_path}/rdq.db", "RDQ_AUTO_MIGRATE": "true",
        "RDQ_HANDLERS": "rdq_core.examples", "POWERTOOLS_LOG_LEVEL": "INFO", "POWERTOOLS_SERVICE_NAME": "rdq",
        "POWERTOOLS_METRICS_NAMESPACE": "rdq", "POWERTOOLS_TRACE_DISABLED": "true",
    })
    env.pop("POWERTOOLS_METRICS_DISABLED", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    logs = [line for line in lines if "_aws" not in line]
    emf = [line for line in lines if "_aws" in line]

    outcomes = {line["rdq_task"]["task_id"]: line for line in logs if "rdq_task" in line}
    assert set(outcomes) == {"hello-1", "reject-1"}
    assert outcomes["hello-1"]["level"] == "INFO" and outcomes["hello-1"]["rdq_task"]["outcome"] == "SUCCESS"
    dead = outcomes["reject-1"]
    assert dead["level"] == "WARNING" and dead["rdq_task"]["status"] == "DEAD" and "dead-lettered" in dead["message"]
    assert dead["function_name"] == "rdq-worker", "Lambda context fields stay on CloudWatch lines"

    said = [line for line in logs if line["message"] == "hello from the handler"]
    assert len(said) == 1 and (said[0]["task_id"], said[0]["queue"], said[0]["attempt"]) == ("hello-1", "demo", 1)
    assert not [line for line in logs if line["message"] in ("task started", "task finished", "task failed")]

    names = {m["Name"] for blob in emf for d in blob["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]}
    assert {"Claimed", "Succeeded", "DeadLettered"} <= names
