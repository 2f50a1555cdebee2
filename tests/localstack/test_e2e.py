"""rdq deployed from the real template.yaml into LocalStack, driven through its API Gateway, on
PostgreSQL and on Redis: auth, the wake-up, the schedule, manual worker and reaper invocations,
dead letters, redrive, stats, OpenAPI and problems.

Run: ``python -m pytest -m localstack tests/localstack`` (the first run creates LocalStack's
virtualenv in ~/.cache/rdq-localstack-2.3.2)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core import Client, open_storage
from rdq_testing import servers

from . import fleet_probe
from .conftest import Stack, deploy, sam_build, wait_for

pytestmark = [pytest.mark.localstack, pytest.mark.timeout(1500)]

#: A worker tick is rate(1 minute): one tick plus LocalStack's scheduling slack.
TICK_SECONDS = 150


@pytest.fixture(scope="module", params=["postgresql", "redis"])
def stack(request: pytest.FixtureRequest, localstack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    backend = request.param
    build_dir = sam_build(tmp_path_factory.mktemp(f"build-{backend}") / "build", backend)
    if backend == "postgresql":
        with servers.pg_scratch_database(servers.SHARED_PG_URL, prefix="rdq_localstack_") as url:
            yield _deployed(localstack, backend, url, build_dir)
    else:
        with servers.redis_fresh_prefix(servers.SHARED_REDIS_URL, tag="rdq-localstack") as prefix:
            yield _deployed(localstack, backend, servers.redis_url_with_prefix(servers.SHARED_REDIS_URL, prefix), build_dir)


def _deployed(localstack: Any, backend: str, url: str, build_dir: Path) -> Stack:
    storage = open_storage(url)
    try:
        storage.migrate()
    finally:
        storage.close()
    return deploy(localstack, backend, url, build_dir)


def call(stack: Stack, method: str, path: str, body: Any = None, key: bool = True) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(stack.api_base + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("x-api-key", stack.api_key)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, headers, raw = reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = error.code, dict(error.headers), error.read()
    try:
        return status, headers, json.loads(raw) if raw else None
    except ValueError:
        return status, headers, raw.decode(errors="replace")


def enqueue(stack: Stack, queue: str, handler: str, **fields: Any) -> str:
    status, _, task = call(stack, "POST", f"/v1/queues/{queue}/tasks", {"handler": handler, **fields})
    assert status == 201, (status, task)
    return str(task["id"])


def task_in(stack: Stack, task_id: str, *statuses: str) -> dict | None:
    status, _, task = call(stack, "GET", f"/v1/tasks/{task_id}")
    assert status == 200, (status, task)
    return task if task["status"] in statuses else None


def test_no_api_key_is_refused_at_the_gateway(stack: Stack):
    status, _, _ = call(stack, "GET", "/v1/openapi.json", key=False)
    assert status == 403


def test_enqueue_succeeds_through_the_wake_up(stack: Stack):
    task_id = enqueue(stack, "wake", "greet", payload={"name": "Ada"})
    done = wait_for("the woken worker", lambda: task_in(stack, task_id, "SUCCEEDED", "DEAD"), 90)
    assert done["status"] == "SUCCEEDED" and done["result"] == {"greeting": "hello, Ada", "attempt": 1}


def test_the_schedule_tick_runs_work_no_wake_up_named(stack: Stack):
    # Delayed work wakes no one, and a wake-up serves only its own queue: only a scheduled worker
    # (every queue) runs this.
    task_id = enqueue(stack, "tick", "greet", delay_seconds=1)
    wait_for("the worker's EventBridge tick", lambda: task_in(stack, task_id, "SUCCEEDED"), TICK_SECONDS, every=2)


def test_worker_invoked_with_the_scheduled_event_file(stack: Stack):
    with Client(stack.store_url) as client:  # straight on the store: no wake-up
        task_id = client.enqueue("manual", "greet").id
    summary = stack.invoke(stack.worker, "worker-scheduled.json")
    assert "manual" in summary["queues"], summary
    wait_for("the manual worker's settlement", lambda: task_in(stack, task_id, "SUCCEEDED"), 30)


def test_permanent_error_and_exhausted_retries_are_dead_then_listed(stack: Stack):
    rejected = enqueue(stack, "dlq", "reject", payload={"reason": "bad input"})
    flaky = enqueue(stack, "dlq", "flaky", payload={"failures": 5}, max_attempts=2,
                    backoff={"initial_seconds": 0.1, "factor": 1.0, "max_seconds": 0.1, "jitter": 0.0})

    def both_dead() -> bool:
        if task_in(stack, flaky, "PENDING"):
            stack.invoke(stack.worker, "worker-scheduled.json")  # the retry is due: run it now, not at the tick
        return bool(task_in(stack, rejected, "DEAD") and task_in(stack, flaky, "DEAD"))

    wait_for("both tasks dead", both_dead, 120, every=1)
    assert task_in(stack, rejected, "DEAD")["attempts"][0]["outcome"] == "PERMANENT_FAILURE"
    assert len(task_in(stack, flaky, "DEAD")["attempts"]) == 2
    status, _, page = call(stack, "GET", "/v1/queues/dlq/dlq")
    assert status == 200 and {rejected, flaky} <= {t["id"] for t in page["tasks"]}, page


def test_redrive_wakes_a_worker_and_succeeds(stack: Stack):
    task_id = enqueue(stack, "redrive", "fail_until_redrive", max_attempts=1)
    wait_for("the first failure", lambda: task_in(stack, task_id, "DEAD"), 90)
    status, _, answer = call(stack, "POST", "/v1/queues/redrive/dlq:redrive", {"ids": [task_id]})
    assert status == 200, answer
    done = wait_for("the redriven task", lambda: task_in(stack, task_id, "SUCCEEDED"), 90)
    assert done["result"] == {"fixed_after_redrives": 1}


def test_reaper_function_records_an_expired_lease(stack: Stack):
    storage = open_storage(stack.store_url)
    try:
        # A worker that claimed a task and died: enqueued and claimed here, straight on the store
        # (no wake-up), with a lease that is over almost at once.
        with Client(storage) as client:
            task_id = client.enqueue("reap", "greet").id
        claimed = storage.claim("reap", 1, 0.2)
        assert [c.task.id for c in claimed] == [task_id]
        wait_for("the lease to run out", lambda: storage.find_expired_leases(10, "reap"), 10, every=0.1)
    finally:
        storage.close()
    summary = stack.invoke(stack.reaper, "reaper-scheduled.json")
    assert summary["expired"] >= 1, summary
    status, _, task = call(stack, "GET", f"/v1/tasks/{task_id}")
    assert status == 200 and task["attempts"][0]["outcome"] == "LEASE_EXPIRED", task


def test_stats_openapi_and_a_404_problem(stack: Stack):
    status, _, stats = call(stack, "GET", "/v1/queues/wake/stats")
    assert status == 200 and "pending" in json.dumps(stats), stats
    status, _, document = call(stack, "GET", "/v1/openapi.json")
    assert status == 200 and document["openapi"].startswith("3.")
    status, _, problem = call(stack, "GET", "/v1/tasks/no-such-task")
    # (LocalStack 2.3.2 passes on only single-value headers, and Powertools sends Content-Type as a
    # multi-value one: the media type is checked in tests/serverless, the problem body here.)
    assert status == 404 and problem["status"] == 404 and problem["type"].startswith("urn:rdq:problem"), problem


#: The fleet test's handler: ``sleep`` from the deployed examples, long enough that workers overlap.
FANOUT_TASKS, FANOUT_TASK_SECONDS = 16, 1.0
#: Each worker that wins a slot in the surplus round holds it this long (one task each): the
#: surplus invocations all reach the store well within it.
HOLD_SECONDS = 6.0


def test_a_backlog_fans_out_to_the_cap_and_never_beyond(stack: Stack):
    """Issue 28, item 9: a backlog on the deployed stack fans out to MaxWorkerConcurrency
    workers and never beyond, the worker slots in the store deciding.

    The worker's tick is paused, so the test starts every worker. First a backlog enqueued in one
    API call: its single wake-up starts one worker, whose fan-out (Lambda ``Event`` invokes
    through LocalStack) fills the fleet to the cap and no further. Then cap + 2 workers invoked at
    once, with the fan-out event, on a backlog of cap long tasks: exactly cap win a slot and run a
    task each while the surplus return ``{"slot": null}``, having claimed nothing. The
    store is the witness: slots sampled while the fleet runs, the slot documents it wrote, and
    each task's attempt (with one handler per invocation, tasks running at once are invocations
    holding tasks at once)."""
    with fleet_probe.paused_worker_tick(stack) as fleet, \
            fleet_probe.SlotWatch(stack.store_url, fleet.name) as watch, Client(stack.store_url) as client:
        assert fleet.cap >= 2, f"a fan-out needs a cap above 1 (the stack has {fleet.cap})"

        # 1. Through the API: one wake-up, then fan-out. The backlog exceeds a batch (BatchSize,
        #    10 by default), so the woken worker asks for more workers than the cap leaves.
        fan_out_began, began_at = time.monotonic(), time.time()
        status, _, answer = call(stack, "POST", "/v1/queues/fanout/tasks:batch", {"tasks": [
            {"handler": "sleep", "payload": {"seconds": FANOUT_TASK_SECONDS}} for _ in range(FANOUT_TASKS)]})
        assert status == 200 and answer["created"] == FANOUT_TASKS, answer
        ids = [item["id"] for item in answer["results"]]
        drained = wait_for("the fanned-out backlog to drain", lambda: _all_succeeded(client, ids), 60,
                           explain=lambda: fleet_probe.describe_stall(stack, fleet, ids, began_at))
        assert watch.peak(since=fan_out_began) == fleet.cap, "the fan-out did not fill the fleet"
        assert fleet_probe.peak_overlap(map(fleet_probe.run_interval, drained)) == fleet.cap
        wait_for("every slot freed", lambda: client.storage.worker_slots_held(fleet.name) == 0, 30)

        # 2. cap + 2 at once, straight at the function: a fan-out event starts no fan-out of its
        #    own, so only these invocations contend for the slots.
        ids = [client.enqueue("surplus", "sleep", {"seconds": HOLD_SECONDS}).id for _ in range(fleet.cap)]
        event = json.dumps({"source": "rdq.fanout", "detail-type": "rdq.fanout", "detail": {"queues": ["surplus"]}})
        start = threading.Barrier(fleet.cap + 2)
        lam = stack.lambda_client()  # made here: boto3 clients are thread-safe, creating them is not

        def invoke(_: int) -> dict[str, Any]:
            start.wait()
            reply = lam.invoke(FunctionName=stack.worker, InvocationType="RequestResponse", Payload=event.encode())
            body = reply["Payload"].read().decode()
            assert "FunctionError" not in reply, body
            return dict(json.loads(body))

        with ThreadPoolExecutor(fleet.cap + 2) as pool:
            summaries = list(pool.map(invoke, range(fleet.cap + 2)))
        holders = [summary for summary in summaries if summary["slot"] is not None]
        refused = [summary for summary in summaries if summary["slot"] is None]
        assert len(holders) == fleet.cap and len(refused) == 2, summaries
        assert sorted(s["slot"] for s in holders) == list(range(fleet.cap)), holders
        assert sum(s["started"] for s in holders) == fleet.cap, holders
        # The surplus left before looking at any queue. (How fast is not asserted: LocalStack's
        # local executor may wait up to 5 s for a forked invocation's process to exit after it
        # has answered, so an invocation's wall time here says little about the worker.)
        assert all(s["claimed"] == 0 and s["fanned_out"] == 0 and "queues" not in s for s in refused), refused
        held = wait_for("the holders' tasks settled", lambda: _all_succeeded(client, ids), 10,
                        explain=lambda: fleet_probe.describe_stall(stack, fleet, ids, began_at))
        assert fleet_probe.peak_overlap(map(fleet_probe.run_interval, held)) == fleet.cap

        assert watch.peak() <= fleet.cap
    # No worker ever took a slot numbered at or above the cap.
    assert set(fleet_probe.slot_numbers(stack.store_url, fleet.name)) == set(range(fleet.cap))


def _all_succeeded(client: Client, ids: list[str]) -> list[Any] | None:
    tasks = [client.get(task_id) for task_id in ids]
    return tasks if all(t.status.value == "SUCCEEDED" for t in tasks) else None
