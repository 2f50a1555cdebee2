"""``rdq schedules``: periodic tasks in the local schedules file, or the API's with ``--api``."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from .common import client_for, positive_int, read_payload
from .output import print_json, say


def configure(commands: Any) -> None:
    schedules = commands.add_parser("schedules", help="periodic tasks: list, add (or replace), remove")
    schedules.add_argument("--file", metavar="FILE", dest="schedules_file",
                           help="the local schedules file (default: $RDQ_SCHEDULES_FILE, else ./rdq-schedules.json); "
                                "with --api/--stack the API's schedules instead")
    schedule_actions = schedules.add_subparsers(dest="schedules_command", required=True)
    schedule_actions.add_parser("list", help="every schedule with its next fire time").add_argument(
        "--json", action="store_true")
    schedule_add = schedule_actions.add_parser("add", help="create or replace a schedule")
    schedule_add.add_argument("name")
    schedule_add.add_argument("expression", help="'rate(5 minutes)' or 'cron(0 9 ? * MON-FRI *)'")
    schedule_add.add_argument("--queue", required=True)
    schedule_add.add_argument("--handler", required=True)
    schedule_add.add_argument("--payload", default="null", help="JSON, @FILE or - (standard input)")
    schedule_add.add_argument("--timezone", default="UTC", help="IANA time zone of a cron expression (default UTC)")
    schedule_add.add_argument("--max-attempts", type=positive_int)
    schedule_add.add_argument("--json", action="store_true")
    schedule_actions.add_parser("remove", help="delete a schedule").add_argument("name")


def cmd_schedules(args: argparse.Namespace, url: str) -> int:
    from ...engine.schedules import LocalScheduleBook, ScheduleClient, schedule_body

    # With --api the API's schedules; else the local file, and no store is opened.
    client: Any = client_for(args, url) if args.api else ScheduleClient(LocalScheduleBook(args.schedules_file))
    if args.schedules_command == "list":
        bodies = [schedule_body(s) for s in client.list_schedules()]
        if args.json:
            print_json({"schedules": bodies})
        for body in [] if args.json else bodies:
            say(f"{body['name']:<24} {body['expression']:<28} {body['timezone']:<18} {body['queue']}/{body['handler']}"
                 f"  next {body['next_fire_at'] or '-'}")
    elif args.schedules_command == "add":
        schedule = client.put_schedule({
            "name": args.name, "expression": args.expression, "timezone": args.timezone, "queue": args.queue,
            "handler": args.handler, "payload": read_payload(args.payload), "max_attempts": args.max_attempts})
        body = schedule_body(schedule)
        if args.json:
            print_json(body)
        else:
            say(f"{body['name']}: {body['expression']} ({body['timezone']}) -> {body['queue']}/{body['handler']};"
                 f" next {body['next_fire_at'] or 'never'} as task {body['next_task_id'] or '-'}")
    else:
        client.delete_schedule(args.name)
        say(f"{args.name}: deleted")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {"schedules": cmd_schedules}
