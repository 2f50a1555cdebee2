"""rdq: a retry-and-dead-letter task queue for AWS Lambda on the datastore you already run.

The engine (this package) knows nothing of Lambda. Public surface:

* ``handler`` / ``PermanentError`` -- register user code and dead-letter on purpose;
* ``Client`` -- enqueue, inspect and operate from Python;
* ``open_storage`` -- the storage SPI (``rdq_core.storage.spi``) behind every host;
* ``rdq_core.compliance`` -- the kit every backend must pass.
"""

from .client import Client
from .errors import (
    InvalidCursor,
    InvalidInput,
    PermanentError,
    RdqError,
    StaleClaim,
    StorageUnavailable,
    TaskConflict,
    TaskNotFound,
)
from .handlers import TaskContext, handler, registry
from .model import Attempt, Backoff, ErrorInfo, Outcome, QueueStats, Task, TaskStatus
from .retry import PolicyBook, RetryPolicy
from .storage import open_storage

__all__ = [
    "Attempt", "Backoff", "Client", "ErrorInfo", "InvalidCursor", "InvalidInput", "Outcome",
    "PermanentError", "PolicyBook", "QueueStats", "RdqError", "RetryPolicy", "StaleClaim",
    "StorageUnavailable", "Task", "TaskConflict", "TaskContext", "TaskNotFound", "TaskStatus",
    "handler", "open_storage", "registry",
]
