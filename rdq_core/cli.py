"""The ``rdq`` command line: the local host and the operator's tool.

Exit codes: 0 ok, 1 storage unavailable or unexpected failure, 2 invalid input (usage),
3 task not found, 4 conflict with the task's state. Errors go to stderr; ``--json`` output on
stdout is stable and machine-readable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, Sequence

from .client import Client
from .errors import InvalidInput, RdqError, StorageUnavailable, TaskConflict, TaskNotFound
from .handlers import registry
from .reaper import reap_expired_leases, reap_forever
from .retry import policy_book_from_config
from .storage import default_storage_url, open_storage

log = logging.getLogger("rdq.cli")

EXIT_FAILURE, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_CONFLICT = 1, 2, 3, 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdq", description="rdq: retries, a dead-letter queue and redrive on your own datastore.")
    parser.add_argument("--storage", metavar="URL", help="storage URL (default: $RDQ_STORAGE_URL, else sqlite:///rdq.db)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("migrate", help="create or upgrade the storage schema")

    dev = commands.add_parser("dev", help="run the whole system locally: API, worker and reaper")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8787)
    dev.add_argument("--handlers", metavar="MODULE[,MODULE]", help="handler modules (default: $RDQ_HANDLERS, else the examples)")

    worker = commands.add_parser("worker", help="a long-running worker (container hosts)")
    worker.add_argument("--handlers", metavar="MODULE[,MODULE]", default=os.environ.get("RDQ_HANDLERS"), required="RDQ_HANDLERS" not in os.environ)
    worker.add_argument("--queues", metavar="Q[,Q]", help="queues to serve (default: every queue in the store)")
    worker.add_argument("--batch", type=_positive_int, default=10, help="tasks per claim (default 10)")
    worker.add_argument("--lease", type=_positive_float, default=30.0, help="lease seconds, renewed by a heartbeat (default 30)")
    worker.add_argument("--concurrency", type=_positive_int, default=1, help="claim loops in this process (default 1)")
    worker.add_argument("--overrun-grace", type=_positive_float, default=2.0, metavar="SECONDS",
                        help="how long a handler may run past its timeout, keeping its task, before the worker "
                             "restarts its process to stop it (default 2)")

    reaper = commands.add_parser("reaper", help="reap expired leases (and apply retention)")
    reaper.add_argument("--once", action="store_true", help="one pass, then exit")
    reaper.add_argument("--interval", type=_positive_float, default=5.0, help="seconds between passes (default 5)")
    reaper.add_argument("--batch", type=_positive_int, default=100)
    reaper.add_argument("--retention-hours", type=_positive_float, default=float(os.environ.get("RDQ_RETENTION_HOURS", 168)),
                        help="delete SUCCEEDED/CANCELLED tasks older than this (default 168)")

    enqueue = commands.add_parser("enqueue", help="enqueue one task")
    enqueue.add_argument("queue")
    enqueue.add_argument("handler")
    enqueue.add_argument("--payload", default="null", help="JSON payload (default null)")
    enqueue.add_argument("--id")
    enqueue.add_argument("--delay", type=float, help="seconds before the task is due")
    enqueue.add_argument("--max-attempts", type=int)
    enqueue.add_argument("--json", action="store_true")

    stats = commands.add_parser("stats", help="queue depth and age")
    stats.add_argument("queue")
    stats.add_argument("--json", action="store_true")

    task = commands.add_parser("task", help="inspect or cancel one task").add_subparsers(dest="task_command", required=True)
    show = task.add_parser("show", help="a task with its attempt history")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    cancel = task.add_parser("cancel", help="cancel a PENDING task")
    cancel.add_argument("id")
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
        action = dlq.add_parser(name, help=text)
        action.add_argument("queue")
        action.add_argument("--id", action="append", dest="ids", metavar="ID")
        action.add_argument("--all", action="store_true")
        action.add_argument("--error-type")
        action.add_argument("--handler", dest="filter_handler")
        action.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RDQ_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    url = args.storage or default_storage_url()
    try:
        return COMMANDS[args.command](args, url) or 0
    except InvalidInput as exc:
        return _fail(exc, EXIT_INVALID)
    except TaskNotFound as exc:
        return _fail(exc, EXIT_NOT_FOUND)
    except TaskConflict as exc:
        return _fail(exc, EXIT_CONFLICT)
    except (StorageUnavailable, RdqError) as exc:
        return _fail(exc, EXIT_FAILURE)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line for the operator, not a traceback
        log.debug("unexpected failure", exc_info=True)
        return _fail(f"unexpected {type(exc).__name__}: {exc} (RDQ_LOG_LEVEL=DEBUG shows the traceback)", EXIT_FAILURE)


# -- commands -------------------------------------------------------------------------------------

def cmd_migrate(args: argparse.Namespace, url: str) -> int:
    with open_storage(url) as storage:
        storage.migrate()
    print(f"migrated {_redact(url)}")
    return 0


def cmd_dev(args: argparse.Namespace, url: str) -> int:
    try:
        import aws_lambda_powertools  # noqa: F401 - the dev host drives the real Lambda handlers
    except ImportError:
        raise RdqError("rdq dev runs the Lambda handlers and needs the aws extra: python -m pip install -e '.[aws]'") from None
    from .devhost import run_dev

    modules = args.handlers or os.environ.get("RDQ_HANDLERS")
    run_dev(url, host=args.host, port=args.port, handler_modules=modules.split(",") if modules else None)
    return 0


def cmd_worker(args: argparse.Namespace, url: str) -> int:
    from .worker import HANDLER_OVERRAN, Worker, WorkerConfig

    registry.load_modules(args.handlers)
    queues = [q.strip() for q in args.queues.split(",") if q.strip()] if args.queues else []
    config = WorkerConfig(queues=queues, batch_size=args.batch, lease_seconds=args.lease, concurrency=args.concurrency,
                          overrun_grace_seconds=args.overrun_grace)
    stop_requested: list[bool] = []
    with open_storage(url) as storage:
        worker = Worker(storage, config, policies=_policies())
        _stop_on_signals(lambda: (stop_requested.append(True), worker.stop()))
        log.info("worker serving %s with handlers %s", ", ".join(queues) or "every queue", ", ".join(registry.names()))
        worker.run_forever()
    if worker.exit_reason == HANDLER_OVERRAN and not stop_requested:
        # The one way to stop a thread that will not return: replace the process (same PID,
        # same arguments). Its task's lease is no longer renewed from here on, so it lapses
        # and is retried; nothing can run it while the old handler still does.
        log.error("restarting this worker process to stop the overrunning handler")
        logging.shutdown()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    return 0


def cmd_reaper(args: argparse.Namespace, url: str) -> int:
    stopping: list[bool] = []
    _stop_on_signals(lambda: stopping.append(True))
    policies = _policies()
    with open_storage(url) as storage:

        def apply_retention() -> int:
            purged = 0
            while not stopping and (batch := storage.purge_succeeded(args.retention_hours * 3600, 1000)):
                purged += batch
            if purged:
                log.info("retention: deleted %d finished task(s) older than %gh", purged, args.retention_hours)
            return purged

        if args.once:
            report = reap_expired_leases(storage, policies, batch_size=args.batch)
            purged = apply_retention()
            print(json.dumps({"reaped": report.expired, "rescheduled": report.rescheduled,
                              "dead_lettered": report.dead_lettered, "retention_deleted": purged}))
            return 0
        # Long-running: survives storage outages with backoff (one log line per incident).
        reap_forever(storage, policies, interval=args.interval, batch_size=args.batch,
                     should_stop=lambda: bool(stopping), between_passes=apply_retention)
    return 0


def cmd_enqueue(args: argparse.Namespace, url: str) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--payload is not valid JSON: {exc}", "payload") from None
    with Client(url) as client:
        task = client.enqueue(args.queue, args.handler, payload, id=args.id, delay_seconds=args.delay,
                              max_attempts=args.max_attempts)
    if args.json:
        _print_json(task.to_dict())
    else:
        print(f"{task.id} {task.status.value} queue={task.queue} handler={task.handler}")
    return 0


def cmd_stats(args: argparse.Namespace, url: str) -> int:
    with Client(url) as client:
        stats = client.stats(args.queue)
    if args.json:
        _print_json(stats.to_dict())
    else:
        for key, value in stats.to_dict().items():
            print(f"{key:<28} {value}")
    return 0


def cmd_task(args: argparse.Namespace, url: str) -> int:
    with Client(url) as client:
        task = client.get(args.id) if args.task_command == "show" else client.cancel(args.id)
    _print_task(task, args.json)
    return 0


def cmd_dlq(args: argparse.Namespace, url: str) -> int:
    with Client(url) as client:
        if args.dlq_command == "list":
            page = client.list_dead(args.queue, limit=args.limit, cursor=args.cursor,
                                    error_type=args.error_type, handler=args.filter_handler)
            if args.json:
                _print_json({"tasks": [t.to_dict() for t in page.tasks], "next_cursor": page.next_cursor})
            else:
                for t in page.tasks:
                    error = t.last_error.type if t.last_error else "-"
                    print(f"{t.id}  {t.handler:<24} {error:<32} attempts={len(t.attempts)} dead_at={t.dead_at.isoformat() if t.dead_at else '-'}")
                if page.next_cursor:
                    print(f"more: --cursor {page.next_cursor}")
            return 0
        if args.dlq_command == "show":
            _print_task(client.get(args.id), args.json)
            return 0
        selection = dict(ids=args.ids, error_type=args.error_type, handler=args.filter_handler, all=args.all)
        count = client.redrive(args.queue, **selection) if args.dlq_command == "redrive" else client.purge_dead(args.queue, **selection)
    if args.json:
        _print_json({"count": count})
    else:
        print(f"{'redriven' if args.dlq_command == 'redrive' else 'purged'}: {count}")
    return 0


COMMANDS = {
    "migrate": cmd_migrate, "dev": cmd_dev, "worker": cmd_worker, "reaper": cmd_reaper,
    "enqueue": cmd_enqueue, "stats": cmd_stats, "task": cmd_task, "dlq": cmd_dlq,
}


# -- helpers --------------------------------------------------------------------------------------

def _policies():
    raw = os.environ.get("RDQ_QUEUE_POLICIES")
    try:
        return policy_book_from_config(json.loads(raw) if raw else None)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"RDQ_QUEUE_POLICIES is invalid: {exc}", "RDQ_QUEUE_POLICIES") from None


def _print_task(task: Any, as_json: bool) -> None:
    if as_json:
        _print_json(task.to_dict())
        return
    print(f"{task.id}  {task.status.value}  queue={task.queue} handler={task.handler}")
    print(f"  attempt_count={task.attempt_count} redrive_count={task.redrive_count} next_attempt_at={_at(task.next_attempt_at)}")
    if task.result is not None:
        print(f"  result={json.dumps(task.result)[:200]}")
    for a in task.attempts:
        error = f" {a.error.type}: {a.error.message[:120]}" if a.error else ""
        print(f"  #{a.attempt_no:<3} {a.outcome.value:<18} {_at(a.finished_at)}{error}")


def _at(value: Any) -> str:
    return value.isoformat() if value is not None else "-"


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _fail(exc: BaseException | str, code: int) -> int:
    print(f"rdq: error: {exc}", file=sys.stderr)
    return code


def _redact(url: str) -> str:
    """Hide a password in a URL before printing it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _stop_on_signals(stop: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


if __name__ == "__main__":
    sys.exit(main())
