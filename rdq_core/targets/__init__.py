"""Targets: a handler name the operator binds to a Lambda function or an HTTPS endpoint.

A task for a bound name runs like any other (the same claim, lease, timeout, retries, DLQ,
history, flow control); its run is one call of the target with the task's envelope, in whatever
language the target is written. Bindings come only from the operator (``RDQ_TARGETS``, the
template's ``Targets`` parameter, ``rdq-targets.json``); a producer names a handler, never an
address. ``docs/targets.md`` is the guide; the modules:

* ``config.py``: the bindings, parsed and checked;
* ``binding.py``: a binding as a registry entry;
* ``envelope.py``: what a target receives;
* ``https.py`` / ``lambda_invoke.py``: one call, and how its answer becomes an outcome;
* ``signing.py``: the HMAC-SHA256 signature and ``verify_signature`` for Python receivers;
* ``secret_refs.py``: signing secrets from the environment, SSM or Secrets Manager;
* ``errors.py``: what a failed call raises.
"""

from typing import TYPE_CHECKING

from .errors import (
    InvalidSignature,
    TargetError,
    TargetFunctionDeadLetter,
    TargetFunctionError,
    TargetHttpError,
    TargetRedirectRefused,
    TargetRejected,
    TargetTimeout,
    TargetUnreachable,
)
from .signing import signature, signature_header, verify_signature

if TYPE_CHECKING:
    from .binding import TargetHandler, bind_targets
    from .config import (
        HttpsTarget,
        LambdaTarget,
        SecretRef,
        Target,
        load_targets,
        parse_targets,
        targets_from_file,
        targets_from_json,
    )

_LAZY = {"TargetHandler": "binding", "bind_targets": "binding", "HttpsTarget": "config", "LambdaTarget": "config",
         "SecretRef": "config", "Target": "config", "load_targets": "config", "parse_targets": "config",
         "targets_from_file": "config", "targets_from_json": "config"}


def __getattr__(name: str) -> object:
    # The bindings' parsing is imported on first use: ``import rdq_core`` (for verify_signature,
    # or a worker with no targets) does not pay for it.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)

__all__ = [
    "HttpsTarget", "InvalidSignature", "LambdaTarget", "SecretRef", "Target", "TargetError",
    "TargetFunctionDeadLetter", "TargetFunctionError", "TargetHandler", "TargetHttpError", "TargetRedirectRefused",
    "TargetRejected", "TargetTimeout", "TargetUnreachable", "bind_targets", "load_targets", "parse_targets",
    "signature", "signature_header", "targets_from_file", "targets_from_json", "verify_signature",
]
