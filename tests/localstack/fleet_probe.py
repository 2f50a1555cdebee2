"""What the fleet test (``test_e2e.py``) reads of a deployed worker fleet: its cap and slot
fleet as the stack configured them, its EventBridge tick paused for a while, the worker slots
the store counts as held (sampled on a thread of its own), and how many tasks ran at once.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Iterator

from rdq_core import Client, open_storage
from rdq_core.model import Task, TaskStatus
from rdq_core.storage.slots import SLOT_KIND, fleet_prefix
from rdq_testing.slot_watch import SlotWatch

from .conftest import Stack, aws, wait_for

__all__ = ["SlotWatch", "describe_stall", "fleet_of", "paused_worker_tick", "peak_overlap", "run_interval", "slot_numbers"]


@dataclass(frozen=True)
class Fleet:
    """The worker fleet of a deployed stack, read from its worker function's environment."""

    name: str
    cap: int


def fleet_of(stack: Stack) -> Fleet:
    variables = stack.lambda_client().get_function_configuration(FunctionName=stack.worker)["Environment"]["Variables"]
    # The worker's own rule (Settings.from_env): RDQ_WORKER_FLEET, else the worker function's name.
    name = variables.get("RDQ_WORKER_FLEET", "").strip() or variables["RDQ_WORKER_FUNCTION"]
    return Fleet(name=name, cap=int(variables["RDQ_MAX_WORKER_CONCURRENCY"]))


@contextmanager
def paused_worker_tick(stack: Stack) -> Iterator[Fleet]:
    """The worker's schedule rule disabled, and every slot of the fleet free, for the block: only
    what the block starts then runs workers. LocalStack 2.3.2 applies ``DisableRule`` to its
    scheduler but not ``EnableRule``; a ``PutRule`` with the same schedule schedules it again."""
    events = aws(stack.localstack, "events")
    resources = aws(stack.localstack, "cloudformation").describe_stack_resources(StackName=stack.name)["StackResources"]
    (physical,) = [r["PhysicalResourceId"] for r in resources
                   if r["ResourceType"] == "AWS::Events::Rule" and r["LogicalResourceId"].startswith("WorkerFunction")]
    rule = events.describe_rule(Name=physical.split("/")[-1])
    events.disable_rule(Name=rule["Name"])
    try:
        fleet = fleet_of(stack)
        # A tick already under way finishes first: its slot would count against the cap.
        storage = open_storage(stack.store_url)
        try:
            wait_for("the fleet's slots to be free", lambda: storage.worker_slots_held(fleet.name) == 0, 90)
        finally:
            storage.close()
        yield fleet
    finally:
        events.put_rule(Name=rule["Name"], ScheduleExpression=rule["ScheduleExpression"], State="ENABLED")


def slot_numbers(store_url: str, fleet: str) -> list[int]:
    """The numbers of every slot document the fleet ever wrote (free, held or reserved for a
    start); the fleet's plan document (``<fleet>:plan``, where starts are decided) is not a slot."""
    prefix = fleet_prefix(fleet)
    storage = open_storage(store_url)
    try:
        # ``after=prefix`` sorts just before the fleet's first slot key.
        documents = storage.list_documents(SLOT_KIND, limit=1000, after=prefix)
    finally:
        storage.close()
    return [int(d.key[len(prefix):]) for d in documents
            if d.key.startswith(prefix) and d.key[len(prefix):].isdigit()]


def run_interval(task: Task) -> tuple[datetime, datetime]:
    """When a ``sleep`` task's single attempt ran its handler, by the store's clock: its start,
    plus the seconds it slept. (Its ``finished_at`` is its settlement, which an invocation may
    write after it has started its next task, so it would count one invocation twice.)"""
    assert task.status is TaskStatus.SUCCEEDED and len(task.attempts) == 1, task
    started = task.attempts[0].started_at
    assert started is not None, task
    return started, started + timedelta(seconds=float(task.result["slept_seconds"]))


def peak_overlap(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant; one that ends as another starts does not overlap it."""
    spans = list(intervals)
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:  # at equal times the end (-1) sorts first
        running += step
        peak = max(peak, running)
    return peak


#: What ``describe_stall`` keeps of each source, so a failure message stays readable.
STALL_LINES, STALL_LINE_CHARS = 40, 400
_WORKER_LOG_MARKS = ("worker invocation", "fanning out", "ERROR", "Traceback", "timed out", "Error")
_LOCALSTACK_LOG_MARKS = ("Error executing Lambda", "did not exit", "TimeoutError", "lambda.Invoke", "ERROR")


def describe_stall(stack: Stack, fleet: Fleet, task_ids: list[str], since: float) -> str:
    """What a fleet test that timed out can still see: its tasks' states, the fleet's slots, the
    worker function's log lines since ``since`` (``time.time()``; LocalStack keeps them in
    CloudWatch Logs once an invocation ends, so a hung one shows none) and LocalStack's own
    errors. Each part is best-effort: the explanation must not fail in its turn."""
    parts: list[str] = []
    try:
        with Client(stack.store_url) as client:
            tasks = [client.get(task_id) for task_id in task_ids]
            counts: dict[str, int] = {}
            for task in tasks:
                counts[task.status.value] = counts.get(task.status.value, 0) + 1
            parts.append(f"tasks: {counts}")
            parts += [f"  {t.id} {t.status.value} claimed_by={t.claimed_by!r} attempts="
                      f"{[(a.attempt_no, a.outcome.value, a.error) for a in t.attempts]}"
                      for t in tasks if t.status is not TaskStatus.SUCCEEDED][:STALL_LINES]
            parts.append(f"slots held (pending starts included): {client.storage.worker_slots_held(fleet.name)}, "
                         f"pending: {client.storage.worker_starts_pending(fleet.name)}")
    except Exception as exc:  # noqa: BLE001 - see the docstring
        parts.append(f"(the store could not be read: {exc!r})")
    try:
        events = aws(stack.localstack, "logs").filter_log_events(
            logGroupName=f"/aws/lambda/{stack.worker}", startTime=int(since * 1000))["events"]
        lines = [line for e in events for line in str(e["message"]).splitlines()
                 if any(mark in line for mark in _WORKER_LOG_MARKS)]
        parts.append(f"worker log ({len(events)} events since the test began):")
        parts += [f"  {_log_gist(line)[:STALL_LINE_CHARS]}" for line in lines[-STALL_LINES:]]
    except Exception as exc:  # noqa: BLE001 - see the docstring
        parts.append(f"(the worker's log could not be read: {exc!r})")
    lines = [line for line in stack.localstack.tail(500_000).splitlines()
             if any(mark in line for mark in _LOCALSTACK_LOG_MARKS)]
    parts.append("LocalStack's log:")
    parts += [f"  {line[:STALL_LINE_CHARS]}" for line in lines[-STALL_LINES:]]
    return "\n".join(parts)


def _log_gist(line: str) -> str:
    """A Powertools JSON log line cut down to what says what happened (its Lambda context fields
    would fill the line); any other line as it is."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict):
        return line
    kept = {k: record[k] for k in ("timestamp", "level", "message", "summary", "error", "exception") if k in record}
    return json.dumps(kept, default=str)
