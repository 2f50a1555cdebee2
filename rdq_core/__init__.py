"""rdq: a retry-and-dead-letter task queue for AWS Lambda on the datastore you already run.

The engine (this package) knows nothing of Lambda. Public surface:

* ``handler`` / ``PermanentError`` / ``Snooze`` -- register user code, dead-letter on purpose,
  run again later without spending a retry;
* ``Client`` -- enqueue, inspect and operate from Python, on a store;
* ``HttpClient`` -- the same interface over a deployed rdq API (SigV4, API key or bearer token);
* ``verify_signature`` -- check, in a Python receiver, that a request to an HTTPS target came
  from rdq (``docs/targets.md``);
* ``open_storage`` -- the storage SPI (``rdq_core.storage.spi``) behind every host;
* ``rdq_core.compliance`` -- the kit every backend must pass.
"""

from typing import TYPE_CHECKING

from .client import Client
from .errors import (
    ApiUnavailable,
    ClaimLost,
    ConfigurationError,
    InvalidCursor,
    InvalidInput,
    NotAuthorized,
    PermanentError,
    RdqError,
    StaleClaim,
    StorageUnavailable,
    TaskConflict,
    TaskNotFound,
    UnsupportedOperation,
)
from .engine.handlers import Snooze, TaskContext, handler, registry
from .model import Attempt, Backoff, ErrorInfo, Outcome, QueueStats, Task, TaskStatus
from .engine.retry import PolicyBook, RetryPolicy
from .storage import open_storage
from .targets.errors import InvalidSignature
from .targets.signing import verify_signature

if TYPE_CHECKING:
    from .http_client import HttpClient



def __getattr__(name: str) -> object:
    # HttpClient (and http.client with it) is imported on first use: a Lambda function or a
    # worker never needs it, and it is a tenth of their cold import.
    if name == "HttpClient":
        from .http_client import HttpClient

        return HttpClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ApiUnavailable", "Attempt", "Backoff", "ClaimLost", "Client", "ConfigurationError", "ErrorInfo", "HttpClient",
    "InvalidCursor", "InvalidInput", "InvalidSignature", "NotAuthorized", "Outcome", "PermanentError", "PolicyBook",
    "QueueStats", "RdqError", "RetryPolicy", "Snooze", "StaleClaim", "StorageUnavailable", "Task", "TaskConflict", "TaskContext",
    "TaskNotFound", "TaskStatus", "UnsupportedOperation", "handler", "open_storage", "registry",
    "verify_signature",
]
