"""Building a task to enqueue: every field validated (``InvalidInput``) before anything is written.

The one place a ``NewTask`` is made, for every producer: ``Client``, the API's routes, and a
handler's own transaction (``tx.enqueue``), which is why it sits below all of them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, Sequence, TypedDict

from .. import validation
from ..errors import InvalidInput, TaskConflict
from ..ids import new_task_id
from ..model import Backoff, EnqueueResult, NewTask


def build_new_tasks(queue: str, items: Sequence[Mapping[str, Any]]) -> list[NewTask]:
    validation.queue_name(queue)  # the batch's queue is refused as "queue", not as every item's
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise InvalidInput("tasks must be a list", "tasks")
    if not 1 <= len(items) <= validation.Limits.batch_items:
        raise InvalidInput(f"a batch holds 1..{validation.Limits.batch_items} tasks", "tasks")
    new_tasks = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidInput(f"tasks[{index}] must be an object", f"tasks[{index}]")
        try:
            new_task = build_new_task(queue, item)
        except InvalidInput as exc:
            raise InvalidInput(f"tasks[{index}]: {exc}", f"tasks[{index}].{exc.field}") from None
        if new_task.id in seen:
            raise InvalidInput(f"tasks[{index}]: id {new_task.id!r} appears twice in the batch", f"tasks[{index}].id")
        seen.add(new_task.id)
        new_tasks.append(new_task)
    return new_tasks


#: The enqueue fields of flow control (docs/flow-control.md), besides the classic ones.
FLOW_FIELDS = ("priority", "concurrency_key", "rate_key", "group", "dedupe_key", "dedupe_for_seconds",
               "dedupe_states", "dedupe_mode", "dedupe_max_wait_seconds")
TASK_FIELDS = {"handler", "payload", "id", "delay_seconds", "run_at", "max_attempts", "backoff", "headers",
                *FLOW_FIELDS}


def build_new_task(queue: str, item: Mapping[str, Any]) -> NewTask:
    """Validate one enqueue request into a NewTask (the only way one is built)."""
    unknown = set(item) - TASK_FIELDS
    if unknown:
        raise InvalidInput(f"unknown fields: {', '.join(sorted(map(str, unknown)))}", sorted(map(str, unknown))[0])
    if item.get("delay_seconds") is not None and item.get("run_at") is not None:
        raise InvalidInput("give delay_seconds or run_at, not both", "run_at")
    task_id = item.get("id")
    return NewTask(
        id=validation.task_id(task_id) if task_id is not None else new_task_id(),
        queue=validation.queue_name(queue),
        handler=validation.handler_name(item.get("handler")),
        payload=validation.json_value(item.get("payload"), validation.Limits.payload_bytes, "payload"),
        headers=validation.headers(item.get("headers")),
        max_attempts=validation.max_attempts(item.get("max_attempts")),
        backoff=validation.backoff(item.get("backoff")),
        delay_seconds=validation.delay_seconds(item.get("delay_seconds")),
        run_at=validation.run_at(item.get("run_at")),
        priority=validation.priority(item.get("priority")),
        concurrency_key=validation.flow_key(item.get("concurrency_key"), "concurrency_key"),
        rate_key=validation.flow_key(item.get("rate_key"), "rate_key"),
        group=validation.flow_key(item.get("group"), "group"),
        dedupe_key=validation.flow_key(item.get("dedupe_key"), "dedupe_key"),
        dedupe_for_seconds=validation.optional_seconds(item.get("dedupe_for_seconds"), "dedupe_for_seconds"),
        dedupe_states=validation.dedupe_states(item.get("dedupe_states")),
        dedupe_mode=validation.dedupe_mode(item.get("dedupe_mode")),
        dedupe_max_wait_seconds=validation.optional_seconds(item.get("dedupe_max_wait_seconds"),
                                                            "dedupe_max_wait_seconds"),
    )


def written_or_conflict(new_task: NewTask, result: EnqueueResult) -> EnqueueResult:
    """``result`` of writing ``new_task`` alone; ``TaskConflict`` if its id is taken on another
    queue. The message names neither that queue nor the task's state: over HTTP a caller allowed
    on one queue reads it (docs/security.md)."""
    if result.conflict:
        raise TaskConflict(f"task id {new_task.id!r} already exists on another queue")
    return result

class FlowOptions(TypedDict, total=False):
    """Flow control of one task (docs/flow-control.md)."""

    priority: int | None
    concurrency_key: str | None
    rate_key: str | None
    group: str | None


class DedupeOptions(TypedDict, total=False):
    """Enqueue-time dedupe (docs/flow-control.md, "Dedupe")."""

    dedupe_key: str | None
    dedupe_for_seconds: float | None
    dedupe_states: Sequence[str] | None
    dedupe_mode: str | None
    dedupe_max_wait_seconds: float | None


class TaskOptions(TypedDict, total=False):
    """The task's own fields besides its handler and payload."""

    id: str | None
    delay_seconds: float | None
    run_at: datetime | str | None
    max_attempts: int | None
    backoff: Backoff | Mapping[str, float] | None
    headers: Mapping[str, str] | None


class EnqueueOptions(TaskOptions, FlowOptions, DedupeOptions, total=False):
    """Every keyword ``enqueue`` takes after ``queue``, ``handler`` and ``payload``, besides how the
    call is made (``connection``, ``traceparent``, ``tracestate``)."""


#: The names ``EnqueueOptions`` allows, in the order the groups declare them.
ENQUEUE_OPTION_NAMES: tuple[str, ...] = tuple(EnqueueOptions.__annotations__)


def check_enqueue_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as task fields; ``TypeError`` for a keyword ``enqueue`` does not take, as a
    misspelt keyword argument is refused by Python itself."""
    for name in options:
        if name not in EnqueueOptions.__annotations__:
            raise TypeError(f"enqueue() got an unexpected keyword argument {name!r}")
    return dict(options)
