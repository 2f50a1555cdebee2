"""What every ``rdq`` command shares: the client or store it acts on, reading arguments, the
operator's policies and targets, and the exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from ... import validation
from ...client import Client
from ...client_protocol import QueueClient
from ...errors import ConfigurationError, InvalidInput, RdqError, TaskNotFound
from ...engine.handlers import registry
from ...engine.retry import PolicyBook, policy_book_from_config
from ...storage import open_storage, redact_url as _redact
from ...storage.spi import Storage
from ...validation import queue_name
from .output import say

EXIT_FAILURE, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_STOPPED_AT_ONCE = 1, 2, 3, 4, 130


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


def client_for(args: argparse.Namespace, url: str) -> QueueClient:
    """The store's ``Client``, or with ``--api`` an ``HttpClient`` with the same interface: the
    commands, their output and their exit codes are the same either way."""
    if not args.api:
        return Client(url)
    # Imported here: a command on a store (rdq worker above all) need not load an HTTP client.
    from ...http_client import ApiKey, Auth, BearerToken, HttpClient, SigV4, default_auth, plaintext_credential_warning

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


class NotFound(TaskNotFound):
    """Not found, with a message of its own (several ids, or a queue)."""

    def __init__(self, message: str) -> None:
        RdqError.__init__(self, message)


def module_list(text: str | None) -> list[str]:
    return [m.strip() for m in (text or "").split(",") if m.strip()]


def import_handler_modules(modules: Sequence[str]) -> None:
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


TARGETS_HELP = ("handler names bound to a Lambda function or an HTTPS endpoint, a JSON file (default: "
                 "$RDQ_TARGETS_FILE, else ./rdq-targets.json if present; $RDQ_TARGETS adds bindings as JSON); "
                 "docs/targets.md")


def bind_operator_targets(file: str | None) -> list[str]:
    """Register the operator's target bindings (``rdq_core.targets``); the names bound. A
    malformed binding, or a name also registered by a handler module, is a usage error."""
    from ...targets import bind_targets, load_targets

    try:
        return bind_targets(load_targets(file))
    except ConfigurationError as exc:
        raise InvalidInput(str(exc), "--targets") from None


def check_storage_url(url: str) -> None:
    """Configuration errors in the URL itself are usage errors (exit 2), named as such."""
    from ...storage import _BACKENDS

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is what finds a malformed one
    except ValueError as exc:
        # Not echoed: a URL that does not parse cannot be redacted reliably.
        raise ConfigurationError(f"the storage URL is malformed ({exc}); check --storage or RDQ_STORAGE_URL") from None
    if parts.scheme.lower() not in _BACKENDS:
        raise InvalidInput(f"unsupported storage URL scheme {parts.scheme!r} in {_redact(url)}; expected one of "
                           f"{', '.join(sorted(_BACKENDS))}", "--storage")
    if parts.scheme.lower() == "sqlite" and sqlite_path(url) is None:
        raise InvalidInput(f"a SQLite URL needs a file path, e.g. sqlite:///rdq.db or sqlite:////abs/path/rdq.db "
                           f"(got {_redact(url)!r})", "--storage")


def open_store(url: str) -> Storage:
    check_storage_url(url)
    try:
        return open_storage(url)
    except (InvalidInput, ConfigurationError):  # already say what is wrong (a missing driver names its install)
        raise
    except ValueError as exc:
        raise InvalidInput(f"storage URL {_redact(url)}: {exc}", "--storage") from None


def sqlite_path(url: str) -> Path | None:
    path = url.split("://", 1)[1].split("?", 1)[0] if "://" in url else ""
    if not path.startswith("/") or path in ("/", "/:memory:"):
        return None
    return Path(path[1:])  # sqlite:///rel/rdq.db -> rel/rdq.db; sqlite:////abs/rdq.db -> /abs/rdq.db


def note_new_sqlite_file(url: str) -> None:
    """The embedded default is a file in the working directory: say so when a command is
    about to create a new, empty one (often: run from the wrong directory)."""
    if not url.lower().startswith("sqlite:"):
        return
    path = sqlite_path(url)
    if path is not None and not path.exists():
        say(f"rdq: note: there is no store at {path.resolve()}; creating a new, empty one (run from the directory "
             f"that holds yours, or pass --storage / set RDQ_STORAGE_URL)", file=sys.stderr, flush=True)


def read_payload(text: str) -> Any:
    return read_json_argument(text, "payload", files_start_with_at=True)


def read_json_argument(text: str, field: str, files_start_with_at: bool = False) -> Any:
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


def queue_list(text: str) -> list[str]:
    queues = [q.strip() for q in text.split(",") if q.strip()]
    for queue in queues:
        try:
            queue_name(queue)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return queues


def policies_from_env() -> PolicyBook:
    raw = os.environ.get("RDQ_QUEUE_POLICIES")
    try:
        return policy_book_from_config(json.loads(raw) if raw else None)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"RDQ_QUEUE_POLICIES is invalid: {exc}", "RDQ_QUEUE_POLICIES") from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def operation_rate(text: str) -> float:
    """``--rate``: the same bounds the API and the client hold an operation's rate to."""
    try:
        rate = validation.operation_rate(float(text), "--rate")
    except (ValueError, InvalidInput) as exc:
        raise argparse.ArgumentTypeError(
            f"must be a number of tasks a second in {validation.Limits.operation_rate_min:g}.."
            f"{validation.Limits.operation_rate_max:g}") from exc
    assert rate is not None
    return rate


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value
