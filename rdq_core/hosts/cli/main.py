"""The ``rdq`` command line: the local host and the operator's tool.

Exit codes: 0 ok, 1 storage unavailable or unexpected failure, 2 invalid input or
configuration (usage), 3 task or queue not found, 4 conflict with the task's state, 130
stopped at once by a second Ctrl-C. Errors go to stderr; ``--json`` output on stdout is stable
and machine-readable.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Collection, NoReturn, Sequence

from ..console.options import add_parser as add_console_parser
from ...errors import (
    ConfigurationError, InvalidInput, RdqError, StorageUnavailable, TaskConflict, TaskNotFound, UnsupportedOperation,
)
from ...engine.logs import configure_logging
from ...storage import default_storage_url
from . import hosts, operator, schedules, tasks
from .common import (
    EXIT_FAILURE, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_STOPPED_AT_ONCE, check_storage_url,
    note_new_sqlite_file, stack_api_url,
)
from .output import fail, silence_stdout

log = logging.getLogger("rdq.cli")

#: Commands that may create a store; any other one says so when it would.
CREATES_STORES = {"migrate", "dev"}
#: Operator commands that work through a deployed API (--api) as well as on a store.
REMOTE_COMMANDS = {"enqueue", "stats", "queues", "tasks", "task", "cancel", "pause", "resume", "dlq", "audit",
                   "operations"}
#: Commands that only ever talk to a deployed API (or rdq dev), never to a store.
API_ONLY_COMMANDS = {"console"}
#: Commands that choose for themselves: the API with --api, else a local file (no store).
OWN_TARGET_COMMANDS = {"schedules"}

COMMANDS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    **hosts.COMMANDS, **tasks.COMMANDS, **operator.COMMANDS, **schedules.COMMANDS,
    "console": lambda args, url: _run_console(args),
}


def _run_console(args: argparse.Namespace) -> int:
    # Imported when run: the console's server and HTTP client are a tenth of every other
    # command's start (rdq worker's first claim waits for them).
    from ..console import server

    return server.run(args)


def add_global_options(parser: argparse.ArgumentParser) -> None:
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


#: Each group of commands, by name, and what adds their parsers.
COMMAND_GROUPS: tuple[tuple[Collection[str], Callable[[Any], object]], ...] = (
    (hosts.COMMANDS, hosts.configure), (tasks.COMMANDS, tasks.configure), (operator.COMMANDS, operator.configure),
    (schedules.COMMANDS, schedules.configure), (API_ONLY_COMMANDS, add_console_parser),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line: the global options here, each command group's in its own module.
    ``command`` given, only its group's parsers are added (what ``main`` runs needs no other;
    building all 30 is a twentieth of a worker's start)."""
    parser = argparse.ArgumentParser(
        prog="rdq", description="rdq: retries, a dead-letter queue and redrive on your own datastore.")
    add_global_options(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for names, configure in COMMAND_GROUPS:
        if command is None or command in names:
            configure(commands)
    return parser


class _Peek(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def command_named(argv: Sequence[str] | None) -> str | None:
    """The command ``argv`` names, read past the global options; None when it names none that
    exists (or the global options do not parse): the whole parser then says what is wrong."""
    peek = _Peek(add_help=False)
    add_global_options(peek)
    peek.add_argument("command", nargs="?")
    peek.add_argument("rest", nargs=argparse.REMAINDER)
    try:
        command = peek.parse_known_args(argv)[0].command
    except ValueError:
        return None
    return command if command in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(command_named(argv)).parse_args(argv)
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
            check_storage_url(url)
            if args.command not in CREATES_STORES:
                note_new_sqlite_file(url)
        return COMMANDS[args.command](args, url) or 0
    except (InvalidInput, ConfigurationError, UnsupportedOperation) as exc:
        return fail(exc, EXIT_INVALID)
    except TaskNotFound as exc:
        return fail(exc, EXIT_NOT_FOUND)
    except TaskConflict as exc:
        return fail(exc, EXIT_CONFLICT)
    except (StorageUnavailable, RdqError) as exc:
        return fail(exc, EXIT_FAILURE)
    except BrokenPipeError:
        # `rdq dlq list q | head -1`: the reader has all it wanted. Say nothing more.
        silence_stdout()
        return 0
    except KeyboardInterrupt:
        return EXIT_STOPPED_AT_ONCE
    except Exception as exc:  # one clear line for the operator, not a traceback
        log.debug("unexpected failure", exc_info=True)
        return fail(f"unexpected {type(exc).__name__}: {exc} (RDQ_LOG_LEVEL=DEBUG shows the traceback)", EXIT_FAILURE)
