"""Asynchronous worker invocations: fan-out from a busy worker and wake-ups from the API.

Both use ``lambda:InvokeFunction`` with ``InvocationType=Event`` on the worker function, so the
caller never waits for the work. Bounds:

* fan-out: a *scheduled* worker invokes at most ``MaxWorkerConcurrency - 1`` extra workers
  (it is one itself), and invoked workers never fan out again, so there is no chain reaction.
  The worker's reserved concurrency is the same number, which also bounds database connections;
* wake-up: at most one per ``RDQ_WAKE_DEBOUNCE_SECONDS`` per API container.

Invocations are best-effort: a failure is logged and the next schedule tick picks the work up.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any, Callable, Literal, Protocol, Sequence

log = logging.getLogger("rdq.lambda_host.invoker")

FANOUT_SOURCE = "rdq.fanout"
WAKE_SOURCE = "rdq.api"


class LambdaInvokeClient(Protocol):
    """The one call made on boto3's Lambda client (the dev host stands in for it locally)."""

    def invoke(self, *, FunctionName: str, InvocationType: Literal["Event"], Payload: bytes) -> Any: ...


class WorkerInvoker:
    def __init__(self, client: LambdaInvokeClient | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._last_wake = -math.inf
        self._lock = threading.Lock()

    @property
    def client(self) -> LambdaInvokeClient:
        if self._client is None:
            import boto3  # in the Lambda runtime; imported lazily to keep cold starts short

            self._client = boto3.client("lambda")
        return self._client

    @client.setter
    def client(self, value: LambdaInvokeClient | None) -> None:
        self._client = value

    def fan_out(self, function: str, queues: Sequence[str], extra_workers: int) -> int:
        """Start ``extra_workers`` asynchronous workers; returns how many invocations were accepted."""
        started = 0
        for index in range(extra_workers):
            event = {"source": FANOUT_SOURCE, "detail-type": "rdq.fanout", "detail": {"queues": list(queues), "index": index}}
            if self._invoke(function, event):
                started += 1
        return started

    def wake(self, function: str, queues: Sequence[str], debounce_seconds: float) -> bool:
        """Wake one worker unless one was woken within ``debounce_seconds``."""
        with self._lock:
            now = self._clock()
            if now - self._last_wake < debounce_seconds:
                return False
            self._last_wake = now
        event = {"source": WAKE_SOURCE, "detail-type": "rdq.wake", "detail": {"queues": list(queues)}}
        return self._invoke(function, event)

    def _invoke(self, function: str, event: dict[str, Any]) -> bool:
        try:
            self.client.invoke(FunctionName=function, InvocationType="Event", Payload=json.dumps(event).encode())
            return True
        except Exception as exc:  # noqa: BLE001 - best-effort; the schedule is the fallback
            log.warning("asynchronous worker invocation failed: %s: %s", type(exc).__name__, exc)
            return False


def extra_workers_for_backlog(backlog: int, batch_size: int, max_concurrency: int) -> int:
    """How many more workers a backlog justifies: one per batch beyond the first, capped."""
    if backlog <= batch_size:
        return 0
    return max(0, min(max_concurrency - 1, math.ceil(backlog / batch_size) - 1))


#: The process-wide invoker; tests and ``rdq dev`` replace its client.
invoker = WorkerInvoker()
