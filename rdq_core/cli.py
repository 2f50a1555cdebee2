"""The ``rdq`` command line: the local host and the operator's tool.

Exit codes: 0 ok, 1 storage unavailable or unexpected failure, 2 invalid input or
configuration (usage), 3 task or queue not found, 4 conflict with the task's state, 130
stopped at once by a second Ctrl-C. Errors go to stderr; ``--json`` output on stdout is stable
and machine-readable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO
from urllib.parse import urlsplit

from . import tracecontext, validation
from .client import FLOW_FIELDS, Client
from .client_protocol import QueueClient
from .console import server as console_server
from .http_client import ApiKey, Auth, BearerToken, HttpClient, SigV4, default_auth, plaintext_credential_warning
from .errors import (
    ConfigurationError, InvalidInput, RdqError, StorageUnavailable, TaskConflict, TaskNotFound, UnsupportedOperation,
)
from .handlers import registry
from .logs import configure_logging
from .events import EventSettings, deliver_events, publisher_from_settings
from .operations import drive_operations
from .reaper import PassReport, ReapReport, maintenance_pass, reap_expired_leases, reap_forever
from .model import TaskStatus
from .retry import PolicyBook, policy_book_from_config
from .storage import default_storage_url, open_storage, redact_url as _redact
from .storage.spi import Storage
from .text import printable
from .validation import queue_name

log = logging.getLogger("rdq.cli")

EXIT_FAILURE, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_STOPPED_AT_ONCE = 1, 2, 3, 4, 130

#: Commands that may create a store; any other one says so when it would.
CREATES_STORES = {"migrate", "dev"}
#: Operator commands that work through a deployed API (--api) as well as on a store.
REMOTE_COMMANDS = {"enqueue", "stats", "queues", "tasks", "task", "cancel", "pause", "resume", "dlq", "audit",
                   "operations"}
#: Commands that only ever talk to a deployed API (or rdq dev), never to a store.
API_ONLY_COMMANDS = {"console"}
#: Commands that choose for themselves: the API with --api, else a local file (no store).
OWN_TARGET_COMMANDS = {"schedules"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdq", description="rdq: retries, a dead-letter queue and redrive on your own datastore.")
    parser.add_argument("--storage", metavar="URL", help="storage URL (default: $RDQ_STORAGE_URL, else sqlite:///rdq.db)")
    remote = parser.add_argument_group(
        "a deployed API instead of a store (the operator commands: " + ", ".join(sorted(REMOTE_COMMANDS)) + ")")
    remote.add_argument("--api", metavar="URL", default=os.environ.get("RDQ_API_URL") or None,
                        help="the API's base URL, e.g. https://ID.execute-api.REGION.amazonaws.com/v1 ($RDQ_API_URL); "
                             "signed with SigV4 from the standard AWS credential chain unless --api-key or --token is "
                             "given; a loopback URL (rdq dev, e.g. http://127.0.0.1:8787) gets no credentials unless "
                             "--profile or --region asks for SigV4")
    remote.add_argument("--stack", metavar="NAME",
                        help="use the ApiUrl output of this CloudFormation stack as --api (needs boto3)")
    remote.add_argument("--api-key", metavar="KEY", default=os.environ.get("RDQ_API_KEY") or None,
                        help="send this API key (stacks deployed with AuthMode=API_KEY; $RDQ_API_KEY)")
    remote.add_argument("--token", metavar="TOKEN", default=os.environ.get("RDQ_API_TOKEN") or None,
                        help="send this bearer token (rdq dev with RDQ_API_TOKEN; $RDQ_API_TOKEN)")
    remote.add_argument("--profile", metavar="NAME", help="AWS profile for SigV4 (default: the AWS CLI's)")
    remote.add_argument("--region", metavar="REGION", help="AWS region for SigV4 (default: the AWS CLI's, else the URL's)")
    parser.add_argument("--log-format", choices=("auto", "text", "json"), default=os.environ.get("RDQ_LOG_FORMAT", "auto"),
                        help="log lines as text (default on a terminal) or JSON (default otherwise); $RDQ_LOG_FORMAT")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("migrate", help="create or upgrade the storage schema")

    queues = commands.add_parser("queues", help="every queue that holds a task, with its counts")
    queues.add_argument("--json", action="store_true")

    dev = commands.add_parser("dev", help="run the whole system locally: API, worker and reaper")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8787)
    dev.add_argument("--handlers", metavar="MODULE[,MODULE]", help="handler modules (default: $RDQ_HANDLERS, else the examples)")
    dev.add_argument("--targets", metavar="FILE", dest="targets_file", help=_TARGETS_HELP)

    worker = commands.add_parser("worker", help="a long-running worker (container hosts)")
    worker.add_argument("--handlers", metavar="MODULE[,MODULE]", default=os.environ.get("RDQ_HANDLERS"),
                        help="handler modules (default: $RDQ_HANDLERS); needed unless --targets binds every handler")
    worker.add_argument("--targets", metavar="FILE", dest="targets_file", help=_TARGETS_HELP)
    worker.add_argument("--queues", metavar="Q[,Q]", type=_queue_list, help="queues to serve (default: every queue in the store)")
    worker.add_argument("--batch", type=_positive_int, default=10, help="tasks per claim (default 10)")
    worker.add_argument("--lease", type=_positive_float, default=30.0, help="lease seconds, renewed by a heartbeat (default 30)")
    worker.add_argument("--concurrency", type=_positive_int, default=1, help="claim loops in this process (default 1)")
    worker.add_argument("--overrun-grace", type=_positive_float, default=2.0, metavar="SECONDS",
                        help="how long a handler may run past its timeout, keeping its task, before the worker "
                             "restarts its process to stop it (default 2)")
    worker.add_argument("--no-settle-behind", dest="settle_behind", action="store_false",
                        help="settle each batch before claiming the next (default: the last settle of a batch "
                             "runs while the next batch is claimed and run; off helps when the database shares "
                             "a few busy cores with the workers)")
    worker.add_argument("--idle-poll", type=_positive_float, default=None, metavar="SECONDS",
                        help="seconds between claims while the queues are empty (default: 1, SQLite 0.1); "
                             "on PostgreSQL and Redis an enqueue wakes the worker at once")

    # schedules (rdq_core.schedules): the worker fires a local schedules file's periods
    worker.add_argument("--schedules", metavar="FILE", dest="schedules_file",
                        help="schedules file to fire (default: $RDQ_SCHEDULES_FILE, else ./rdq-schedules.json)")
    worker.add_argument("--schedules-every", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between schedule checks (default 1; 0 fires none)")
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
    schedule_add.add_argument("--max-attempts", type=_positive_int)
    schedule_add.add_argument("--json", action="store_true")
    schedule_actions.add_parser("remove", help="delete a schedule").add_argument("name")

    reaper = commands.add_parser("reaper", help="reap expired leases (and apply retention)")
    reaper.add_argument("--once", action="store_true", help="one pass, then exit")
    reaper.add_argument("--interval", type=_positive_float, default=5.0, help="seconds between passes (default 5)")
    reaper.add_argument("--batch", type=_positive_int, default=100)
    reaper.add_argument("--retention-hours", type=_positive_float, default=float(os.environ.get("RDQ_RETENTION_HOURS", 168)),
                        help="delete SUCCEEDED/CANCELLED tasks older than this (default 168)")

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

    cancel_by_filter = commands.add_parser("cancel", help="cancel the PENDING tasks of a queue that match a selection")
    _selection_arguments(cancel_by_filter, confirm=True)

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

    task = commands.add_parser("task", help="inspect or cancel one task").add_subparsers(dest="task_command", required=True)
    show = task.add_parser("show", help="a task with its attempt history")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    show.add_argument("--wait", nargs="?", const="FINISHED", metavar="STATUS",
                      help="first wait until the task is STATUS (PENDING, IN_FLIGHT, SUCCEEDED, DEAD, CANCELLED), "
                           "or without STATUS until it is SUCCEEDED, DEAD or CANCELLED")
    show.add_argument("--timeout", type=_positive_float, default=120.0, help="seconds --wait waits at most (default 120)")
    cancel = task.add_parser("cancel", help="cancel PENDING tasks")
    cancel.add_argument("ids", nargs="+", metavar="ID")
    cancel.add_argument("--json", action="store_true")

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
        _selection_arguments(dlq.add_parser(name, help=text), confirm=name == "purge")

    console_server.add_parser(commands)

    invoke = commands.add_parser("invoke", help="run one Lambda function locally with an event file (no Docker)")
    invoke.add_argument("function", choices=("api", "worker", "reaper"))
    invoke.add_argument("event", metavar="EVENT.json", help="e.g. events/api-enqueue.json; - reads standard input")
    invoke.add_argument("--timeout", type=_positive_float, help="the function timeout to emulate (default: the template's)")
    invoke.add_argument("--handlers", metavar="MODULE[,MODULE]",
                        help="handler modules (default: $RDQ_HANDLERS, else the examples)")
    return parser


def _selection_arguments(action: argparse.ArgumentParser, *, confirm: bool) -> None:
    action.add_argument("queue")
    action.add_argument("--id", action="append", dest="ids", metavar="ID")
    action.add_argument("--all", action="store_true")
    action.add_argument("--error-type")
    action.add_argument("--handler", dest="filter_handler")
    action.add_argument("--dry-run", action="store_true", help="say how many tasks match, change nothing")
    action.add_argument("--rate", type=_operation_rate, metavar="PER_SECOND",
                        help="run as a background operation acting on at most this many tasks a second")
    action.add_argument("--background", action="store_true",
                        help="run as a background operation and return at once (rdq operations show ID follows it)")
    if confirm:
        action.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    action.add_argument("--json", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.storage or default_storage_url()
    try:
        configure_logging(args.log_format, os.environ.get("RDQ_LOG_LEVEL", "INFO").upper())
        if args.stack:
            if args.api:
                raise ConfigurationError("give --api or --stack, not both")
            args.api = stack_api_url(args.stack, profile=args.profile, region=args.region)
        if args.command in API_ONLY_COMMANDS or args.command in OWN_TARGET_COMMANDS:
            return COMMANDS[args.command](args, url) or 0
        if args.api and args.command not in REMOTE_COMMANDS:
            raise ConfigurationError(f"rdq {args.command} works on a store, not through the API: "
                                     "give --storage (or RDQ_STORAGE_URL) and drop --api")
        if not args.api:
            _check_storage_url(url)
            if args.command not in CREATES_STORES:
                _note_new_sqlite_file(url)
        return COMMANDS[args.command](args, url) or 0
    except (InvalidInput, ConfigurationError, UnsupportedOperation) as exc:
        return _fail(exc, EXIT_INVALID)
    except TaskNotFound as exc:
        return _fail(exc, EXIT_NOT_FOUND)
    except TaskConflict as exc:
        return _fail(exc, EXIT_CONFLICT)
    except (StorageUnavailable, RdqError) as exc:
        return _fail(exc, EXIT_FAILURE)
    except BrokenPipeError:
        # `rdq dlq list q | head -1`: the reader has all it wanted. Say nothing more.
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        return EXIT_STOPPED_AT_ONCE
    except Exception as exc:  # one clear line for the operator, not a traceback
        log.debug("unexpected failure", exc_info=True)
        return _fail(f"unexpected {type(exc).__name__}: {exc} (RDQ_LOG_LEVEL=DEBUG shows the traceback)", EXIT_FAILURE)


# -- commands -------------------------------------------------------------------------------------

def cmd_migrate(args: argparse.Namespace, url: str) -> int:
    with _open_storage(url) as storage:
        storage.migrate()
    _say(f"migrated {_redact(url)}")
    return 0


def cmd_dev(args: argparse.Namespace, url: str) -> int:
    try:
        import aws_lambda_powertools  # noqa: F401 - the dev host drives the real Lambda handlers
    except ImportError:
        raise RdqError("rdq dev runs the Lambda handlers and needs the aws extra: python -m pip install -e '.[aws]'") from None
    from .devhost import run_dev

    _check_storage_url(url)
    modules = _module_list(args.handlers or os.environ.get("RDQ_HANDLERS"))
    _import_handler_modules(modules)
    _bind_targets(args.targets_file)
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
    from . import process_tree
    from .worker import HANDLER_OVERRAN, Worker, WorkerConfig

    # What was under this process before any handler ran is not the handlers' to end. After a
    # restart, a process the old image's handlers started in the instant before the exec (after
    # the sweep below) is under this one now: ended here, before anything is claimed.
    inherited = process_tree.inherited_pids()
    if process_tree.descendants(exclude=inherited):
        ended = process_tree.end_descendants(exclude=inherited)
        log.warning("ended %d process(es) the previous worker image's handlers left running: %s",
                    len(ended), ", ".join(map(str, ended)))
    _import_handler_modules(_module_list(args.handlers))
    if not _bind_targets(args.targets_file) and not _module_list(args.handlers):
        raise InvalidInput("give the handler modules (--handlers or $RDQ_HANDLERS), or bind handlers to targets "
                           "(--targets FILE, $RDQ_TARGETS_FILE, ./rdq-targets.json or $RDQ_TARGETS)", "--handlers")
    queues = args.queues or []
    config = WorkerConfig(queues=queues, batch_size=args.batch, lease_seconds=args.lease, concurrency=args.concurrency,
                          overrun_grace_seconds=args.overrun_grace, idle_poll_seconds=args.idle_poll,
                          settle_behind=args.settle_behind,
                          schedules_file=args.schedules_file, schedules_every_seconds=max(args.schedules_every, 0.0))
    # Before the store is opened: a bad policy (a misspelled key) stops the start with its own
    # message, whatever state the store is in.
    policies = _policies()
    signals = _SignalCount()
    with _open_storage(url) as storage:
        worker = Worker(storage, config, policies=policies)

        def on_signal(count: int) -> None:
            if count == 1:
                overrunning = {o.task_id for o in worker.overruns()}
                running = {t: name for t, name in worker.running().items() if t not in overrunning}
                waits = (f"waiting for {len(running)} running task(s) to finish: "
                         + ", ".join(f"{task_id} ({name})" for task_id, name in running.items())
                         ) if running else "no task is running"
                if overrunning:
                    waits += (f"; {len(overrunning)} handler(s) past their timeout are not waited for (their tasks "
                              f"are retried once their lease expires): {', '.join(sorted(overrunning))}")
                log.warning("stopping: %s; unstarted claims are released. Press Ctrl-C again to stop at once", waits)
                worker.stop()
                return
            # Bounded: a store that hangs must not keep the operator's second Ctrl-C waiting.
            result: list[int] = []
            settling = threading.Thread(target=lambda: result.append(worker.settle_and_release_now()), daemon=True)
            settling.start()
            settling.join(5.0)
            running = worker.running()
            # The running handlers' tasks will run again once their leases lapse: what those
            # handlers started must not outlive this process and run beside them.
            worker.drop_late_outcomes()
            ended = process_tree.end_descendants(exclude=inherited)
            log.warning("stopping at once: released %s unstarted claim(s); %d running task(s) will be retried "
                        "when their lease expires%s", result[0] if result else "no", len(running),
                        f"; ended {len(ended)} process(es) their handlers started" if ended else "")
            logging.shutdown()
            os._exit(EXIT_STOPPED_AT_ONCE)

        signals.install(on_signal)
        # A stop signal that arrived while this process image was replaced (see below) has been
        # held pending; with the handlers installed it is delivered now and drains as usual.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        log.info("worker on %s serving %s with handlers %s (batch %d, lease %gs, concurrency %d)",
                 _redact(url), ", ".join(queues) or "every queue", ", ".join(registry.names()),
                 args.batch, args.lease, args.concurrency)
        worker.run_forever()
        abandoned = worker.overruns()
        if abandoned:
            # Their outcomes, should the kill below make them return, must not be written.
            worker.drop_late_outcomes()
    if abandoned:
        # An overrunning handler's thread ends with this process image, but the processes it
        # started do not: killed now, while its lease is still fresh, so the task's next attempt
        # (once the lease lapses) never runs beside them.
        ended = process_tree.end_descendants(exclude=inherited)
        if ended:
            log.error("ended %d process(es) started by the overrunning handler(s): %s",
                      len(ended), ", ".join(map(str, ended)))
    if worker.exit_reason == HANDLER_OVERRAN:
        # Stop signals are held from here until the new image has its handlers: one sent in
        # between stays pending across exec (the blocked mask and pending signals survive it)
        # instead of being lost here or killing the new image before it can drain.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        if not signals.count:
            # The one way to stop a thread that will not return: replace the process (same PID,
            # same arguments). Its task's lease is no longer renewed from here on, so it lapses
            # and is retried; nothing can run it while the old handler still does.
            log.error("restarting this worker process to stop the overrunning handler")
            logging.shutdown()
            process_tree.carry_inherited(inherited)
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    log.info("worker stopped")
    return 0


def cmd_reaper(args: argparse.Namespace, url: str) -> int:
    stopping: list[bool] = []
    _stop_on_signals(lambda: stopping.append(True))
    policies = _policies()
    with _open_storage(url) as storage:

        def apply_retention() -> int:
            purged = 0
            while not stopping and (batch := storage.purge_succeeded(args.retention_hours * 3600, 1000)):
                purged += batch
            if purged:
                log.info("retention: deleted %d finished task(s) older than %gh", purged, args.retention_hours)
            return purged

        publisher = publisher_from_settings(EventSettings.from_env())

        def after_reaping() -> PassReport:
            # Bulk operations advance for most of the interval (at their own rate), then the outbox
            # (theirs included) gets the rest, then retention. Each step is guarded: one that
            # raises is logged and the next still runs.
            started = time.monotonic()
            return maintenance_pass([
                ("operations", lambda: drive_operations(
                    storage, deadline=started + args.interval * 0.75,
                    clock=lambda: math.inf if stopping else time.monotonic(),
                    sleep=lambda seconds: time.sleep(min(seconds, 0.5)))),
                ("events", lambda: None if publisher is None else deliver_events(
                    storage, publisher, deadline=max(time.monotonic(), started + args.interval * 0.75)
                    + args.interval / 4)),
                ("retention", apply_retention),
            ])

        if args.once:
            reaping = maintenance_pass([("reap", lambda: reap_expired_leases(storage, policies, batch_size=args.batch))])
            rest = after_reaping()
            report = reaping.result("reap", ReapReport())
            operations, delivery = rest.result("operations"), rest.result("events")
            print(json.dumps({
                "reaped": report.expired, "rescheduled": report.rescheduled, "dead_lettered": report.dead_lettered,
                "retention_deleted": rest.result("retention", 0),
                "operation_chunks": operations.chunks if operations else 0,
                "operations_failed": len(operations.failed) if operations else 0,
                "events_delivered": delivery.delivered if delivery else 0,
                "failed_steps": sorted([*reaping.failed, *rest.failed])}))
            return 1 if reaping.failed or rest.failed else 0
        log.info("reaper on %s: a pass every %gs, retention %gh", _redact(url), args.interval, args.retention_hours)
        # Long-running: survives storage outages with backoff (one log line per incident).
        reap_forever(storage, policies, interval=args.interval, batch_size=args.batch,
                     should_stop=lambda: bool(stopping), between_passes=after_reaping)
    return 0


def cmd_enqueue(args: argparse.Namespace, url: str) -> int:
    payload = _read_payload(args.payload)
    item = {"handler": args.handler, "payload": payload, "id": args.id, "delay_seconds": args.delay,
            "max_attempts": args.max_attempts, **{name: getattr(args, name) for name in FLOW_FIELDS}}
    with _client(args, url) as client, _trace_context(args):
        result = client.enqueue_item(args.queue, item)  # a payload over the threshold goes to the payload store
    task = result.task
    if args.json:
        _print_json({**task.to_dict(), "created": result.created, "deduplicated": result.deduplicated})
    elif result.deduplicated:
        _say(f"{task.id} matched dedupe key {task.dedupe_key} ({task.status.value}); nothing was enqueued")
    elif result.created:
        _say(f"{task.id} {task.status.value} queue={task.queue} handler={task.handler}")
    else:
        _say(f"{task.id} already existed ({task.status.value}, handler {task.handler}); nothing was enqueued")
    return 0


def _trace_context(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """``rdq enqueue``'s trace context: ``--traceparent``, else ``$TRACEPARENT`` (the variables
    OpenTelemetry names for passing a trace to a process); an invalid one is dropped, with a note."""
    traceparent = args.traceparent if args.traceparent is not None else os.environ.get("TRACEPARENT")
    tracestate = args.tracestate if args.tracestate is not None else os.environ.get("TRACESTATE")
    if not traceparent:
        return contextlib.nullcontext()
    if tracecontext.parse_traceparent(traceparent) is None:
        _say("rdq: note: the traceparent is not a valid W3C traceparent; the task is enqueued without it", file=sys.stderr)
    return tracecontext.use(traceparent, tracestate)


def cmd_stats(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        stats = client.stats(args.queue)
        if not any((stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled)) \
                and isinstance(client, Client) and args.queue not in client.storage.list_queues():
            raise _NotFound(f"queue {args.queue!r} holds no tasks (never used, or everything in it was "
                                 f"deleted) in {_redact(url)}")
    if args.json:
        _print_json(stats.to_dict())
    else:
        for key, value in stats.to_dict().items():
            _say(f"{key:<28} {value}")
    return 0


def cmd_queues(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        listed = client.list_queues()
    if args.json:
        _print_json({"queues": [stats.to_dict() for stats in listed]})
        return 0
    if not listed:
        _say("no queue holds a task or is paused")
    for stats in listed:
        _say(f"{stats.queue:<30} pending={stats.pending} in_flight={stats.in_flight} dead={stats.dead} "
             f"succeeded={stats.succeeded} cancelled={stats.cancelled} "
             f"oldest_pending_age_seconds={stats.oldest_pending_age_seconds:g}{' PAUSED' if stats.paused else ''}")
    return 0


def cmd_tasks(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        page = client.list_tasks(args.queue, status=args.status, handler=args.filter_handler, error_type=args.error_type,
                                 limit=args.limit, cursor=args.cursor)
    if args.json:
        _print_json(page.to_dict())
        return 0
    _print_table(("ID", "STATUS", "HANDLER", "ATTEMPTS", "LAST ERROR", "UPDATED AT"), [
        (t.id, t.status.value, t.handler, str(t.attempt_count), t.last_error.type if t.last_error else "-",
         t.updated_at.isoformat() if t.updated_at else "-")
        for t in page.tasks], empty="no tasks")
    if page.next_cursor:
        _say(f"more: --cursor {page.next_cursor}")
    return 0


def cmd_cancel(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        return _bulk_action(client, args, "cancel", "cancelled", "PENDING")


def cmd_pause(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        stats = client.pause(args.queue) if args.command == "pause" else client.resume(args.queue)
    if args.json:
        _print_json(stats.to_dict())
    else:
        _say(f"{stats.queue} {'paused' if stats.paused else 'running'} (pending={stats.pending} "
             f"in_flight={stats.in_flight})")
    return 0


def cmd_operations(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        if args.operations_command == "list":
            found = client.list_operations(queue=args.queue)
            if args.json:
                _print_json({"operations": [op.to_dict() for op in found]})
                return 0
            _print_table(("ID", "ACTION", "QUEUE", "STATUS", "DONE", "MATCHED", "RATE", "STARTED AT"), [
                (op.id, op.action, op.queue, op.status, str(op.done), str(op.matched),
                 f"{op.rate_per_second:g}/s" if op.rate_per_second else "-",
                 op.started_at.isoformat() if op.started_at else "-") for op in found], empty="no operations")
            return 0
        if args.operations_command == "cancel":
            operation = client.cancel_operation(args.id)
        else:
            operation = client.get_operation(args.id)
            if args.wait:
                operation = _follow(client, operation)
    _print_operation(operation, args.json)
    return 0


def _follow(client: QueueClient, operation: Any) -> Any:
    """Print progress lines (to standard error) until the operation is finished."""
    last = None
    while not operation.finished:
        if operation.done != last:
            _say(f"{operation.id}: {operation.action} {operation.done} of {operation.matched} ...", file=sys.stderr, flush=True)
            last = operation.done
        time.sleep(1.0)
        operation = client.get_operation(operation.id)
    return operation


def _print_operation(operation: Any, as_json: bool) -> None:
    if as_json:
        _print_json(operation.to_dict())
        return
    rate = f" at {operation.rate_per_second:g}/s" if operation.rate_per_second else ""
    _say(f"operation {operation.id}: {operation.action} on queue {operation.queue}{rate}: {operation.status}, "
         f"{operation.done} of {operation.matched} done")


def cmd_audit(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        page = client.list_audit(queue=args.queue, limit=args.limit, cursor=args.cursor)
    if args.json:
        _print_json(page.to_dict())
        return 0
    _print_table(("AT", "ACTOR", "ACTION", "QUEUE", "COUNT", "SELECTION"), [
        (e.at.isoformat(), e.actor, e.action, e.queue, str(e.count),
         json.dumps(dict(e.selection), ensure_ascii=False, separators=(",", ":")) if e.selection else "-")
        for e in page.entries], empty="no operator actions recorded")
    if page.next_cursor:
        _say(f"more: --cursor {page.next_cursor}")
    return 0


def cmd_task(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        if args.task_command == "show":
            task = _wait_for(client, args.id, args.wait, args.timeout) if args.wait else client.get(args.id)
            _print_task(task, args.json)
            return 0
        return _cancel_many(client, args.ids, args.json)


def cmd_dlq(args: argparse.Namespace, url: str) -> int:
    with _client(args, url) as client:
        if args.dlq_command == "list":
            page = client.list_dead(args.queue, limit=args.limit, cursor=args.cursor,
                                    error_type=args.error_type, handler=args.filter_handler)
            if args.json:
                _print_json({"tasks": [t.to_dict() for t in page.tasks], "next_cursor": page.next_cursor})
            else:
                _print_dead_table(page.tasks)
                if not page.tasks and args.error_type and "." not in args.error_type:
                    _hint_full_error_type(args.error_type)
                if page.next_cursor:
                    _say(f"more: --cursor {page.next_cursor}")
            return 0
        if args.dlq_command == "show":
            task = client.get(args.id)
            if task.status is not TaskStatus.DEAD:
                raise TaskConflict(f"task {task.id!r} is {task.status.value}, not DEAD (rdq task show {task.id} shows it)")
            _print_task(task, args.json)
            return 0
        return _redrive_or_purge(client, args)


def cmd_invoke(args: argparse.Namespace, url: str) -> int:
    """One local invocation of a Lambda function with a sample event (``sam local invoke``
    without Docker): the real handler, a context whose remaining time counts down."""
    try:
        import aws_lambda_powertools  # noqa: F401 - imported only to check the aws extra is installed
    except ImportError:
        raise RdqError("rdq invoke runs the Lambda handlers and needs the aws extra: python -m pip install -e '.[aws]'") from None
    event = _read_json_argument(args.event, "EVENT.json")
    if not isinstance(event, dict):
        raise InvalidInput("the event must be a JSON object", "EVENT.json")
    from .lambda_host.local_invoke import LocalLambdaContext, proxy_event_problem

    problem = proxy_event_problem(event) if args.function == "api" else None
    if problem:
        raise InvalidInput(f"the event is not an API Gateway REST proxy event: {problem} (events/api-*.json are "
                           "examples; `sam local generate-event apigateway aws-proxy` makes one)", "EVENT.json")
    os.environ["RDQ_STORAGE_URL"] = url
    os.environ.setdefault("RDQ_AUTO_MIGRATE", "true")
    modules = _module_list(args.handlers or os.environ.get("RDQ_HANDLERS")) or ["rdq_core.examples"]
    os.environ["RDQ_HANDLERS"] = ",".join(modules)
    _import_handler_modules(modules)
    if args.function == "worker":  # as the deployed worker's entry point does (functions/worker/app.py)
        _bind_targets(None)
    os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "rdq")
    from importlib import import_module

    timeout = args.timeout or {"api": 29, "worker": 60, "reaper": 60}[args.function]
    # The function's own output (Powertools logs and EMF metrics print to stdout, as on Lambda)
    # goes to stderr: stdout carries only the function's return value, for pipes and jq.
    with contextlib.redirect_stdout(sys.stderr):
        function = import_module(f"rdq_core.lambda_host.{args.function}")
        result = function.lambda_handler(event, LocalLambdaContext(f"rdq-{args.function}", timeout))
    _print_json(result)
    return 0


# -- schedules (rdq_core.schedules) ----------------------------------------------------------------
def cmd_schedules(args: argparse.Namespace, url: str) -> int:
    from .schedules import LocalScheduleBook, ScheduleClient, schedule_body

    # With --api the API's schedules; else the local file, and no store is opened.
    client: Any = _client(args, url) if args.api else ScheduleClient(LocalScheduleBook(args.schedules_file))
    if args.schedules_command == "list":
        bodies = [schedule_body(s) for s in client.list_schedules()]
        if args.json:
            _print_json({"schedules": bodies})
        for body in [] if args.json else bodies:
            _say(f"{body['name']:<24} {body['expression']:<28} {body['timezone']:<18} {body['queue']}/{body['handler']}"
                 f"  next {body['next_fire_at'] or '-'}")
    elif args.schedules_command == "add":
        schedule = client.put_schedule({
            "name": args.name, "expression": args.expression, "timezone": args.timezone, "queue": args.queue,
            "handler": args.handler, "payload": _read_payload(args.payload), "max_attempts": args.max_attempts})
        body = schedule_body(schedule)
        if args.json:
            _print_json(body)
        else:
            _say(f"{body['name']}: {body['expression']} ({body['timezone']}) -> {body['queue']}/{body['handler']};"
                 f" next {body['next_fire_at'] or 'never'} as task {body['next_task_id'] or '-'}")
    else:
        client.delete_schedule(args.name)
        _say(f"{args.name}: deleted")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "migrate": cmd_migrate, "dev": cmd_dev, "worker": cmd_worker, "reaper": cmd_reaper,
    "enqueue": cmd_enqueue, "stats": cmd_stats, "queues": cmd_queues, "tasks": cmd_tasks, "task": cmd_task,
    "cancel": cmd_cancel, "pause": cmd_pause, "resume": cmd_pause, "audit": cmd_audit, "dlq": cmd_dlq,
    "operations": cmd_operations,
    "invoke": cmd_invoke, "console": lambda args, url: console_server.run(args),
    "schedules": cmd_schedules,
}


# -- command pieces ---------------------------------------------------------------------------------

def stack_api_url(stack: str, *, profile: str | None = None, region: str | None = None) -> str:
    """The ``ApiUrl`` output of a deployed rdq stack (one ``DescribeStacks`` call)."""
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise ConfigurationError("--stack reads CloudFormation and needs boto3 (python -m pip install boto3); "
                                 "or give the URL with --api") from None
    try:
        client = boto3.Session(profile_name=profile, region_name=region).client("cloudformation")
        stacks = client.describe_stacks(StackName=stack)["Stacks"]
    except (BotoCoreError, ClientError) as exc:
        raise ConfigurationError(f"could not read stack {stack!r}: {exc}") from None
    for output in stacks[0].get("Outputs", []) if stacks else []:
        if output.get("OutputKey") == "ApiUrl":
            return str(output["OutputValue"])
    raise ConfigurationError(f"stack {stack!r} has no ApiUrl output: is it an rdq stack?")


def _client(args: argparse.Namespace, url: str) -> QueueClient:
    """The store's ``Client``, or with ``--api`` an ``HttpClient`` with the same interface: the
    commands, their output and their exit codes are the same either way."""
    if not args.api:
        return Client(url)
    auth: Auth
    if args.api_key and args.token:
        raise ConfigurationError("give --api-key or --token, not both")
    if args.api_key:
        auth = ApiKey(args.api_key)
    elif args.token:
        auth = BearerToken(args.token)
    elif args.profile or args.region:  # AWS settings given: sign, whatever the host
        auth = SigV4(profile=args.profile, region=args.region)
    else:
        auth = default_auth(args.api)  # loopback (rdq dev): no credentials; anywhere else SigV4
    warning = plaintext_credential_warning(args.api, auth)
    if warning:
        print(f"rdq: {warning}", file=sys.stderr, flush=True)
    return HttpClient(args.api, auth=auth)


class _NotFound(TaskNotFound):
    """Not found, with a message of its own (several ids, or a queue)."""

    def __init__(self, message: str) -> None:
        RdqError.__init__(self, message)


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
        _say(f"waiting up to {timeout:g}s for task {task_id} to be {described} (now {task.status.value}) ...",
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
                _say(f"{task_id} CANCELLED")
        except TaskNotFound as exc:
            code = max(code, EXIT_NOT_FOUND)
            results.append({"id": task_id, "result": "not_found", "error": str(exc)})
            _say(f"rdq: error: {exc}", file=sys.stderr)
        except TaskConflict as exc:
            code = max(code, EXIT_CONFLICT)
            results.append({"id": task_id, "result": "conflict", "error": str(exc)})
            _say(f"rdq: error: {exc}", file=sys.stderr)
    if as_json:
        _print_json(results[0]["task"] if len(ids) == 1 and code == 0 else {"results": results})
    return code


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
            _print_json({"dry_run": True, "matching": matching})
        else:
            _say(f"would {verb} {matching} {kind} task(s) of queue {args.queue!r} (dry run: nothing changed)")
        return 0
    if hasattr(args, "yes") and not args.ids and matching and not args.yes:  # naming ids is confirmation enough
        _confirm(f"{verb} {matching} {kind} task(s) of queue {args.queue!r}{' ' + confirm if confirm else ''}?")
    if args.background or args.rate:
        operation = client.start_operation(verb, args.queue, **selection, rate_per_second=args.rate)
        if args.background:
            _print_operation(operation, args.json)
            return 0
        operation = _follow(client, operation)
        _print_operation(operation, args.json)
        return 0 if operation.status == "SUCCEEDED" else EXIT_CONFLICT
    count = act(args.queue, **selection)
    if args.json:
        _print_json({done_key: count})
    else:
        _say(f"{done_key}: {count}")
    if not count and args.error_type and "." not in args.error_type:
        _hint_full_error_type(args.error_type)
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
        raise _NotFound(f"no such task on queue {queue!r}: {', '.join(missing)}; nothing was changed")
    if not_dead:
        raise TaskConflict(f"only DEAD tasks can be redriven or purged: {'; '.join(not_dead)}; nothing was changed")


def _confirm(question: str) -> None:
    if not sys.stdin.isatty():
        raise InvalidInput(f"refusing to {question.rstrip('?')} without confirmation: pass --yes "
                           f"(or --dry-run to see what would change)", "--yes")
    answer = input(printable(f"{question} [y/N] ")).strip().lower()
    if answer not in ("y", "yes"):
        raise InvalidInput("not confirmed; nothing was changed", "--yes")


def _hint_full_error_type(error_type: str) -> None:
    _say(f"note: error types are matched in full, e.g. 'rdq_core.errors.{error_type}' or 'mymodule.{error_type}'; "
         f"`rdq dlq list QUEUE` shows them", file=sys.stderr)


def _print_dead_table(tasks: Sequence[Any]) -> None:
    _print_table(("ID", "HANDLER", "ERROR", "ATTEMPTS", "DEAD AT"), [
        (t.id, t.handler, t.last_error.type if t.last_error else "-", str(len(t.attempts)),
         t.dead_at.isoformat() if t.dead_at else "-")
        for t in tasks], empty="no dead tasks")


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, empty: str) -> None:
    if not rows:
        _say(empty)
        return
    printed = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in [tuple(header), *printed]) for i in range(len(header))]
    for row in [tuple(header), *printed]:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# -- helpers --------------------------------------------------------------------------------------

def _module_list(text: str | None) -> list[str]:
    return [m.strip() for m in (text or "").split(",") if m.strip()]


def _import_handler_modules(modules: Sequence[str]) -> None:
    """Import the user's handler modules the way Celery and RQ do: the working directory is on
    the path. A module that cannot be imported, or registers a name twice, is a usage error."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for module in modules:
        try:
            registry.load_modules([module])
        except ModuleNotFoundError as exc:
            raise InvalidInput(f"cannot import handler module {module!r}: {exc} (run from the directory that holds "
                               f"it, or set PYTHONPATH)", "--handlers") from None
        except ValueError as exc:  # a handler name registered twice, or an invalid name
            raise InvalidInput(f"handler module {module!r}: {exc}", "--handlers") from None


