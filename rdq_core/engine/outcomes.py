"""Where an exception, a handler's result or an expired lease becomes an outcome.

Every ``Settlement`` the engine writes is decided here, by the worker hosts and the reaper alike:

* a handler's return value: ``SUCCESS`` if it can be stored, else a retryable
  ``rdq.InvalidResult`` failure (the same rules as a payload, with the 64 KiB result limit);
* ``Snooze(seconds)``, raised or returned: back to PENDING in ``seconds``, a SNOOZED attempt
  that spends no retry budget;
* ``PermanentError``, an exception the queue's ``dead_on`` names (or, with ``retry_on``, one it
  does not name) and an unknown handler dead-letter at once; any other exception, including
  panic-like ``BaseException`` s such as ``SystemExit`` or ``RecursionError``, is a retryable
  failure recorded with its type and a truncated stack; error text is made valid Unicode first;
* a handler whose timeout can never fit the host dead-letters with ``rdq.TimeoutExceedsWorker``;
* an expired lease is one ``LEASE_EXPIRED`` attempt;
* a failed attempt is retried with backoff or dead-lettered, as the ``PolicyBook`` says.

``log_outcome`` writes the one ``rdq.task`` line per outcome.
"""

from __future__ import annotations

import logging
import random
import traceback
from typing import TYPE_CHECKING

from ..errors import InvalidInput, PermanentError
from .snooze import Snooze
from ..model import ClaimedTask, ErrorInfo, Outcome, Settlement, Task, TaskStatus
from ..validation import Limits, json_value, repaired_text

if TYPE_CHECKING:
    from .retry import PolicyBook

#: One line per task outcome (``rdq worker``, ``rdq dev``, the Lambda worker, the reaper).
task_log = logging.getLogger("rdq.task")

UNKNOWN_HANDLER = "rdq.UnknownHandler"
INVALID_RESULT = "rdq.InvalidResult"
LEASE_EXPIRED = "rdq.LeaseExpired"
TIMEOUT_EXCEEDS_WORKER = "rdq.TimeoutExceedsWorker"


# -- deciding ---------------------------------------------------------------------------------
def from_result(item: ClaimedTask, result: object, policies: PolicyBook) -> Settlement:
    """A handler returned ``result``."""
    problem = result_problem(result)
    if problem is not None:
        return failed_attempt(policies, item.task, item.claim_token, Outcome.RETRYABLE_FAILURE,
                              truncated_error(INVALID_RESULT, problem))
    return Settlement(item.task.id, item.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)


def from_exception(item: ClaimedTask, exc: BaseException, policies: PolicyBook) -> Settlement:
    """A handler raised ``exc`` (call it from the ``except`` block: the stack is read here)."""
    if isinstance(exc, Snooze):
        return snoozed(item, exc)
    permanent = isinstance(exc, PermanentError) or policies.gives_up_on(item.task, exc)
    outcome = Outcome.PERMANENT_FAILURE if permanent else Outcome.RETRYABLE_FAILURE
    return failed_attempt(policies, item.task, item.claim_token, outcome, error_from_exception(exc))


def snoozed(item: ClaimedTask, snooze: Snooze) -> Settlement:
    """The handler asked to run again in ``snooze.seconds``: PENDING then, budget unspent."""
    return Settlement(item.task.id, item.claim_token, Outcome.SNOOZED, TaskStatus.PENDING,
                      retry_delay_seconds=snooze.seconds)


def unknown_handler(item: ClaimedTask) -> Settlement:
    error = truncated_error(UNKNOWN_HANDLER, f"no handler named {item.task.handler!r} is registered in this worker")
    return Settlement(item.task.id, item.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=error)


def timeout_exceeds_worker_message(handler: str, timeout_seconds: float, needed: float, settle_margin: float,
                                   longest_run_seconds: float, longest_run_reason: str) -> str:
    return (
        f"handler {handler!r} has timeout_seconds={timeout_seconds:g}, so a run needs "
        f"{needed:g}s with the {settle_margin:g}s settle margin, but this worker can give a task "
        f"at most {longest_run_seconds:g}s"
        + (f" ({longest_run_reason})" if longest_run_reason else "")
        + "; lower the handler's timeout or raise the worker's"
    )


def timeout_exceeds_worker(item: ClaimedTask, message: str) -> Settlement:
    """Dead at once: released instead, the task would be claimed and released forever."""
    return Settlement(item.task.id, item.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                      error=truncated_error(TIMEOUT_EXCEEDS_WORKER, message))


def lease_expired(item: ClaimedTask, policies: PolicyBook) -> Settlement:
    """A holder that never settled: an ordinary failed attempt, under the same policy."""
    held_for = (item.lease_expires_at - item.claimed_at).total_seconds()
    error = truncated_error(LEASE_EXPIRED, f"lease of {held_for:.1f}s expired before the worker settled the task")
    return failed_attempt(policies, item.task, item.claim_token, Outcome.LEASE_EXPIRED, error)


