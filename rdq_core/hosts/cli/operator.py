"""Operating queues: ``cancel``, ``pause``/``resume``, ``dlq``, ``operations`` and ``audit`` --
the bulk actions count what they match first and ask before what cannot be undone."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

from ...client_protocol import QueueClient
from ...errors import TaskConflict, TaskNotFound
from ...model import TaskStatus
from .common import EXIT_CONFLICT, NotFound, client_for, operation_rate
from .output import ask_to_confirm, hint_full_error_type, print_dead_table, print_json, print_operation, print_table, \
    print_task, say


def configure(commands: Any) -> None:
    cancel_by_filter = commands.add_parser("cancel", help="cancel the PENDING tasks of a queue that match a selection")
    selection_arguments(cancel_by_filter, confirm=True)

    for name, text in (("pause", "stop workers claiming from a queue (enqueues are still accepted)"),
                       ("resume", "let workers claim from a paused queue again")):
        switch = commands.add_parser(name, help=text)
        switch.add_argument("queue")
        switch.add_argument("--json", action="store_true")

    ops = commands.add_parser("operations", help="background bulk operations (redrive, purge, cancel)").add_subparsers(
        dest="operations_command", required=True)
    ops_list = ops.add_parser("list", help="operations, newest first")
    ops_list.add_argument("--queue")
    ops_list.add_argument("--json", action="store_true")
    for name, text in (("show", "one operation's progress"), ("cancel", "stop a running operation")):
        one = ops.add_parser(name, help=text)
        one.add_argument("id")
        one.add_argument("--json", action="store_true")
        if name == "show":
            one.add_argument("--wait", action="store_true", help="first wait until it is finished")

    audit = commands.add_parser("audit", help="operator actions, newest first, with who took them")
    audit.add_argument("--queue")
    audit.add_argument("--limit", type=int, default=50)
    audit.add_argument("--cursor")
    audit.add_argument("--json", action="store_true")

    dlq = commands.add_parser("dlq", help="the dead-letter queue").add_subparsers(dest="dlq_command", required=True)
    listing = dlq.add_parser("list", help="dead tasks, oldest first")
    listing.add_argument("queue")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--cursor")
    listing.add_argument("--error-type")
    listing.add_argument("--handler", dest="filter_handler")
    listing.add_argument("--json", action="store_true")
    dlq_show = dlq.add_parser("show", help="one dead task with its history")
    dlq_show.add_argument("id")
    dlq_show.add_argument("--json", action="store_true")
    for name, text in (("redrive", "send dead tasks back to PENDING with a fresh budget"), ("purge", "delete dead tasks")):
        selection_arguments(dlq.add_parser(name, help=text), confirm=name == "purge")


def selection_arguments(action: argparse.ArgumentParser, *, confirm: bool) -> None:
    action.add_argument("queue")
    action.add_argument("--id", action="append", dest="ids", metavar="ID")
    action.add_argument("--all", action="store_true")
    action.add_argument("--error-type")
    action.add_argument("--handler", dest="filter_handler")
    action.add_argument("--dry-run", action="store_true", help="say how many tasks match, change nothing")
    action.add_argument("--rate", type=operation_rate, metavar="PER_SECOND",
                        help="run as a background operation acting on at most this many tasks a second")
    action.add_argument("--background", action="store_true",
                        help="run as a background operation and return at once (rdq operations show ID follows it)")
    if confirm:
        action.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    action.add_argument("--json", action="store_true")


def cmd_cancel(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        return _bulk_action(client, args, "cancel", "cancelled", "PENDING")


def cmd_pause(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        stats = client.pause(args.queue) if args.command == "pause" else client.resume(args.queue)
    if args.json:
        print_json(stats.to_dict())
    else:
        say(f"{stats.queue} {'paused' if stats.paused else 'running'} (pending={stats.pending} "
             f"in_flight={stats.in_flight})")
    return 0


def cmd_operations(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        if args.operations_command == "list":
            found = client.list_operations(queue=args.queue)
            if args.json:
                print_json({"operations": [op.to_dict() for op in found]})
                return 0
            print_table(("ID", "ACTION", "QUEUE", "STATUS", "DONE", "MATCHED", "RATE", "STARTED AT"), [
                (op.id, op.action, op.queue, op.status, str(op.done), str(op.matched),
                 f"{op.rate_per_second:g}/s" if op.rate_per_second else "-",
                 op.started_at.isoformat() if op.started_at else "-") for op in found], empty="no operations")
            return 0
        if args.operations_command == "cancel":
            operation = client.cancel_operation(args.id)
        else:
            operation = client.get_operation(args.id)
            if args.wait:
                operation = follow_operation(client, operation)
    print_operation(operation, args.json)
    return 0


def follow_operation(client: QueueClient, operation: Any) -> Any:
    """Print progress lines (to standard error) until the operation is finished."""
    last = None
    while not operation.finished:
        if operation.done != last:
            say(f"{operation.id}: {operation.action} {operation.done} of {operation.matched} ...", file=sys.stderr, flush=True)
            last = operation.done
        time.sleep(1.0)
        operation = client.get_operation(operation.id)
    return operation


def cmd_audit(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        page = client.list_audit(queue=args.queue, limit=args.limit, cursor=args.cursor)
    if args.json:
        print_json(page.to_dict())
        return 0
    print_table(("AT", "ACTOR", "ACTION", "QUEUE", "COUNT", "SELECTION"), [
        (e.at.isoformat(), e.actor, e.action, e.queue, str(e.count),
         json.dumps(dict(e.selection), ensure_ascii=False, separators=(",", ":")) if e.selection else "-")
        for e in page.entries], empty="no operator actions recorded")
    if page.next_cursor:
        say(f"more: --cursor {page.next_cursor}")
    return 0


def cmd_dlq(args: argparse.Namespace, url: str) -> int:
    with client_for(args, url) as client:
        if args.dlq_command == "list":
            page = client.list_dead(args.queue, limit=args.limit, cursor=args.cursor,
                                    error_type=args.error_type, handler=args.filter_handler)
            if args.json:
                print_json({"tasks": [t.to_dict() for t in page.tasks], "next_cursor": page.next_cursor})
            else:
                print_dead_table(page.tasks)
                if not page.tasks and args.error_type and "." not in args.error_type:
                    hint_full_error_type(args.error_type)
                if page.next_cursor:
                    say(f"more: --cursor {page.next_cursor}")
            return 0
        if args.dlq_command == "show":
            task = client.get(args.id)
            if task.status is not TaskStatus.DEAD:
                raise TaskConflict(f"task {task.id!r} is {task.status.value}, not DEAD (rdq task show {task.id} shows it)")
            print_task(task, args.json)
            return 0
        return _redrive_or_purge(client, args)


def _redrive_or_purge(client: QueueClient, args: argparse.Namespace) -> int:
    if args.ids:
        _check_dead_ids(client, args.queue, args.ids)
    if args.dlq_command == "redrive":
        return _bulk_action(client, args, "redrive", "redriven", "dead")
    return _bulk_action(client, args, "purge", "purged", "dead", confirm="and their history for good")


def _bulk_action(client: QueueClient, args: argparse.Namespace, verb: str, done_key: str, kind: str,
                 confirm: str = "") -> int:
    """redrive, purge, cancel: count what the selection matches (the API's dry run), then act,
    asking first where the action cannot be undone."""
    act = {"redrive": client.redrive, "purge": client.purge_dead, "cancel": client.cancel_selected}[verb]
    selection = dict(ids=args.ids, error_type=args.error_type, handler=args.filter_handler, all=args.all)
    matching = act(args.queue, **selection, dry_run=True)
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, "matching": matching})
        else:
            say(f"would {verb} {matching} {kind} task(s) of queue {args.queue!r} (dry run: nothing changed)")
        return 0
    if hasattr(args, "yes") and not args.ids and matching and not args.yes:  # naming ids is confirmation enough
        ask_to_confirm(f"{verb} {matching} {kind} task(s) of queue {args.queue!r}{' ' + confirm if confirm else ''}?")
    if args.background or args.rate:
        operation = client.start_operation(verb, args.queue, **selection, rate_per_second=args.rate)
        if args.background:
            print_operation(operation, args.json)
            return 0
        operation = follow_operation(client, operation)
        print_operation(operation, args.json)
        return 0 if operation.status == "SUCCEEDED" else EXIT_CONFLICT
    count = act(args.queue, **selection)
    if args.json:
        print_json({done_key: count})
    else:
        say(f"{done_key}: {count}")
    if not count and args.error_type and "." not in args.error_type:
        hint_full_error_type(args.error_type)
    return 0


def _check_dead_ids(client: QueueClient, queue: str, ids: Sequence[str]) -> None:
    """Name every id that cannot be redriven or purged, before changing anything."""
    missing: list[str] = []
    not_dead: list[str] = []
    for task_id in dict.fromkeys(ids):
        try:
            task = client.get(task_id)
        except TaskNotFound:
            missing.append(task_id)
            continue
        if task.queue != queue:
            missing.append(f"{task_id} (it is on queue {task.queue!r})")
        elif task.status is not TaskStatus.DEAD:
            not_dead.append(f"{task_id} is {task.status.value}")
    if missing:
        raise NotFound(f"no such task on queue {queue!r}: {', '.join(missing)}; nothing was changed")
    if not_dead:
        raise TaskConflict(f"only DEAD tasks can be redriven or purged: {'; '.join(not_dead)}; nothing was changed")


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "cancel": cmd_cancel, "pause": cmd_pause, "resume": cmd_pause, "audit": cmd_audit, "dlq": cmd_dlq,
    "operations": cmd_operations,
}
