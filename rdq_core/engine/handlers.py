"""The handler registry and the context a handler runs with.

```python
from rdq_core import handler, PermanentError

@handler("send_email", timeout_seconds=20)
def send_email(payload, ctx):
    ...  # raise PermanentError to dead-letter at once; any other exception is retried
    # raise Snooze(60) (or return Snooze(60)) to run again in a minute without spending a retry
```

``timeout_seconds`` is the longest one run may take. A worker starts a task only if that much
time is left before its deadline (the Lambda invocation's end), so it never starts what it
cannot finish; a long-running worker stops renewing the lease once it is spent, so a hung
handler ends as LEASE_EXPIRED instead of holding its task forever.

An ``async def`` handler runs to completion on the worker thread that took its task, in an event
loop of its own (``asyncio.run``), and is cancelled when its time is up (``timeout_seconds``, or
less when the invocation ends sooner): the attempt then fails with ``TimeoutError`` and is retried
like any failure. Concurrency comes from the worker (``--concurrency``, ``HandlerConcurrency``),
not from sharing one loop; ``ctx.extend_lease()`` is a short blocking call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping

from ..errors import ConfigurationError, UnsupportedOperation
from .snooze import Snooze as Snooze  # re-exported: a handler's way to say "again later"
from ..validation import TRACEPARENT_HEADER, TRACESTATE_HEADER, handler_name

if TYPE_CHECKING:  # for the context's types only: transactions sits above this module
    from .transactions import Completion, HandlerTransaction

DEFAULT_TIMEOUT_SECONDS = 10.0

HandlerFunc = Callable[[Any, "TaskContext"], Any]


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    func: HandlerFunc
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS


class HandlerRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}
        self._lock = threading.Lock()

    def register(self, name: str, func: HandlerFunc, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        handler_name(name)
        if timeout_seconds <= 0:
            raise ConfigurationError("timeout_seconds must be positive")
        with self._lock:
            existing = self._specs.get(name)
            if existing is not None and _registered(existing.func) is not func:
                raise ConfigurationError(f"handler {name!r} is already registered by {existing.func.__module__}")
            if existing is not None and existing.timeout_seconds == float(timeout_seconds):
                return
            runs = _run_to_completion(name, func) if inspect.iscoroutinefunction(func) else func
            self._specs[name] = HandlerSpec(name, runs, float(timeout_seconds))

    def get(self, name: str) -> HandlerSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def load_modules(self, modules: str | Iterable[str]) -> None:
        """Import handler modules (``RDQ_HANDLERS``: comma-separated); their decorators register."""
        if isinstance(modules, str):
            modules = [m.strip() for m in modules.split(",")]
        for module in modules:
            if module:
                importlib.import_module(module)


def _registered(func: HandlerFunc) -> HandlerFunc:
    """The function as its author registered it (an ``async def`` is stored wrapped)."""
    return getattr(func, "__rdq_async__", func)


def _run_to_completion(name: str, func: Callable[[Any, TaskContext], Awaitable[Any]]) -> HandlerFunc:
    """An ``async def`` handler as the worker calls it: synchronously, on the worker's thread."""

    @functools.wraps(func)
    def run(payload: Any, ctx: TaskContext) -> Any:
        return run_awaitable(name, func(payload, ctx), ctx)

    run.__rdq_async__ = func  # type: ignore[attr-defined]
    return run


def is_async(func: HandlerFunc) -> bool:
    """Registered as an ``async def``: it cancels itself at its deadline."""
    return getattr(func, "__rdq_async__", None) is not None


def run_awaitable(name: str, awaitable: Awaitable[Any], ctx: TaskContext) -> Any:
    """Await what a handler returned, in an event loop of its own on this thread, until the run's
    deadline (``ctx``): then it is cancelled and ``TimeoutError`` raised."""
    import asyncio  # here, not at the top: most workers run no coroutine, and it is a tenth of their start

    seconds = ctx.remaining_seconds()
    scopes: list[asyncio.Timeout] = []

    async def bounded() -> Any:
        async with asyncio.timeout(seconds) as scope:
            scopes.append(scope)
            return await awaitable

    try:
        return asyncio.run(bounded())
    except TimeoutError:
        if not (scopes and scopes[0].expired()):
            raise  # the handler's own
        raise TimeoutError(f"async handler {name!r} was cancelled at its deadline, {seconds:.3g}s after it "
                           "started (its timeout_seconds, or the invocation's end if sooner)") from None


#: The process-wide registry the ``@handler`` decorator writes to.
registry = HandlerRegistry()


def handler(name: str, *, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> Callable[[HandlerFunc], HandlerFunc]:
    def decorate(func: HandlerFunc) -> HandlerFunc:
        registry.register(name, func, timeout_seconds)
        return func

    return decorate


class TaskContext:
    """What a handler knows about its run: ids, attempt, time left, and lease renewal."""

    def __init__(
        self,
        *,
        task_id: str,
        queue: str,
        attempt: int,
        redrive_count: int,
        headers: Mapping[str, str],
        deadline: float,
        extend: Callable[[float | None], None],
        completion: Completion | None = None,
    ) -> None:
        self.task_id = task_id
        self.queue = queue
        #: 1-based attempt within the current retry budget (redrive starts a new budget).
        self.attempt = attempt
        self.redrive_count = redrive_count
        self.headers = dict(headers)
        #: The W3C ``traceparent`` this run belongs to, or None: the run's own span when the worker
        #: opened one (OpenTelemetry in use), else the context stored at enqueue. A handler without
        #: OpenTelemetry passes it on (an HTTP header, a child task) to continue the trace.
        self.traceparent: str | None = self.headers.get(TRACEPARENT_HEADER)
        #: The W3C ``tracestate`` stored with it, or None.
        self.tracestate: str | None = self.headers.get(TRACESTATE_HEADER)
        self._deadline = deadline
        self._extend = extend
        self._completion = completion

    def remaining_seconds(self) -> float:
        """Seconds left before this run must be over (monotonic clock)."""
        return max(0.0, self._deadline - time.monotonic())

    def extend_lease(self, seconds: float | None = None) -> None:
        """Renew this task's lease now (raises StaleClaim if the task was taken away)."""
        if self._completion is not None and self._completion.in_transaction:
            # The renewal would wait on the transaction's own write lock (SQLite) or for the
            # connection it holds (a pool bounded to one): refuse at once rather than stall.
            raise UnsupportedOperation("ctx.extend_lease() inside ctx.transaction(): renew the lease before "
                                       "opening the transaction")
        self._extend(seconds)

    # -- exactly-once effects (rdq_core/engine/transactions.py, docs/handlers.md) -------------------
    def transaction(self, connection: Any = None) -> AbstractContextManager[HandlerTransaction]:
        """``with ctx.transaction() as tx:`` -- the handler's writes on ``tx.connection`` and this
        task's completion (SUCCEEDED, with ``tx.result``) commit together, fenced by the claim;
        ``ClaimLost`` if the lease was lost meanwhile (everything rolled back). ``connection``: the
        application's own (a psycopg 3 or sqlite3 connection, no transaction in progress), else
        one of the store's. ``UnsupportedOperation`` on a store that cannot (Redis, MongoDB)."""
        if self._completion is None:
            raise UnsupportedOperation("ctx.transaction() needs a worker that holds this task's claim")
        return self._completion.transaction(connection)
