"""Asynchronous worker invocations: fan-out from a busy worker and wake-ups from the API.

Both use ``lambda:InvokeFunction`` with ``InvocationType=Event`` on the worker function, so the
caller never waits for the work. Bounds:

* fan-out: a worker that holds a worker slot and sees a backlog (as it starts, or as it ends
  with work left) reserves, in the store, a slot for each worker it will invoke
  (``Storage.reserve_worker_starts``: the fleet topped up to what the backlog needs, counting the
  workers running and those already on their way, one starter deciding at a time) and invokes
  exactly those; each invoked worker takes its reservation over. The slots, not the kind of
  invocation, bound the fleet, so there is no chain reaction, and no invocation is started only
  to find every slot held;
* wake-up: only into a slot it reserved (none while every slot is held or pending: the running
  workers claim what was enqueued, and start more as they end); within
  ``RDQ_WAKE_DEBOUNCE_SECONDS`` of an API container's last wake-up, only when the fleet is idle
  (its worker may have come and gone; skipping then would leave the work to the next tick).

A reservation whose invoke fails is given back at once; one whose invocation never runs frees
itself after ``START_LEASE_SECONDS``.

Invocations are best-effort: a failure is logged and the next schedule tick picks the work up.
So they never stand between a committed write and its answer, nor between a worker and its
claim: each runs on a background thread with the Lambda client's short timeouts and one attempt
(``rdq_core.aws.clients``). The API waits at most ``WAKE_WAIT_SECONDS`` for its wake-up before it
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

from ...aws.clients import aws_client
from ...errors import StorageUnavailable
from ...storage.spi import Storage, WorkerStart

log = logging.getLogger("rdq.lambda_host.invoker")

FANOUT_SOURCE = "rdq.fanout"
WAKE_SOURCE = "rdq.api"

#: Seconds an API request waits for its wake-up before answering anyway: an ``Event`` invoke
#: answers in tens of milliseconds; one that does not is left to finish (or fail) on its own.
WAKE_WAIT_SECONDS = 0.5
#: The Lambda client's bounds (seconds): an ``Event`` invoke only queues the event.
INVOKE_CONNECT_TIMEOUT = 1.0
INVOKE_READ_TIMEOUT = 2.0
#: Seconds a slot reserved for an invoked worker waits for it: an ``Event`` invoke of a cold
#: environment runs within seconds; one that never runs (dropped, throttled past this) gives its
#: slot back by itself, and a worker that arrives later takes a free slot the ordinary way.
START_LEASE_SECONDS = 20.0


class FleetStarts:
    """The store's side of the invocations this process starts: reservations of ``fleet``'s slots
    (``Storage.reserve_worker_starts``) and their return when an invoke fails."""

    def __init__(self, storage: Storage, fleet: str, cap: int) -> None:
        self.storage, self.fleet, self.cap = storage, fleet, cap

    def reserve(self, fleet_size: int, most: int | None = None) -> list[WorkerStart]:
        return self.storage.reserve_worker_starts(self.fleet, self.cap, START_LEASE_SECONDS,
                                                  fleet_size=fleet_size, most=most)

    def idle(self) -> bool:
        """No slot of the fleet held or pending: no worker is running or on its way. False when
        the store cannot tell (a worker may be running then; the tick is the fallback)."""
        try:
            return self.storage.worker_slots_held(self.fleet) == 0
        except StorageUnavailable as exc:
            log.warning("the fleet's slots could not be read for a wake-up: %s", exc)
            return False

    def give_back(self, starts: Sequence[WorkerStart]) -> None:
        """Best-effort: a reservation not given back frees itself after its lease."""
        for start in starts:
            try:
                self.storage.cancel_worker_start(start)
            except StorageUnavailable as exc:
                log.warning("worker start not given back; its lease frees it: %s", exc)
                return


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
        #: Held while the client is built (boto3's import and service model: CPU only, no network).
        self._building = threading.Lock()
        self._prepared = False

    @property
    def client(self) -> LambdaInvokeClient:
        with self._building:
            if self._client is None:
                self._client = aws_client("lambda", connect_timeout=INVOKE_CONNECT_TIMEOUT,
                                          read_timeout=INVOKE_READ_TIMEOUT)
            return self._client

    @client.setter
    def client(self, value: LambdaInvokeClient | None) -> None:
        self._client = value

    def prepare(self) -> None:
        """Build the client on a thread of its own, once per process, so that a request's own
        I/O (a secret, the store) overlaps it. Importing boto3 and building it takes about 0.25 s
        of a whole core; a 512 MB function has under a third of one, which is longer than a
        wake-up's wait (``WAKE_WAIT_SECONDS``), and that wait must be spent on the invoke alone."""
        with self._lock:
            if self._prepared or self._client is not None:
                return
            self._prepared = True
        threading.Thread(target=self._ready_client, name="rdq-lambda-client", daemon=True).start()

    def _ready_client(self) -> LambdaInvokeClient | None:
        try:
            return self.client
        except Exception as exc:  # noqa: BLE001 - best-effort; the schedule is the fallback
            log.warning("no Lambda client for worker invocations: %s: %s", type(exc).__name__, exc)
            return None

    def fan_out(self, function: str, queues: Sequence[str], starts: Sequence[WorkerStart], deadline: float,
                fleet: FleetStarts) -> BackgroundInvocations:
        """Start one asynchronous worker per reserved start, each event carrying its reservation,
        from a background thread, until ``deadline`` (on this invoker's clock) or the first
        refusal: when one invoke fails (no route to Lambda, throttled), the next ones would too.
        The reservations not invoked are given back."""

        def work(progress: BackgroundInvocations) -> None:
            # Built here, off the claims' way: the worker waits for its fan-out only at its end.
            client = self._ready_client()
            for index, start in enumerate(starts):
                event = {"source": FANOUT_SOURCE, "detail-type": "rdq.fanout",
                         "detail": {"queues": list(queues), "index": index, "start": start.to_event()}}
                if client is None or self._clock() >= deadline or not self._invoke(client, function, event):
                    fleet.give_back(starts[index:])
                    return
                progress.accepted += 1

        return BackgroundInvocations("rdq-fan-out", work)

    def wake(self, function: str, queues: Sequence[str], debounce_seconds: float,
             wait_seconds: float = WAKE_WAIT_SECONDS, fleet: FleetStarts | None = None) -> bool:
        """Wake one worker unless, with ``fleet``, no slot can be reserved for it (every one held
        or pending: a wake-up would find none); True if the invoke was accepted within
        ``wait_seconds`` (it may still be accepted later).

        Within ``debounce_seconds`` of this container's last wake-up, a worker is woken only if the
        fleet is idle (no slot held or pending, one read): the worker woken then may have finished
        already, and skipping would leave this work waiting for the schedule's next tick.
        Without ``fleet``, nothing is woken within that time."""
        with self._lock:
            now = self._clock()
            recent = now - self._last_wake < debounce_seconds
        if recent and (fleet is None or not fleet.idle()):
            return False
        with self._lock:
            self._last_wake = now
        # Built here if not yet, before the wait below: once the answer is sent the environment
        # may freeze, and an invoke still waiting for its client would wait with it.
        client = self._ready_client()
        if client is None:
            return False
        detail: dict[str, Any] = {"queues": list(queues)}
        start: WorkerStart | None = None
        if fleet is not None:
            try:
                # Recent: only into an idle fleet, which the store decides (the read may be stale).
                reserved = fleet.reserve(1 if recent else fleet.cap, most=1)
            except StorageUnavailable as exc:
                # The answer is committed: a worker woken without a reservation takes a slot itself.
                log.warning("no worker start reserved for the wake-up: %s", exc)
            else:
                if not reserved:
                    return False
                start = reserved[0]
                detail["start"] = start.to_event()
        event = {"source": WAKE_SOURCE, "detail-type": "rdq.wake", "detail": detail}

        def work(progress: BackgroundInvocations) -> None:
            if self._invoke(client, function, event):
                progress.accepted += 1
            elif fleet is not None and start is not None:
                fleet.give_back([start])

        return BackgroundInvocations("rdq-wake", work).wait(wait_seconds) == 1

    @staticmethod
    def _invoke(client: LambdaInvokeClient, function: str, event: dict[str, Any]) -> bool:
        try:
            client.invoke(FunctionName=function, InvocationType="Event", Payload=json.dumps(event).encode())
            return True
        except Exception as exc:  # noqa: BLE001 - best-effort; the schedule is the fallback
            log.warning("asynchronous worker invocation failed: %s: %s", type(exc).__name__, exc)
            return False


def workers_for_backlog(backlog: int, batch_size: int, cap: int) -> int:
    """The fleet a backlog justifies: one worker per batch, within the cap."""
    return max(0, min(cap, math.ceil(backlog / max(batch_size, 1)))) if backlog > 0 else 0


#: The process-wide invoker; tests and ``rdq dev`` replace its client.
invoker = WorkerInvoker()