_TARGETS_HELP = ("handler names bound to a Lambda function or an HTTPS endpoint, a JSON file (default: "
                 "$RDQ_TARGETS_FILE, else ./rdq-targets.json if present; $RDQ_TARGETS adds bindings as JSON); "
                 "docs/targets.md")


def _bind_targets(file: str | None) -> list[str]:
    """Register the operator's target bindings (``rdq_core.targets``); the names bound. A
    malformed binding, or a name also registered by a handler module, is a usage error."""
    from .targets import bind_targets, load_targets

    try:
        return bind_targets(load_targets(file))
    except ConfigurationError as exc:
        raise InvalidInput(str(exc), "--targets") from None


def _check_storage_url(url: str) -> None:
    """Configuration errors in the URL itself are usage errors (exit 2), named as such."""
    from .storage import _BACKENDS

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is what finds a malformed one
    except ValueError as exc:
        # Not echoed: a URL that does not parse cannot be redacted reliably.
        raise ConfigurationError(f"the storage URL is malformed ({exc}); check --storage or RDQ_STORAGE_URL") from None
    if parts.scheme.lower() not in _BACKENDS:
        raise InvalidInput(f"unsupported storage URL scheme {parts.scheme!r} in {_redact(url)}; expected one of "
                           f"{', '.join(sorted(_BACKENDS))}", "--storage")
    if parts.scheme.lower() == "sqlite" and _sqlite_path(url) is None:
        raise InvalidInput(f"a SQLite URL needs a file path, e.g. sqlite:///rdq.db or sqlite:////abs/path/rdq.db "
                           f"(got {_redact(url)!r})", "--storage")


