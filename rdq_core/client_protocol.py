"""One client interface: what ``Client`` (on a store) and ``HttpClient`` (over the API) both are.

Code that works with either, the CLI for one, types its client as ``QueueClient``. mypy checks
both classes against it (the assignments at the bottom), and ``tests/unit/test_client_protocol.py``
checks that their signatures match it parameter for parameter, so neither side can grow a method
or an argument the other lacks without a test saying so.

Enqueue options are grouped into named ``TypedDict``s (``FlowOptions``, ``DedupeOptions``,
``TaskOptions``) and taken as ``**options: Unpack[EnqueueOptions]``: the keywords callers already
use keep working, each group is spelled once, and an unknown keyword is refused as Python would
refuse it (``check_enqueue_options``).
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Self, Sequence, TypedDict, Unpack

from .model import AuditPage, Backoff, DeadPage, EnqueueResult, NewTask, QueueStats, Task, TaskPage, TaskStatus
from .operations import Operation


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


if TYPE_CHECKING:  # mypy proves both clients are QueueClients; nothing runs here
    from .client import Client
    from .http_client import HttpClient

    def _store_client_conforms(client: Client) -> QueueClient:
        return client

    def _api_client_conforms(client: HttpClient) -> QueueClient:
        return client
