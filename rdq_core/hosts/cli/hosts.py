"""The commands that host rdq on this machine: ``migrate``, ``dev``, ``worker``, ``reaper`` and
``invoke`` (one local Lambda invocation)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from typing import Any, Callable

from ...errors import InvalidInput, RdqError
from ...aws.eventbridge import publisher_from_settings
from ...events import EventSettings
from ...engine.maintenance import MaintenancePlan, MaintenanceReport, run_maintenance
from ...engine.reaper import maintain_forever
from ...storage import redact_url as _redact
from .common import (
    TARGETS_HELP, bind_operator_targets, check_storage_url, import_handler_modules, module_list, open_store,
    policies_from_env, positive_float, positive_int, queue_list, read_json_argument,
)
from ..signals import stop_on_signals
from .output import print_json, say

log = logging.getLogger("rdq.cli")


def configure(commands: Any) -> None:
    commands.add_parser("migrate", help="create or upgrade the storage schema")

    dev = commands.add_parser("dev", help="run the whole system locally: API, worker and reaper")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8787)
    dev.add_argument("--handlers", metavar="MODULE[,MODULE]", help="handler modules (default: $RDQ_HANDLERS, else the examples)")
    dev.add_argument("--targets", metavar="FILE", dest="targets_file", help=TARGETS_HELP)

    worker = commands.add_parser("worker", help="a long-running worker (container hosts)")
    worker.add_argument("--handlers", metavar="MODULE[,MODULE]", default=os.environ.get("RDQ_HANDLERS"),
                        help="handler modules (default: $RDQ_HANDLERS); needed unless --targets binds every handler")
    worker.add_argument("--targets", metavar="FILE", dest="targets_file", help=TARGETS_HELP)
    worker.add_argument("--queues", metavar="Q[,Q]", type=queue_list, help="queues to serve (default: every queue in the store)")
    worker.add_argument("--batch", type=positive_int, default=10, help="tasks per claim (default 10)")
    worker.add_argument("--lease", type=positive_float, default=30.0, help="lease seconds, renewed by a heartbeat (default 30)")
    worker.add_argument("--concurrency", type=positive_int, default=1, help="claim loops in this process (default 1)")
    worker.add_argument("--overrun-grace", type=positive_float, default=2.0, metavar="SECONDS",
                        help="how long a handler may run past its timeout, keeping its task, before the worker "
                             "restarts its process to stop it (default 2)")
    worker.add_argument("--no-settle-behind", dest="settle_behind", action="store_false",
                        help="settle each batch before claiming the next, and claim the next only then (default: "
                             "the last settle of a batch runs while the next batch is claimed and run, and while a "
                             "full batch of quick tasks of one queue runs the next is claimed; off helps when the "
                             "database shares a few busy cores with the workers)")
    worker.add_argument("--idle-poll", type=positive_float, default=None, metavar="SECONDS",
                        help="seconds between claims while the queues are empty (default: 1, SQLite 0.1); "
                             "on PostgreSQL and Redis an enqueue wakes the worker at once")

    # schedules (rdq_core.engine.schedules): the worker fires a local schedules file's periods
    worker.add_argument("--name", default="", metavar="NAME",
                        help="a name added to HOST:PID on this worker's claims (shown on a running task)")
    worker.add_argument("--schedules", metavar="FILE", dest="schedules_file",
                        help="schedules file to fire (default: $RDQ_SCHEDULES_FILE, else ./rdq-schedules.json)")
    worker.add_argument("--schedules-every", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between schedule checks (default 1; 0 fires none)")

    reaper = commands.add_parser("reaper", help="reap expired leases (and apply retention)")
    reaper.add_argument("--once", action="store_true", help="one pass, then exit")
    reaper.add_argument("--interval", type=positive_float, default=5.0, help="seconds between passes (default 5)")
    reaper.add_argument("--batch", type=positive_int, default=100)
    reaper.add_argument("--retention-hours", type=positive_float, default=float(os.environ.get("RDQ_RETENTION_HOURS", 168)),
                        help="delete SUCCEEDED/CANCELLED tasks older than this (default 168)")

    invoke = commands.add_parser("invoke", help="run one Lambda function locally with an event file (no Docker)")
    invoke.add_argument("function", choices=("api", "worker", "reaper"))
    invoke.add_argument("event", metavar="EVENT.json", help="e.g. events/api-enqueue.json; - reads standard input")
    invoke.add_argument("--timeout", type=positive_float, help="the function timeout to emulate (default: the template's)")
    invoke.add_argument("--handlers", metavar="MODULE[,MODULE]",
                        help="handler modules (default: $RDQ_HANDLERS, else the examples)")


def cmd_migrate(args: argparse.Namespace, url: str) -> int:
    with open_store(url) as storage:
        storage.migrate()
    say(f"migrated {_redact(url)}")
    return 0


def cmd_dev(args: argparse.Namespace, url: str) -> int:
    try:
        import aws_lambda_powertools  # noqa: F401 - the dev host drives the real Lambda handlers
    except ImportError:
        raise RdqError("rdq dev runs the Lambda handlers and needs the aws extra: python -m pip install -e '.[aws]'") from None
    from ..dev import run_dev

    check_storage_url(url)
    modules = module_list(args.handlers or os.environ.get("RDQ_HANDLERS"))
    import_handler_modules(modules)
    bind_operator_targets(args.targets_file)
    try:
        run_dev(url, host=args.host, port=args.port, handler_modules=modules or None)
    except ValueError as exc:  # a configuration the dev host refuses (e.g. --host 0.0.0.0 without a token)
        raise InvalidInput(str(exc), "--host") from None
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise InvalidInput(f"port {args.port} on {args.host} is already in use (another rdq dev?); "
                               f"stop it or pass --port", "--port") from None
        raise
    return 0


def cmd_worker(args: argparse.Namespace, url: str) -> int:
    from ...engine.handlers import registry
    from ..process.worker import WorkerConfig
    from ..process.supervisor import end_leftovers_of_previous_image, run_worker_process

    inherited = end_leftovers_of_previous_image()
    import_handler_modules(module_list(args.handlers))
    if not bind_operator_targets(args.targets_file) and not module_list(args.handlers):
        raise InvalidInput("give the handler modules (--handlers or $RDQ_HANDLERS), or bind handlers to targets "
                           "(--targets FILE, $RDQ_TARGETS_FILE, ./rdq-targets.json or $RDQ_TARGETS)", "--handlers")
    queues = args.queues or []
    config = WorkerConfig(queues=queues, batch_size=args.batch, lease_seconds=args.lease, concurrency=args.concurrency,
                          overrun_grace_seconds=args.overrun_grace, idle_poll_seconds=args.idle_poll,
                          settle_behind=args.settle_behind, name=args.name,
                          schedules_file=args.schedules_file, schedules_every_seconds=max(args.schedules_every, 0.0))
    # Before the store is opened: a bad policy (a misspelled key) stops the start with its own
    # message, whatever state the store is in.
    policies = policies_from_env()
    run_worker_process(lambda: open_store(url), config, policies, inherited, lambda: (
        f"worker on {_redact(url)} serving {', '.join(queues) or 'every queue'} with handlers "
        f"{', '.join(registry.names())} (batch {args.batch}, lease {args.lease:g}s, concurrency {args.concurrency})"))
    return 0

def cmd_reaper(args: argparse.Namespace, url: str) -> int:
    stopping: list[bool] = []
    stop_on_signals(lambda: stopping.append(True))
    # The maintenance pass every host runs (rdq_core/engine/maintenance.py). Bulk operations advance for
    # most of the interval (at their own rate), the outbox gets the rest, and retention runs until
    # nothing is that old or the reaper is stopping.
    plan = MaintenancePlan(policies=policies_from_env(), reap_batch_size=args.batch,
                           publisher=publisher_from_settings(EventSettings.from_env()),
                           retention_hours=args.retention_hours, operation_seconds=args.interval * 0.75,
                           event_seconds=args.interval / 4, retention_seconds=math.inf)
    with open_store(url) as storage:

        def one_pass() -> MaintenanceReport:
            return run_maintenance(storage, plan, deadline=math.inf, stopping=lambda: bool(stopping))

        if args.once:
            report = one_pass()
            operations = report.passed.result("operations")
            reaped = report.reaped
            print(json.dumps({
                "reaped": reaped.expired, "rescheduled": reaped.rescheduled, "dead_lettered": reaped.dead_lettered,
                "retention_deleted": report.retention_deleted,
                "operation_chunks": operations.chunks if operations else 0,
                "operations_failed": len(operations.failed) if operations else 0,
                "events_delivered": report.delivery.delivered, "failed_steps": sorted(report.failed)}))
            return 1 if report.failed else 0
        log.info("reaper on %s: a pass every %gs, retention %gh", _redact(url), args.interval, args.retention_hours)
        # Long-running: survives storage outages with backoff (one log line per incident).
        maintain_forever(lambda: one_pass().passed, interval=args.interval, should_stop=lambda: bool(stopping))
    return 0


def cmd_invoke(args: argparse.Namespace, url: str) -> int:
    """One local invocation of a Lambda function with a sample event (``sam local invoke``
    without Docker): the real handler, a context whose remaining time counts down."""
    try:
        import aws_lambda_powertools  # noqa: F401 - imported only to check the aws extra is installed
    except ImportError:
        raise RdqError("rdq invoke runs the Lambda handlers and needs the aws extra: python -m pip install -e '.[aws]'") from None
    event = read_json_argument(args.event, "EVENT.json")
    if not isinstance(event, dict):
        raise InvalidInput("the event must be a JSON object", "EVENT.json")
    from ..aws_lambda.local_invoke import LocalLambdaContext, proxy_event_problem

    problem = proxy_event_problem(event) if args.function == "api" else None
    if problem:
        raise InvalidInput(f"the event is not an API Gateway REST proxy event: {problem} (events/api-*.json are "
                           "examples; `sam local generate-event apigateway aws-proxy` makes one)", "EVENT.json")
    os.environ["RDQ_STORAGE_URL"] = url
    os.environ.setdefault("RDQ_AUTO_MIGRATE", "true")
    modules = module_list(args.handlers or os.environ.get("RDQ_HANDLERS")) or ["rdq_core.examples"]
    os.environ["RDQ_HANDLERS"] = ",".join(modules)
    import_handler_modules(modules)
    if args.function == "worker":  # as the deployed worker's entry point does (functions/worker/app.py)
        bind_operator_targets(None)
    os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "rdq")
    from importlib import import_module

    timeout = args.timeout or {"api": 29, "worker": 60, "reaper": 60}[args.function]
    # The function's own output (Powertools logs and EMF metrics print to stdout, as on Lambda)
    # goes to stderr: stdout carries only the function's return value, for pipes and jq.
    with contextlib.redirect_stdout(sys.stderr):
        function = import_module(f"rdq_core.hosts.aws_lambda.{args.function}")
        result = function.lambda_handler(event, LocalLambdaContext(f"rdq-{args.function}", timeout))
    print_json(result)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "migrate": cmd_migrate, "dev": cmd_dev, "worker": cmd_worker, "reaper": cmd_reaper, "invoke": cmd_invoke,
}
