"""What a target's failure raises, so the engine's one outcome path (``rdq_core.engine.outcomes``) decides it.

A retryable failure is an ordinary exception; one that must dead-letter at once is also a
``PermanentError``. Every message names the handler, the target and how long the call took, so
an attempt's history answers "what was called, what did it say, how long did it take".
A queue policy's ``dead_on`` / ``retry_on`` may name these classes like any other exception.
"""

from __future__ import annotations

from ..errors import PermanentError, RdqError


class TargetError(RdqError):
    """A target could not be reached, or did not answer in time: retried."""


class TargetTimeout(TargetError):
    """The call's time budget (the task's timeout, or less when the run must end sooner) ran out."""


class TargetHttpError(TargetError):
    """An HTTPS target answered with a status that is retried (408, 429 without ``Retry-After``,
    5xx, or a 4xx the target is configured to retry)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class TargetRejected(TargetHttpError, PermanentError):
    """An HTTPS target answered with a 4xx that dead-letters (the default for 4xx other than 408/429)."""


class TargetRedirectRefused(TargetError, PermanentError):
    """An HTTPS target redirected to another origin, or with a method-changing status: never followed."""


class TargetFunctionError(TargetError):
    """A Lambda target's function failed (``FunctionError``): retried."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.error_type = error_type


class TargetFunctionDeadLetter(TargetFunctionError, PermanentError):
    """A Lambda target failed with an error type its binding names in ``dead_on_errors``, or returned
    ``{"rdq_outcome": {"dead": "<reason>"}}``: dead-lettered at once."""


class InvalidSignature(RdqError):
    """``verify_signature`` refused a request: no signature, a stale timestamp, or no match."""


class TargetUnreachable(TargetError):
    """No connection to the target: DNS, connect, TLS (a certificate that does not verify) or a
    broken connection before an answer. Retried: the operator may fix it in the meantime."""
