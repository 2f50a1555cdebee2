"""Asynchronous worker invocations: fan-out from a busy worker and wake-ups from the API.

Both use ``lambda:InvokeFunction`` with ``InvocationType=Event`` on the worker function, so the
caller never waits for the work. Bounds:

* fan-out: a worker that holds a worker slot and sees a backlog (as it starts, or as it ends
  with work left) invokes the workers the backlog needs, but never more than the fleet's free
  slots (``Storage.take_worker_slot``): the slots, not the kind of invocation, bound the fleet, so
  there is no chain reaction, and an invocation that finds every slot held leaves at once;
* wake-up: at most one per ``RDQ_WAKE_DEBOUNCE_SECONDS`` per API container, and none while every
  slot is held (the running workers claim what was enqueued, and start more as they end).

Invocations are best-effort: a failure is logged and the next schedule tick picks the work up.
So they never stand between a committed write and its answer, nor between a worker and its
claim: each runs on a background thread with the Lambda client's short timeouts and one attempt
(``rdq_core.aws_clients``). The API waits at most ``WAKE_WAIT_SECONDS`` for its wake-up before it
answers; the worker claims while its fan-out runs and waits for it only at the end, briefly. A
function in a VPC without a route to Lambda (no NAT gateway, no ``lambda`` interface endpoint)
thus loses its wake-ups and fan-out, not its answers or its claims.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any, Callable, Literal, Protocol, Sequence

from ..aws_clients import aws_client

log = logging.getLogger("rdq.lambda_host.invoker")

FANOUT_SOURCE = "rdq.fanout"
WAKE_SOURCE = "rdq.api"

#: Seconds an API request waits for its wake-up before answering anyway: an ``Event`` invoke
#: answers in tens of milliseconds; one that does not is left to finish (or fail) on its own.
WAKE_WAIT_SECONDS = 0.5
#: The Lambda client's bounds (seconds): an ``Event`` invoke only queues the event.
INVOKE_CONNECT_TIMEOUT = 1.0
INVOKE_READ_TIMEOUT = 2.0


class LambdaInvokeClient(Protocol):
    """The one call made on boto3's Lambda client (the dev host stands in for it locally)."""

    def invoke(self, *, FunctionName: str, InvocationType: Literal["Event"], Payload: bytes) -> Any: ...


class BackgroundInvocations:
    """Invocations running on a daemon thread: how many were accepted so far, and whether it ended."""

    def __init__(self, name: str, work: Callable[["BackgroundInvocations"], None]) -> None:
        self.accepted = 0
        self.finished = threading.Event()

        def run() -> None:
            try:
                work(self)
            finally:
                self.finished.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def wait(self, seconds: float) -> int:
        """Wait at most ``seconds`` for the end; the invocations accepted by then."""
        self.finished.wait(max(seconds, 0.0))
        return self.accepted


class WorkerInvoker:
    def __init__(self, client: LambdaInvokeClient | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._last_wake = -math.inf
        self._lock = threading.Lock()

    @property
    def client(self) -> LambdaInvokeClient:
        with self._lock:
            if self._client is None:
                self._client = aws_client("lambda", connect_timeout=INVOKE_CONNECT_TIMEOUT,
                                          read_timeout=INVOKE_READ_TIMEOUT)
            return self._client

    @client.setter
    def client(self, value: LambdaInvokeClient | None) -> None:
        self._client = value

    def fan_out(self, function: str, queues: Sequence[str], extra_workers: int, deadline: float) -> BackgroundInvocations:
        """Start ``extra_workers`` asynchronous workers from a background thread, until ``deadline``
        (on this invoker's clock) or the first refusal: when one invoke fails (no route to Lambda,
        throttled), the next ones would too."""

        def work(progress: BackgroundInvocations) -> None:
            for index in range(extra_workers):
                if self._clock() >= deadline:
                    return
                event = {"source": FANOUT_SOURCE, "detail-type": "rdq.fanout", "detail": {"queues": list(queues), "index": index}}
                if not self._invoke(function, event):
                    return
                progress.accepted += 1

        return BackgroundInvocations("rdq-fan-out", work)

    def wake(self, function: str, queues: Sequence[str], debounce_seconds: float,
             wait_seconds: float = WAKE_WAIT_SECONDS, slot_free: Callable[[], bool] | None = None) -> bool:
        """Wake one worker unless one was woken within ``debounce_seconds`` or ``slot_free`` says
        every worker slot is held (a wake-up then would only find none); True if the invoke was
        accepted within ``wait_seconds`` (it may still be accepted later)."""
        with self._lock:
            now = self._clock()
            if now - self._last_wake < debounce_seconds:
                return False
            self._last_wake = now
        if slot_free is not None and not slot_free():
            return False
        event = {"source": WAKE_SOURCE, "detail-type": "rdq.wake", "detail": {"queues": list(queues)}}

        def work(progress: BackgroundInvocations) -> None:
            if self._invoke(function, event):
                progress.accepted += 1

        return BackgroundInvocations("rdq-wake", work).wait(wait_seconds) == 1

    def _invoke(self, function: str, event: dict[str, Any]) -> bool:
        try:
            self.client.invoke(FunctionName=function, InvocationType="Event", Payload=json.dumps(event).encode())
            return True
        except Exception as exc:  # noqa: BLE001 - best-effort; the schedule is the fallback
            log.warning("asynchronous worker invocation failed: %s: %s", type(exc).__name__, exc)
            return False


def extra_workers_for_backlog(backlog: int, batch_size: int, free_slots: int, already_working: int = 1) -> int:
    """How many more workers a backlog justifies: one per batch, less the ``already_working`` ones
    (the caller, while it holds a slot), within the fleet's ``free_slots``."""
    needed = math.ceil(backlog / max(batch_size, 1)) - already_working if backlog > 0 else 0
    return max(0, min(free_slots, needed))


#: The process-wide invoker; tests and ``rdq dev`` replace its client.
invoker = WorkerInvoker()
