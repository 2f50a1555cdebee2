"""The operator's bindings of handler names to targets: parsed and checked before anything runs.

A binding file (``rdq-targets.json``, ``RDQ_TARGETS``) is one JSON object, handler name to target::

    {"notify": {"https": "https://hooks.example.com/rdq", "secret": "ssm:/rdq/notify-secret",
                "timeout_seconds": 20},
     "resize_image": {"lambda": "arn:aws:lambda:eu-west-1:123456789012:function:resize:live"}}

Every URL and function a worker can call is written here, by the operator. A producer only names
a handler; nothing in a task (payload, headers, id) is ever read as an address. An unknown key,
a URL that is not ``https`` (``http`` only to a loopback host, for local work), credentials in a
URL, a function that is not a Lambda function name or ARN: each is a ``ConfigurationError``
naming the handler and the key, raised when the host starts.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from ..errors import ConfigurationError, InvalidInput
from ..engine.handlers import DEFAULT_TIMEOUT_SECONDS
from ..validation import Limits, handler_name

#: The environment variable holding bindings as JSON (the template's ``Targets`` parameter).
TARGETS_VARIABLE = "RDQ_TARGETS"
#: The environment variable naming a bindings file (``rdq worker``, ``rdq dev``).
TARGETS_FILE_VARIABLE = "RDQ_TARGETS_FILE"
DEFAULT_TARGETS_FILE = "rdq-targets.json"

#: Lambda's longest invocation; no target call can need more.
MAX_TIMEOUT_SECONDS = 900.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0
DEFAULT_MAX_RESULT_BYTES = 16 * 1024
#: A Python receiver raising ``PermanentError`` (the class name Lambda reports) dead-letters at once.
DEFAULT_DEAD_ON_ERRORS = frozenset({"PermanentError"})

_HTTPS_KEYS = frozenset({"https", "secret", "timeout_seconds", "connect_timeout_seconds", "on_4xx", "retry_statuses",
                         "max_result_bytes", "ca_file"})
_LAMBDA_KEYS = frozenset({"lambda", "timeout_seconds", "dead_on_errors"})
_LOOPBACK_NAMES = frozenset({"localhost"})
_SECRET_KINDS = ("env", "ssm", "secretsmanager")
_FUNCTION_NAME = r"[A-Za-z0-9_-]{1,64}"
_QUALIFIER = r"(?::(?:\$LATEST|[A-Za-z0-9_-]{1,128}))?"
_FUNCTION = re.compile(rf"(?:arn:aws[a-z-]*:lambda:[a-z0-9-]+:\d{{12}}:function:)?{_FUNCTION_NAME}{_QUALIFIER}")


@dataclass(frozen=True)
class SecretRef:
    """Where a signing secret comes from: ``env:NAME``, ``ssm:NAME`` (a SecureString is decrypted),
    ``secretsmanager:NAME-OR-ARN``, or the text itself (for local work only: it then sits in the
    configuration in clear)."""

    kind: str  # "literal" | "env" | "ssm" | "secretsmanager"
    name: str

    @classmethod
    def parse(cls, text: str) -> SecretRef:
        kind, sep, name = text.partition(":")
        if sep and kind in _SECRET_KINDS:
            if not name:
                raise ValueError(f"{kind}: needs a name after the colon")
            return cls(kind, name)
        return cls("literal", text)

    def describe(self) -> str:
        """For messages: never the secret itself."""
        return "a literal secret" if self.kind == "literal" else f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class HttpsTarget:
    handler: str
    url: str
    secrets: tuple[SecretRef, ...]
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS
    #: A 4xx other than 408 and 429 dead-letters (``"on_4xx": "dead"``, the default) or is retried.
    dead_on_4xx: bool = True
    #: 4xx statuses retried even when ``dead_on_4xx`` (``"retry_statuses": [409, 425]``).
    retry_statuses: frozenset[int] = frozenset()
    #: The most bytes of a 2xx body kept as the task's result.
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    #: A PEM file of CA certificates trusted for this target instead of the system's (a private CA).
    ca_file: str | None = None

    def describe(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{parts.path or '/'}"


@dataclass(frozen=True)
class LambdaTarget:
    handler: str
    #: A function name or ARN, optionally ``:qualifier`` (a version or alias), as ``Invoke`` takes it.
    function: str
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    #: Error types (the ``errorType`` a failed invocation reports) that dead-letter at once.
    dead_on_errors: frozenset[str] = DEFAULT_DEAD_ON_ERRORS

    def describe(self) -> str:
        return f"lambda {self.function}"


Target = HttpsTarget | LambdaTarget


def parse_targets(data: object, source: str = TARGETS_VARIABLE) -> dict[str, Target]:
    """Bindings from their decoded JSON; ``ConfigurationError`` naming ``source`` when malformed."""
    if not isinstance(data, Mapping):
        raise ConfigurationError(f"{source}: expected a JSON object of handler name to target")
    targets: dict[str, Target] = {}
    for name, spec in data.items():
        try:
            handler_name(name)
        except InvalidInput:
            raise ConfigurationError(f"{source}: {name!r} is not a handler name "
                                     "(^[a-z0-9][a-z0-9._-]{0,119}$)") from None
        where = f"{source}: target {name!r}"
        if not isinstance(spec, Mapping):
            raise ConfigurationError(f"{where}: expected an object with \"https\" or \"lambda\"")
        kinds = [kind for kind in ("https", "lambda") if kind in spec]
        if len(kinds) != 1:
            raise ConfigurationError(f"{where}: needs exactly one of \"https\" and \"lambda\"")
        targets[name] = _https(name, spec, where) if kinds == ["https"] else _lambda(name, spec, where)
    return targets


def targets_from_json(text: str, source: str = TARGETS_VARIABLE) -> dict[str, Target]:
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(f"{source} is not valid JSON: {exc}") from None
    return parse_targets(data, source)


def targets_from_file(path: str | Path) -> dict[str, Target]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot read the targets file {path}: {exc.strerror or exc}") from None
    return targets_from_json(text, str(path))


def load_targets(file: str | Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Target]:
    """A local host's bindings: ``RDQ_TARGETS`` and a file (``file``, else ``$RDQ_TARGETS_FILE``,
    else ``./rdq-targets.json`` when it exists). A handler bound in both is an error."""
    environ = os.environ if environ is None else environ
    targets = targets_from_json(environ.get(TARGETS_VARIABLE, ""))
    path = file or environ.get(TARGETS_FILE_VARIABLE) or None
    if path is None and Path(DEFAULT_TARGETS_FILE).is_file():
        path = DEFAULT_TARGETS_FILE
    if path is not None:
        for name, target in targets_from_file(path).items():
            if name in targets:
                raise ConfigurationError(f"target {name!r} is bound both in {TARGETS_VARIABLE} and in {path}")
            targets[name] = target
    return targets


# -- one binding ------------------------------------------------------------------------------
def _https(name: str, spec: Mapping[str, Any], where: str) -> HttpsTarget:
    _no_unknown_keys(spec, _HTTPS_KEYS, where)
    url = spec["https"]
    if not isinstance(url, str):
        raise ConfigurationError(f"{where}: \"https\" must be a URL string")
    _check_url(url, where)
    raw_secrets = spec.get("secret")
    if isinstance(raw_secrets, str):
        raw_secrets = [raw_secrets]
    if not isinstance(raw_secrets, list) or not 1 <= len(raw_secrets) <= 2 or not all(
            isinstance(s, str) and s for s in raw_secrets):
        raise ConfigurationError(f"{where}: \"secret\" must be a secret (or a reference: env:NAME, ssm:NAME, "
                                 "secretsmanager:ID), or a list of two while rotating")
    try:
        secrets = tuple(SecretRef.parse(s) for s in raw_secrets)
    except ValueError as exc:
        raise ConfigurationError(f"{where}: \"secret\": {exc}") from None
    on_4xx = spec.get("on_4xx", "dead")
    if on_4xx not in ("dead", "retry"):
        raise ConfigurationError(f"{where}: \"on_4xx\" must be \"dead\" or \"retry\"")
    retry_statuses = spec.get("retry_statuses", [])
    if not isinstance(retry_statuses, list) or not all(
            type(s) is int and 400 <= s <= 499 for s in retry_statuses):
        raise ConfigurationError(f"{where}: \"retry_statuses\" must be a list of 4xx status codes")
    max_result = spec.get("max_result_bytes", DEFAULT_MAX_RESULT_BYTES)
    # Under the result limit with room for JSON escaping of a text body.
    if type(max_result) is not int or not 0 <= max_result <= Limits.result_bytes // 2:
        raise ConfigurationError(f"{where}: \"max_result_bytes\" must be an integer in 0..{Limits.result_bytes // 2}")
    ca_file = spec.get("ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not Path(ca_file).is_file()):
        raise ConfigurationError(f"{where}: \"ca_file\" must be the path of a PEM file that exists")
    return HttpsTarget(
        handler=name, url=url, secrets=secrets,
        timeout_seconds=_seconds(spec, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS, where),
        connect_timeout_seconds=_seconds(spec, "connect_timeout_seconds", DEFAULT_CONNECT_TIMEOUT_SECONDS, where),
        dead_on_4xx=on_4xx == "dead", retry_statuses=frozenset(retry_statuses), max_result_bytes=max_result,
        ca_file=ca_file,
    )


def _lambda(name: str, spec: Mapping[str, Any], where: str) -> LambdaTarget:
    _no_unknown_keys(spec, _LAMBDA_KEYS, where)
    function = spec["lambda"]
    if not isinstance(function, str) or not _FUNCTION.fullmatch(function):
        raise ConfigurationError(f"{where}: \"lambda\" must be a function name or ARN, optionally with "
                                 ":qualifier (a version or alias)")
    dead_on = spec.get("dead_on_errors", sorted(DEFAULT_DEAD_ON_ERRORS))
    if not isinstance(dead_on, list) or not all(isinstance(e, str) and e for e in dead_on):
        raise ConfigurationError(f"{where}: \"dead_on_errors\" must be a list of error type names")
    return LambdaTarget(handler=name, function=function,
                        timeout_seconds=_seconds(spec, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS, where),
                        dead_on_errors=frozenset(dead_on))


def _no_unknown_keys(spec: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigurationError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                                 f"known: {', '.join(sorted(known))}")


def _seconds(spec: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = spec.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_SECONDS:
        raise ConfigurationError(f"{where}: \"{key}\" must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS:g}]")
    return float(value)


def _check_url(url: str, where: str) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"{where}: \"https\" is not a valid URL: {exc}") from None
    if not url.isascii() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ConfigurationError(f"{where}: \"https\" must be ASCII without spaces or control characters "
                                 "(percent-encode the rest; an IDN host in its xn-- form)")
    if not parts.hostname:
        raise ConfigurationError(f"{where}: \"https\" needs a host")
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(f"{where}: \"https\" must not carry credentials; requests are signed with \"secret\"")
    if parts.fragment:
        raise ConfigurationError(f"{where}: \"https\" must not have a #fragment")
    if parts.scheme == "https":
        return
    if parts.scheme == "http" and _is_loopback(parts.hostname):
        return  # local work only: nothing leaves the machine
    raise ConfigurationError(f"{where}: \"https\" must be an https:// URL (http:// only to a loopback host); "
                             f"got scheme {parts.scheme!r}" + (f" on port {port}" if port else ""))


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    import ipaddress  # only for an http:// binding; kept out of every worker's import

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
