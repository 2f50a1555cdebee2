"""One client interface: what ``Client`` (on a store) and ``HttpClient`` (over the API) both are.

Code that works with either, the CLI for one, types its client as ``QueueClient``. mypy checks
both classes against it (an assignment at the bottom of each client's module), and
``tests/unit/test_client_protocol.py`` checks that their signatures match it parameter for
parameter, so neither side can grow a method or an argument the other lacks without a test
saying so.

Enqueue options are grouped into named ``TypedDict``s (``FlowOptions``, ``DedupeOptions``,
``TaskOptions``, defined with the task's fields in ``new_tasks``) and taken as
``**options: Unpack[EnqueueOptions]``: the keywords callers already use keep working, each group
is spelled once, and an unknown keyword is refused as Python would refuse it
(``check_enqueue_options``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol, Self, Sequence, Unpack

from .model import AuditPage, DeadPage, EnqueueResult, NewTask, QueueStats, Task, TaskPage, TaskStatus
from .engine.new_tasks import (  # re-exported: the grouped enqueue options are part of this interface
    ENQUEUE_OPTION_NAMES as ENQUEUE_OPTION_NAMES, DedupeOptions as DedupeOptions, EnqueueOptions as EnqueueOptions,
    FlowOptions as FlowOptions, TaskOptions as TaskOptions, check_enqueue_options as check_enqueue_options,
)
from .engine.operations import Operation


class QueueClient(Protocol):
    """Producing, reading and operating a queue, on a store or over the API."""

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    # -- producing -------------------------------------------------------------------------
    def enqueue(self, queue: str, handler: str, payload: Any = None, *, connection: Any = None,
                traceparent: str | None = None, tracestate: str | None = None,
                **options: Unpack[EnqueueOptions]) -> Task: ...

    def enqueue_many(self, queue: str, items: Sequence[Mapping[str, Any]], *, connection: Any = None,
                     traceparent: str | None = None, tracestate: str | None = None) -> list[EnqueueResult]: ...

    def enqueue_new(self, new_task: NewTask, *, connection: Any = None) -> EnqueueResult: ...

    def enqueue_new_many(self, new_tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]: ...

    def enqueue_item(self, queue: str, item: Mapping[str, Any], *, connection: Any = None) -> EnqueueResult: ...

    # -- reading ---------------------------------------------------------------------------
    def get(self, task_id: str, *, resolve: bool = False) -> Task: ...

    def stats(self, queue: str) -> QueueStats: ...

    def list_queues(self) -> list[QueueStats]: ...

    def list_tasks(self, queue: str, *, status: TaskStatus | str | None = None, handler: str | None = None,
                   error_type: str | None = None, limit: int = 50, cursor: str | None = None) -> TaskPage: ...

    def list_dead(self, queue: str, *, limit: int = 50, cursor: str | None = None, error_type: str | None = None,
                  handler: str | None = None) -> DeadPage: ...

    def list_audit(self, *, queue: str | None = None, limit: int = 50, cursor: str | None = None) -> AuditPage: ...

    # -- operating -------------------------------------------------------------------------
    def cancel(self, task_id: str) -> Task: ...

    def redrive(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                handler: str | None = None, all: bool = False, dry_run: bool = False) -> int: ...

    def purge_dead(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                   handler: str | None = None, all: bool = False, dry_run: bool = False) -> int: ...

    def cancel_selected(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                        handler: str | None = None, all: bool = False, dry_run: bool = False) -> int: ...

    def pause(self, queue: str) -> QueueStats: ...

    def resume(self, queue: str) -> QueueStats: ...

    # -- bulk operations as jobs -------------------------------------------------------------
    def start_operation(self, action: str, queue: str, *, ids: Iterable[str] | None = None,
                        error_type: str | None = None, handler: str | None = None, all: bool = False,
                        rate_per_second: float | None = None) -> Operation: ...

    def get_operation(self, operation_id: str) -> Operation: ...

    def list_operations(self, *, queue: str | None = None, limit: int = 50) -> list[Operation]: ...

    def cancel_operation(self, operation_id: str) -> Operation: ...

    def wait_for_operation(self, operation_id: str, *, timeout: float = 3600.0, poll: float = 1.0) -> Operation: ...

    # -- schedules -------------------------------------------------------------------------
    def put_schedule(self, definition: Any) -> Any: ...

    def list_schedules(self) -> list[Any]: ...

    def delete_schedule(self, name: str) -> None: ...
