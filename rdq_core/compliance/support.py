"""Helpers the kit's tests share: waiting on conditions, building tasks and settlements, dead-lettering."""

from __future__ import annotations

import multiprocessing
import time
from datetime import datetime
from typing import Any, Callable, Mapping, TypedDict, Unpack

# Waiting and insisting are test support beyond the kit too; the kit's tests reach them here.
from rdq_testing.conditions import present as present, wait_until as wait_until

from ..ids import new_task_id
from ..model import Attempt, Backoff, ClaimedTask, ErrorInfo, NewTask, Outcome, Settlement, Task, TaskStatus
from ..storage.spi import Storage

#: The ``open_another`` fixture: each call opens one more connection to the test's store.
OpenStore = Callable[[], Storage]

FAST_BACKOFF = Backoff(initial_seconds=0.05, factor=2.0, max_seconds=0.2, jitter=0.0)


def error_of(attempt: Attempt) -> ErrorInfo:
    """The error ``attempt`` recorded, or a test failure when it recorded none."""
    return present(attempt.error, f"an error on attempt {attempt.attempt_no}")


def must_get(storage: Storage, task_id: str) -> Task:
    """The stored task, or a test failure saying it is missing (``Storage.get`` returns None)."""
    task = storage.get(task_id)
    if task is None:
        raise AssertionError(f"task {task_id!r} is missing from the store")
    return task


def due_at(storage: Storage, task_id: str) -> datetime:
    """When the stored task is next due; a test failure when it is missing or has no due time."""
    return present(must_get(storage, task_id).next_attempt_at, f"a next_attempt_at on {task_id!r}")


class TaskFields(TypedDict, total=False):
    """The optional parts of an enqueue request a test may set."""

    headers: Mapping[str, str]
    max_attempts: int | None
    backoff: Backoff | None
    delay_seconds: float
    run_at: datetime | None


class BatchFields(TaskFields, total=False):
    """As above, plus the handler every task of the batch names."""

    handler: str


def new_task(queue: str, handler: str = "noop", payload: object = None, *, id: str | None = None,
             **fields: Unpack[TaskFields]) -> NewTask:
    return NewTask(id=id or new_task_id(), queue=queue, handler=handler, payload=payload, **fields)


def enqueue_n(storage: Storage, queue: str, n: int, **fields: Unpack[BatchFields]) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, 500):
        batch = [new_task(queue, payload={"n": i}, **fields) for i in range(start, min(n, start + 500))]
        storage.enqueue(batch)
        ids += [t.id for t in batch]
    return ids


def dead_letter(storage: Storage, queue: str, n: int, *, handler: str = "noop", error_type: str = "boom.Error") -> list[str]:
    """Put ``n`` fresh tasks into the DLQ the way a worker would: claim, fail permanently."""
    ids = enqueue_n(storage, queue, n, handler=handler, max_attempts=1)
    wanted = set(ids)
    settled = 0
    deadline = time.monotonic() + 30
    while settled < n and time.monotonic() < deadline:
        claimed = [c for c in storage.claim(queue, 100, 30) if c.task.id in wanted]
        storage.settle([
            Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                       error=ErrorInfo(error_type, "failed on purpose"))
            for c in claimed
        ])
        settled += len(claimed)
    assert settled == n, f"could dead-letter only {settled} of {n} tasks"
    return ids


#: A claim token no store ever issued.
NEVER_ISSUED = "never-issued-token"


def success(claimed: ClaimedTask, result: object = None) -> Settlement:
    return Settlement(claimed.task.id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)


def retry(claimed: ClaimedTask, delay: float = 0.0) -> Settlement:
    return Settlement(
        claimed.task.id, claimed.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
        retry_delay_seconds=delay, error=ErrorInfo("test.Retry", "try again"),
    )


def fail_permanently(claimed: ClaimedTask, error_type: str = "boom.Error") -> Settlement:
    return Settlement(claimed.task.id, claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                      error=ErrorInfo(error_type, "failed on purpose"))


def state(task: Task) -> tuple[object, ...]:
    """The parts of a task a refused write must not change."""
    return (task.status, task.attempt_count, task.lease_expires_at, task.next_attempt_at, len(task.attempts), task.result)


def race_processes(target: Callable[..., None], count: int, args: Callable[[Any, Any], tuple[Any, ...]],
                   timeout: float) -> list[Any]:
    """Start ``count`` spawned processes of ``target(*args(barrier, answers))``, which meet at the
    barrier and each put one answer on ``answers``; return the answers (in arrival order)."""
    context = multiprocessing.get_context("spawn")  # never fork a process holding store connections
    barrier, answers = context.Barrier(count), context.Queue()
    processes = [context.Process(target=target, args=args(barrier, answers)) for _ in range(count)]
    for process in processes:
        process.start()
    try:
        return [answers.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(10)