def _open_storage(url: str) -> Storage:
    _check_storage_url(url)
    try:
        return open_storage(url)
    except (InvalidInput, ConfigurationError):  # already say what is wrong (a missing driver names its install)
        raise
    except ValueError as exc:
        raise InvalidInput(f"storage URL {_redact(url)}: {exc}", "--storage") from None


def _sqlite_path(url: str) -> Path | None:
    path = url.split("://", 1)[1].split("?", 1)[0] if "://" in url else ""
    if not path.startswith("/") or path in ("/", "/:memory:"):
        return None
    return Path(path[1:])  # sqlite:///rel/rdq.db -> rel/rdq.db; sqlite:////abs/rdq.db -> /abs/rdq.db


def _note_new_sqlite_file(url: str) -> None:
    """The embedded default is a file in the working directory: say so when a command is
    about to create a new, empty one (often: run from the wrong directory)."""
    if not url.lower().startswith("sqlite:"):
        return
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        _say(f"rdq: note: there is no store at {path.resolve()}; creating a new, empty one (run from the directory "
             f"that holds yours, or pass --storage / set RDQ_STORAGE_URL)", file=sys.stderr, flush=True)


def _read_payload(text: str) -> Any:
    return _read_json_argument(text, "payload", files_start_with_at=True)


