"""The worker function as a fleet, under the project's Lambda emulator (bench/lambda_fleet).

A short scenario on PostgreSQL: 300 tasks of 50 ms, a cap of 3, a schedule ticking every second
(so ticks overlap with running invocations and with each other's fan-out) and a burst of API
wake-ups from four API containers. Whatever started the invocations, the backlog drains with no
task lost, no two attempts of a task overlapping, never more than the cap of invocations holding
tasks at once, and no fan-out or wake-up invocation started only to find every slot held. Also
the emulator's own contract, through boto3: a synchronous call over the concurrency limit is a
429, an asynchronous one is queued.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from rdq_core.aws.clients import client_config
from rdq_testing import servers

pytest.importorskip("psycopg")
pytest.importorskip("samtranslator")

from bench.lambda_fleet.emulator import Emulator, Fleet, function_environment
from bench.lambda_fleet.scenario import Scenario, function_for, run


@pytest.fixture(scope="module")
def pg_admin_url() -> str:
    problem = servers.pg_reachable(servers.SHARED_PG_URL)
    if problem:
        servers.fail_or_skip(problem)
    return servers.SHARED_PG_URL


@pytest.mark.timeout(150)
def test_overlapping_ticks_and_wakeups_drain_within_the_cap(pg_admin_url: str) -> None:
    scenario = Scenario(
        backend="postgres", pg_admin_url=pg_admin_url, tasks=300, handler_ms=50, cap=3, batch_size=10,
        worker_timeout_s=20, tick_s=1.0, burst_at_s=0.5, api_containers=4, enqueue_chunk=20,
        wake_debounce_s=0.0, account_concurrency=12, time_limit_s=75, idle_wait_s=0.5)
    result = run(scenario)
    summary = json.dumps({k: result[k] for k in (
        "drained", "drain_s", "peak_invocations", "peak_invocations_holding_tasks", "invocations_started",
        "invocations_without_slot", "statuses", "lost_examples", "overlapping_attempt_examples", "overlapping_runs",
        "timeouts", "errors")})
    assert result["drained"], summary
    assert result["lost_tasks"] == 0, summary
    assert result["overlapping_attempts"] == 0 and not result["overlapping_runs"], summary
    assert result["timeouts"] == 0 and result["errors"] == 0, summary
    assert result["invocations_started"].get("tick", 0) >= 2 and result["invocations_started"].get("wake", 0) >= 1, summary
    assert result["peak_invocations_holding_tasks"] <= scenario.cap, summary
    # Fan-outs and wake-ups start only into slots they reserved: none of them finds the fleet full
    # (ticks may: nothing reserves a slot for them).
    without_slot = result["invocations_without_slot"]
    assert without_slot.get("fanout", 0) == 0 and without_slot.get("wake", 0) == 0, summary


def test_the_invoke_api_throttles_sync_calls_and_queues_events(tmp_path: Path) -> None:
    import boto3

    config, _ = function_for(Scenario(cap=1, worker_timeout_s=10))
    emulator = Emulator().start()
    # No store: a scheduled tick on an empty SQLite store lists no queue and returns at once.
    env = function_environment(config, emulator.endpoint, {
        "RDQ_STORAGE_URL": f"sqlite:///{tmp_path}/rdq.db", "RDQ_AUTO_MIGRATE": "true"})
    fleet = emulator.add(Fleet(config, env, tmp_path, account_concurrency=1))
    # rdq's client settings: one attempt, so the 429 is seen and not retried by botocore.
    client = boto3.client("lambda", endpoint_url=emulator.endpoint, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x", config=client_config(read_timeout=30))
    try:
        tick = json.dumps({"source": "aws.events", "detail-type": "Scheduled Event"}).encode()
        answer = client.invoke(FunctionName=config.name, Payload=tick)
        assert answer["StatusCode"] == 200 and "FunctionError" not in answer
        assert json.loads(answer["Payload"].read())["claimed"] == 0

        # Hold the only slot with a synchronous call that waits, then knock: 429.
        hold = threading.Event()
        original = fleet._run

        def slow_run(event: object, cause: str, kind: str):  # type: ignore[no-untyped-def]
            hold.wait(5)
            return original(event, cause, kind)

        fleet._run = slow_run  # type: ignore[method-assign]
        holder = threading.Thread(target=client.invoke, kwargs={"FunctionName": config.name, "Payload": tick})
        holder.start()
        while fleet.peak_busy < 1 or fleet.idle():
            threading.Event().wait(0.01)
        with pytest.raises(client.exceptions.TooManyRequestsException):
            client.invoke(FunctionName=config.name, Payload=tick)
        assert client.invoke(FunctionName=config.name, InvocationType="Event", Payload=tick)["StatusCode"] == 202
        hold.set()
        holder.join(10)
        fleet._run = original  # type: ignore[method-assign]
        deadline = threading.Event()
        for _ in range(100):
            if fleet.idle():
                break
            deadline.wait(0.1)
        assert fleet.idle()
        assert fleet.throttled_sync["tick"] == 1
        assert fleet.events_accepted["tick"] == 1
        assert sum(1 for i in fleet.invocations if i.outcome == "ok") == 3
        assert sum(1 for i in fleet.invocations if i.cold) == 1, "one environment, reused warm"
    finally:
        fleet.close()
        emulator.stop()
