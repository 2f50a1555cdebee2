"""Calling a Lambda target: a synchronous ``Invoke`` per attempt, its answer mapped to an outcome.

* The envelope (``envelope.py``) is the event; the client's read timeout is the run's time left
  (the task's ``timeout_seconds``, or less when the run must end sooner), in whole seconds.
  The bound function's own timeout should be no longer: a call given up while the function
  still runs is retried, and the function may then run twice.
* A returned value is the task's result. ``{"rdq_outcome": {"dead": "<reason>"}}`` dead-letters
  at once, ``{"rdq_outcome": {"snooze_seconds": N}}`` runs the task again in N seconds without
  spending a retry: a function opts in by returning either.
* ``FunctionError`` (an exception in the function, its timeout, its crash) is a failed attempt,
  retried; one whose ``errorType`` the binding names in ``dead_on_errors`` (by default
  ``PermanentError``) dead-letters at once.
* ``TooManyRequestsException`` (the function at its concurrency limit) snoozes the task for the
  ``Retry-After`` Lambda gives, else 1 to 3 s: the retry budget is not spent on a throttle.
* Any other error of the call (a missing function, no permission, no connection) is a failed
  attempt, retried: the operator may fix it in the meantime.

The worker's role needs ``lambda:InvokeFunction`` on exactly the bound functions
(``template.yaml``, ``TargetFunctionArns``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from typing import Any, Callable

from ..aws.clients import aws_client
from ..engine.handlers import Snooze, TaskContext
from .config import LambdaTarget
from .envelope import envelope_bytes
from .errors import TargetError, TargetFunctionDeadLetter, TargetFunctionError, TargetTimeout, TargetUnreachable

log = logging.getLogger("rdq.targets")

#: Kept from the run's deadline: the call ends, and its outcome is decided, before the engine's
#: watchdog would count the run as overdue.
DEADLINE_MARGIN_SECONDS = 0.5
CONNECT_TIMEOUT_SECONDS = 3.0
THROTTLE_SNOOZE_SECONDS = (1.0, 3.0)
MAX_THROTTLE_SNOOZE_SECONDS = 300.0
OUTCOME_KEY = "rdq_outcome"
ERROR_MESSAGE_CHARS = 500


class LambdaCaller:
    """The handler function of one Lambda binding (``binding.py`` registers it)."""

    def __init__(self, target: LambdaTarget, *, client_for: Callable[[int], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.clock = clock
        self._client_for = client_for or self._cached_client
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, payload: Any, ctx: TaskContext) -> Any:
        from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

        target = self.target
        started = self.clock()
        budget = math.floor(ctx.remaining_seconds() - DEADLINE_MARGIN_SECONDS)
        if budget < 1:
            raise TargetTimeout(f"{target.handler} -> {target.describe()}: less than a second left to call it")
        event = envelope_bytes(target.handler, payload, ctx, float(budget))
        try:
            answer = self._client_for(budget).invoke(FunctionName=target.function, InvocationType="RequestResponse",
                                                     Payload=event)
            data = answer["Payload"].read()
        except ClientError as exc:
            error = exc.response.get("Error") or {}
            code = str(error.get("Code") or "ClientError")
            if code == "TooManyRequestsException":
                wait = _throttle_wait(exc.response)
                log.info("%s; snoozed %gs, no retry spent", self._said(started, "throttled"), wait)
                raise Snooze(wait) from None
            raise TargetError(self._said(started, f"{code}: {error.get('Message') or exc}")) from None
        except ReadTimeoutError:
            raise TargetTimeout(self._said(started, f"no answer within the time budget ({budget}s)")) from None
        except (ConnectTimeoutError, EndpointConnectionError) as exc:
            raise TargetUnreachable(self._said(started, f"{type(exc).__name__}: {exc}")) from None
        if answer.get("FunctionError"):
            error_type, message = _function_error(data)
            said = self._said(started, f"FunctionError ({answer['FunctionError']}) {error_type}: {message}")
            if error_type in target.dead_on_errors:
                raise TargetFunctionDeadLetter(said, error_type)
            raise TargetFunctionError(said, error_type)
        try:
            value = json.loads(data) if data else None
        except ValueError:
            raise TargetError(self._said(started, "returned a payload that is not JSON")) from None
        if isinstance(value, dict) and OUTCOME_KEY in value:
            return _opted_in(value[OUTCOME_KEY], self._said(started, "returned"))
        log.info("%s -> %s returned in %.0f ms", target.handler, target.describe(), (self.clock() - started) * 1000,
                 extra={"rdq_target": {"handler": target.handler, "target": target.describe(),
                                       "latency_ms": round((self.clock() - started) * 1000, 1)}})
        return value

    def _cached_client(self, read_timeout: int) -> Any:
        """One client per whole-second read timeout: botocore fixes the timeout per client."""
        with self._lock:
            client = self._clients.get(read_timeout)
            if client is None:
                client = aws_client("lambda", connect_timeout=CONNECT_TIMEOUT_SECONDS, read_timeout=read_timeout)
                self._clients[read_timeout] = client
            return client

    def _said(self, started: float, detail: str) -> str:
        took = max(self.clock() - started, 0.0) * 1000
        return f"{self.target.handler} -> {self.target.describe()}: {detail} after {took:.0f} ms"


def _function_error(data: bytes) -> tuple[str, str]:
    """``errorType`` and ``errorMessage`` of a failed invocation's payload (any runtime's shape)."""
    try:
        body = json.loads(data) if data else {}
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return "Unknown", data[:ERROR_MESSAGE_CHARS].decode("utf-8", "replace")
    return str(body.get("errorType") or "Unknown"), str(body.get("errorMessage") or "")[:ERROR_MESSAGE_CHARS]


def _opted_in(outcome: Any, said: str) -> Any:
    if isinstance(outcome, dict) and "dead" in outcome:
        raise TargetFunctionDeadLetter(f"{said} {{\"{OUTCOME_KEY}\": {{\"dead\": ...}}}}: {outcome['dead']}",
                                       "rdq_outcome.dead")
    if isinstance(outcome, dict) and "snooze_seconds" in outcome:
        return Snooze(outcome["snooze_seconds"])  # returned: the engine snoozes; a bad number fails the attempt
    raise TargetFunctionError(f"{said} an {OUTCOME_KEY!r} that is neither {{\"dead\": ...}} nor "
                              "{\"snooze_seconds\": N}", "rdq_outcome.invalid")


def _throttle_wait(response: Any) -> float:
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    value = str(headers.get("retry-after") or response.get("retryAfterSeconds") or "").strip()
    if value.replace(".", "", 1).isdigit():
        return min(float(value), MAX_THROTTLE_SNOOZE_SECONDS)
    return random.uniform(*THROTTLE_SNOOZE_SECONDS)