def _read_json_argument(text: str, field: str, files_start_with_at: bool = False) -> Any:
    """``-`` reads standard input; ``@FILE`` (for --payload) or a path (for an event) a file."""
    source = "the argument"
    names_a_file = text.startswith("@") if files_start_with_at else True
    if text == "-":
        raw, source = sys.stdin.read(), "standard input"
    elif names_a_file:
        path = Path(text[1:] if files_start_with_at else text)
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"cannot read {field} from {path}: {exc}", field) from None
        source = str(path)
    else:
        raw = text
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{field} from {source} is not valid JSON: {exc}", field) from None


def _queue_list(text: str) -> list[str]:
    queues = [q.strip() for q in text.split(",") if q.strip()]
    for queue in queues:
        try:
            queue_name(queue)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return queues


def _policies() -> PolicyBook:
    raw = os.environ.get("RDQ_QUEUE_POLICIES")
    try:
        return policy_book_from_config(json.loads(raw) if raw else None)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"RDQ_QUEUE_POLICIES is invalid: {exc}", "RDQ_QUEUE_POLICIES") from None


def _print_task(task: Any, as_json: bool) -> None:
    if as_json:
        _print_json(task.to_dict())
        return
    _say(f"{task.id}  {task.status.value}  queue={task.queue} handler={task.handler}")
    due = f" next_attempt_at={_at(task.next_attempt_at)}" if task.status is TaskStatus.PENDING else ""
    _say(f"  attempt_count={task.attempt_count} redrive_count={task.redrive_count}{due}")
    if task.result is not None:
        _say(f"  result={json.dumps(task.result)[:200]}")
    for a in task.attempts:
        error = f" {a.error.type}: {a.error.message[:120]}" if a.error else ""
        _say(f"  #{a.attempt_no:<3} {a.outcome.value:<18} {_at(a.finished_at)}{error}")