def failed_attempt(
    policies: PolicyBook,
    task: Task,
    claim_token: str,
    outcome: Outcome,
    error: ErrorInfo,
    rng: random.Random | None = None,
) -> Settlement:
    """A failed attempt (retryable, permanent or lease-expired): retry after backoff, or dead.

    ``task.attempt_count`` is the budget used *before* this attempt; the attempt being settled
    spends one more.
    """
    delay = None if outcome is Outcome.PERMANENT_FAILURE else policies.retry_delay(task, rng)
    if delay is None:
        return Settlement(task.id, claim_token, outcome, TaskStatus.DEAD, error=error)
    return Settlement(task.id, claim_token, outcome, TaskStatus.PENDING, retry_delay_seconds=delay, error=error)


# -- describing a failure ---------------------------------------------------------------------
def error_from_exception(exc: BaseException) -> ErrorInfo:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    # Free the failed handler's locals first: after a MemoryError they hold the hoard, and
    # formatting needs memory. Line numbers survive; frames still executing are skipped.
    traceback.clear_frames(exc.__traceback__)
    # A poison exception may fail to describe itself (a raising __str__); that must not take
    # the worker down with it.
    try:
        message = str(exc)
    except Exception as describe_error:  # noqa: BLE001 - a poison exception, see above
        message = f"<str() of the exception failed: {type(describe_error).__name__}>"
    try:
        stack = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    except Exception as describe_error:  # noqa: BLE001 - a poison exception, see above
        stack = f"<the traceback could not be formatted: {type(describe_error).__name__}>"
    return truncated_error(name, message, stack)


def truncated_error(kind: str, message: str, stack: str | None = None) -> ErrorInfo:
    """The one way the engine builds an attempt's error: bounded, and valid text on every store."""
    kind = repaired_text(kind)
    message = repaired_text(message[: Limits.error_message_chars])
    if stack is not None:
        stack = repaired_text(stack)
    if stack is not None and len(stack) > Limits.error_stack_chars:
        # Keep the tail: the innermost frames say where it broke.
        stack = "…" + stack[-(Limits.error_stack_chars - 1):]
    return ErrorInfo(kind, message, stack)


def result_problem(result: object) -> str | None:
    """Why a handler's return value cannot be stored, or None. The same rules as a payload
    (plain JSON, no NUL, no lone surrogate, bounded depth) with the 64 KiB result limit."""
    try:
        json_value(result, Limits.result_bytes, "handler result")
    except InvalidInput as exc:
        return str(exc)[: Limits.error_message_chars]
    # RecursionError: nesting too deep to encode; any other error: a poison value (e.g. a dict
    # subclass whose items() raises). Either way a failed attempt, never a dead claim loop.
    except Exception as exc:  # noqa: BLE001 - see above
        return f"handler result is not JSON-serialisable: {type(exc).__name__}: {exc}"[: Limits.error_message_chars]
    return None


# -- telling ----------------------------------------------------------------------------------
def log_outcome(task: Task, settlement: Settlement, policies: PolicyBook, seconds: float | None) -> None:
    """One line per outcome: readable on a terminal, and every field in ``rdq_task`` for the
    JSON formats. Dead-lettering is a WARNING: someone has to look at it."""
    level = logging.WARNING if settlement.status is TaskStatus.DEAD else logging.INFO
    if not task_log.isEnabledFor(level):  # the hot path of a drain: build nothing
        return
    error = settlement.error
    fields = {
        "task_id": task.id,
        "queue": task.queue,
        "handler": task.handler,
        "try": task.attempt_count + 1,
        "max_tries": policies.for_task(task).max_attempts,
        "outcome": settlement.outcome.value,
        "status": settlement.status.value,
        "duration_ms": None if seconds is None else round(seconds * 1000, 1),
        "error_type": error.type if error else None,
    }
    took = "" if seconds is None else f" in {_human_duration(seconds)}"
    what = {TaskStatus.SUCCEEDED: "", TaskStatus.DEAD: "; dead-lettered"}.get(
        settlement.status, f"; retry in {_human_duration(settlement.retry_delay_seconds)}")
    if settlement.outcome is Outcome.SNOOZED:
        what = f"; runs again in {_human_duration(settlement.retry_delay_seconds)}, no retry spent"
    because = f": {error.type}: {error.message[:200]}" if error else ""
    task_log.log(
        level, "%s %s/%s try %d/%d %s%s%s%s", task.id, task.queue, task.handler, fields["try"], fields["max_tries"],
        settlement.outcome.value, took, because, what, extra={"rdq_task": fields},
    )


def _human_duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
