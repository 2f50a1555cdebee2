"""Producing and reading tasks: ``enqueue``, ``stats``, ``queues``, ``tasks`` and ``task``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Callable, Sequence

from ...engine import tracecontext
from ...client import Client
from ...engine.new_tasks import FLOW_FIELDS
from ...client_protocol import QueueClient
from ...errors import InvalidInput, TaskConflict, TaskNotFound
from ...model import TaskStatus
from ...storage import redact_url as _redact
from .common import EXIT_CONFLICT, EXIT_NOT_FOUND, NotFound, client_for, positive_float, read_payload
from .output import print_json, print_table, print_task, say


def configure(commands: Any) -> None:
    queues = commands.add_parser("queues", help="every queue that holds a task, with its counts")
    queues.add_argument("--json", action="store_true")

    enqueue = commands.add_parser("enqueue", help="enqueue one task")
    enqueue.add_argument("queue")
    enqueue.add_argument("handler")
    enqueue.add_argument("--payload", default="null",
                         help="JSON payload (default null); @FILE reads it from a file, - from standard input")
    enqueue.add_argument("--id")
    enqueue.add_argument("--delay", type=float, help="seconds before the task is due")
    enqueue.add_argument("--max-attempts", type=int)
    # Flow control (docs/flow-control.md); the engine validates the values like the API does.
    enqueue.add_argument("--priority", type=int, help="0..9, lower runs first (default 0)")
    enqueue.add_argument("--concurrency-key", help="tasks sharing it count against the queue's concurrency_limit")
    enqueue.add_argument("--rate-key", help="tasks sharing it count against the queue's rate_limit")
    enqueue.add_argument("--group", help="tenant for a queue with fair_groups")
    enqueue.add_argument("--dedupe-key", help="no second task while one with this key matches")
    enqueue.add_argument("--dedupe-for-seconds", type=float)
    enqueue.add_argument("--dedupe-states", type=lambda text: text.split(","),
                         help="comma-separated statuses a matching task may be in (default PENDING,IN_FLIGHT)")
    enqueue.add_argument("--dedupe-mode", choices=["skip", "replace", "debounce"])
    enqueue.add_argument("--dedupe-max-wait-seconds", type=float)
    enqueue.add_argument("--json", action="store_true")
    enqueue.add_argument("--traceparent", help="W3C trace context the task continues (default: $TRACEPARENT)")
    enqueue.add_argument("--tracestate", help="W3C tracestate with it (default: $TRACESTATE)")

    stats = commands.add_parser("stats", help="queue depth and age")
    stats.add_argument("queue")
    stats.add_argument("--json", action="store_true")

    tasks = commands.add_parser("tasks", help="a queue's tasks by status, a page at a time")
    tasks.add_argument("queue")
    tasks.add_argument("--status", choices=[s.value for s in TaskStatus],
                       help="one status (default: every status, PENDING first)")
    tasks.add_argument("--handler", dest="filter_handler")
    tasks.add_argument("--error-type", help="the type of the task's last error, in full")
    tasks.add_argument("--limit", type=int, default=50)
    tasks.add_argument("--cursor", help="the next page: the cursor the previous page printed")
    tasks.add_argument("--json", action="store_true")

    task = commands.add_parser("task", help="inspect or cancel one task").add_subparsers(dest="task_command", required=True)
    show = task.add_parser("show", help="a task with its attempt history")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    show.add_argument("--wait", nargs="?", const="FINISHED", metavar="STATUS",
                      help="first wait until the task is STATUS (PENDING, IN_FLIGHT, SUCCEEDED, DEAD, CANCELLED), "
                           "or without STATUS until it is SUCCEEDED, DEAD or CANCELLED")
    show.add_argument("--timeout", type=positive_float, default=120.0, help="seconds --wait waits at most (default 120)")
    cancel = task.add_parser("cancel", help="cancel PENDING tasks")
    cancel.add_argument("ids", nargs="+", metavar="ID")
    cancel.add_argument("--json", action="store_true")


def cmd_enqueue(args: argparse.Namespace, url: str) -> int:
    payload = read_payload(args.payload)
    item = {"handler": args.handler, "payload": payload, "id": args.id, "delay_seconds": args.delay,
            "max_attempts": args.max_attempts, **{name: getattr(args, name) for name in FLOW_FIELDS}}
    with client_for(args, url) as client, _trace_context(args):
        result = client.enqueue_item(args.queue, item)  # a payload over the threshold goes to the payload store
    task = result.task
    if args.json:
        print_json({**task.to_dict(), "created": result.created, "deduplicated": result.deduplicated})
    elif result.deduplicated:
        say(f"{task.id} matched dedupe key {task.dedupe_key} ({task.status.value}); nothing was enqueued")
    elif result.created:
        say(f"{task.id} {task.status.value} queue={task.queue} handler={task.handler}")
    else:
        say(f"{task.id} already existed ({task.status.value}, handler {task.handler}); nothing was enqueued")
    return 0


def _trace_context(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """``rdq enqueue``'s trace context: ``--traceparent``, else ``$TRACEPARENT`` (the variables
    OpenTelemetry names for passing a trace to a process); an invalid one is dropped, with a note."""
    traceparent = args.traceparent if args.traceparent is not None else os.environ.get("TRACEPARENT")
    tracestate = args.tracestate if args.tracestate is not None else os.environ.get("TRACESTATE")
    if not traceparent:
        return contextlib.nullcontext()
    if tracecontext.parse_traceparent(traceparent) is None:
        say("rdq: note: the traceparent is not a valid W3C traceparent; the task is enqueued without it", file=sys.stderr)
    return tracecontext.use(traceparent, tracestate)


def cmd_stats(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        stats = client.stats(args.queue)
        if not any((stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled)) \
                and isinstance(client, Client) and args.queue not in client.storage.list_queues():
            raise NotFound(f"queue {args.queue!r} holds no tasks (never used, or everything in it was "
                                 f"deleted) in {_redact(url)}")
    if args.json:
        print_json(stats.to_dict())
    else:
        for key, value in stats.to_dict().items():
            say(f"{key:<28} {value}")
    return 0


def cmd_queues(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        listed = client.list_queues()
    if args.json:
        print_json({"queues": [stats.to_dict() for stats in listed]})
        return 0
    if not listed:
        say("no queue holds a task or is paused")
    for stats in listed:
        say(f"{stats.queue:<30} pending={stats.pending} in_flight={stats.in_flight} dead={stats.dead} "
             f"succeeded={stats.succeeded} cancelled={stats.cancelled} "
             f"oldest_pending_age_seconds={stats.oldest_pending_age_seconds:g}{' PAUSED' if stats.paused else ''}")
    return 0


def cmd_tasks(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        page = client.list_tasks(args.queue, status=args.status, handler=args.filter_handler, error_type=args.error_type,
                                 limit=args.limit, cursor=args.cursor)
    if args.json:
        print_json(page.to_dict())
        return 0
    print_table(("ID", "STATUS", "HANDLER", "ATTEMPTS", "LAST ERROR", "UPDATED AT"), [
        (t.id, t.status.value, t.handler, str(t.attempt_count), t.last_error.type if t.last_error else "-",
         t.updated_at.isoformat() if t.updated_at else "-")
        for t in page.tasks], empty="no tasks")
    if page.next_cursor:
        say(f"more: --cursor {page.next_cursor}")
    return 0


def cmd_task(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        if args.task_command == "show":
            task = _wait_for(client, args.id, args.wait, args.timeout) if args.wait else client.get(args.id)
            print_task(task, args.json)
            return 0
        return _cancel_many(client, args.ids, args.json)


_FINISHED: tuple[TaskStatus, ...] = (TaskStatus.SUCCEEDED, TaskStatus.DEAD, TaskStatus.CANCELLED)


def _wait_for(client: QueueClient, task_id: str, wanted: str, timeout: float) -> Any:
    if wanted == "FINISHED":
        statuses, described = _FINISHED, "SUCCEEDED, DEAD or CANCELLED"
    else:
        try:
            statuses = (TaskStatus(wanted.upper()),)
        except ValueError:
            raise InvalidInput(f"--wait takes one of {', '.join(s.value for s in TaskStatus)}", "--wait") from None
        described = statuses[0].value
    task = client.get(task_id)
    if task.status not in statuses:
        say(f"waiting up to {timeout:g}s for task {task_id} to be {described} (now {task.status.value}) ...",
             file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    while task.status not in statuses:
        if time.monotonic() > deadline:
            raise TaskConflict(f"task {task_id!r} is still {task.status.value} after {timeout:g}s, not {described}")
        if wanted != "FINISHED" and task.status in _FINISHED:
            raise TaskConflict(f"task {task_id!r} ended {task.status.value}; it will not become {described}")
        time.sleep(0.2)
        task = client.get(task_id)
    return task


def _cancel_many(client: QueueClient, ids: Sequence[str], as_json: bool) -> int:
    """Cancel each id; the others are still cancelled when one cannot be. Exit code: the worst
    problem met (3 not found, 4 not PENDING), 0 when all were cancelled."""
    results: list[dict[str, Any]] = []
    code = 0
    for task_id in dict.fromkeys(ids):
        try:
            task = client.cancel(task_id)
            results.append({"id": task_id, "result": "cancelled", "task": task.to_dict()})
            if not as_json:
                say(f"{task_id} CANCELLED")
        except TaskNotFound as exc:
            code = max(code, EXIT_NOT_FOUND)
            results.append({"id": task_id, "result": "not_found", "error": str(exc)})
            say(f"rdq: error: {exc}", file=sys.stderr)
        except TaskConflict as exc:
            code = max(code, EXIT_CONFLICT)
            results.append({"id": task_id, "result": "conflict", "error": str(exc)})
            say(f"rdq: error: {exc}", file=sys.stderr)
    if as_json:
        print_json(results[0]["task"] if len(ids) == 1 and code == 0 else {"results": results})
    return code


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "enqueue": cmd_enqueue, "stats": cmd_stats, "queues": cmd_queues, "tasks": cmd_tasks, "task": cmd_task,
}
