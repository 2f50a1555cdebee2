"""Exceptions raised by the engine and by every storage backend."""

from __future__ import annotations

from typing import Iterable


class RdqError(Exception):
    """Base class of every rdq error."""


class PermanentError(RdqError):
    """Raised by a handler to dead-letter its task at once, without spending more retries."""


class StaleClaim(RdqError):
    """A post-claim write presented a claim token that no longer (or never) owned the task.

    Carries the ids that were refused; nothing was written for them. In a batch call, the
    items with a valid token were applied before this was raised.
    """

    def __init__(self, task_ids: Iterable[str]):
        self.task_ids = tuple(task_ids)
        super().__init__(f"stale or unknown claim token for task(s): {', '.join(self.task_ids)}")


class ClaimLost(StaleClaim):
    """``ctx.transaction()`` could not complete its task: the claim was lost before the commit
    (the lease expired and the reaper took the task back). The whole transaction was rolled
    back, the handler's own writes included; the attempt stands as the reaper recorded it
    (LEASE_EXPIRED) and the task runs again under its retry policy."""

    def __init__(self, task_id: str):
        self.task_ids = (task_id,)
        RdqError.__init__(self, f"task {task_id!r}: the claim was lost before the transaction committed (its "
                          "lease expired and it was reaped); everything in the transaction was rolled back")


class TaskNotFound(RdqError):
    def __init__(self, task_id: str, *, what: str = "task"):
        self.task_id = task_id
        super().__init__(f"{what} {task_id!r} not found")


class ScheduleNotFound(TaskNotFound):
    """No schedule by that name. A ``TaskNotFound`` so that every caller maps it as it maps a
    missing task (404, exit code 3)."""

    def __init__(self, name: str) -> None:
        Exception.__init__(self, f"no schedule named {name!r}")
        self.task_id = name
        self.name = name


class TaskConflict(RdqError):
    """The request conflicts with the task's current state (e.g. cancel of a non-PENDING task,
    or an id already used on another queue)."""


class InvalidInput(RdqError, ValueError):
    """Input rejected by validation; nothing was written. ``field`` names the offending input."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class InvalidCursor(InvalidInput):
    def __init__(self, message: str = "cursor is malformed or was not issued by this queue"):
        super().__init__(message, field="cursor")


class UnsupportedOperation(RdqError, TypeError):
    """The call asks for something this backend or host cannot do (e.g. ``connection=`` on a
    store that cannot join a caller's transaction). A programming error: nothing was written."""


class ConfigurationError(RdqError, ValueError):
    """A storage URL, policy file, handler registration or host setting is malformed."""


class StorageUnavailable(RdqError):
    """The backend could not be reached; the operation may be retried."""


class SchemaMissing(RdqError):
    """The store holds no rdq schema (or an older one than this code needs): run ``rdq migrate``."""

    def __init__(self, detail: str = ""):
        super().__init__(
            "this store has no rdq schema, or an older one than this version needs: run `rdq migrate` "
            "(rdq --storage URL migrate) once, before workers and producers use it" + (f" ({detail})" if detail else ""))


class NotAuthorized(RdqError):
    """The API refused the caller's credentials (HTTP 401 or 403): missing, wrong or not allowed."""


class OperationStillRunning(RdqError, TimeoutError):
    """``wait_for_operation`` gave up: the operation had not finished within the time allowed. It
    goes on; wait again, or cancel it."""


class ApiUnavailable(StorageUnavailable):
    """The rdq API could not be reached, or kept answering 429/5xx until the retry budget ran
    out. A ``StorageUnavailable``, so code written against ``Client`` handles both alike."""