def _at(value: Any) -> str:
    return value.isoformat() if value is not None else "-"


def _say(text: str, file: TextIO | None = None, flush: bool = False) -> None:
    """``print`` for human-readable output. Text from the store (ids, error messages) can carry
    what a task's payload put there: escape anything non-printable, so a payload cannot drive
    the operator's terminal or forge a line. ``--json`` output needs no help (JSON escapes)."""
    print(printable(text), file=file, flush=flush)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _fail(exc: BaseException | str, code: int) -> int:
    _say(f"rdq: error: {exc}", file=sys.stderr)
    return code


def _silence_stdout() -> None:
    # Python flushes stdout at exit and would fail again on the closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class _SignalCount:
    """SIGINT/SIGTERM handling that counts: the host decides what the n-th signal does."""

    def __init__(self) -> None:
        self.count = 0

    def install(self, on_signal: Callable[[int], None]) -> None:
        def handle(*_: Any) -> None:
            self.count += 1
            on_signal(self.count)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handle)


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _stop_on_signals(stop: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _operation_rate(text: str) -> float:
    """``--rate``: the same bounds the API and the client hold an operation's rate to."""
    try:
        rate = validation.operation_rate(float(text), "--rate")
    except (ValueError, InvalidInput) as exc:
        raise argparse.ArgumentTypeError(
            f"must be a number of tasks a second in {validation.Limits.operation_rate_min:g}.."
            f"{validation.Limits.operation_rate_max:g}") from exc
    assert rate is not None
    return rate


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


if __name__ == "__main__":
    sys.exit(main())
