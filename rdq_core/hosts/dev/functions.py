"""The three Lambda functions, run in this process as Lambda would run them.

* the API handler, called once per HTTP request, one request at a time;
* the worker and reaper handlers, invoked on their schedules with EventBridge's scheduled-event
  shape and a Lambda context whose remaining time really counts down;
* the API's worker wake-up and the worker's fan-out, as local asynchronous invocations bounded
  like the deployed reserved concurrency (``LocalAsyncInvoker``).

Built only after ``environment.configure_environment``: the Lambda host modules read their
settings when they are imported.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("rdq.dev")


class LocalAsyncInvoker:
    """Stands in for ``boto3.client("lambda")``: an ``InvocationType=Event`` invoke runs the
    worker handler on a thread, at most ``limit`` at once (extra invocations are dropped, as a
    throttled reserved-concurrency function would defer them; the schedule picks the work up)."""

    def __init__(self, run_worker: Callable[[dict[str, Any]], None], limit: int) -> None:
        self._run_worker = run_worker
        self._slots = threading.BoundedSemaphore(limit)

    def invoke(
        self, *, FunctionName: str, InvocationType: str = "RequestResponse", Payload: bytes = b"{}", **_: Any
    ) -> dict[str, Any]:
        if not self._slots.acquire(blocking=False):
            return {"StatusCode": 429}
        event = json.loads(Payload or b"{}")

        def run() -> None:
            try:
                self._run_worker(event)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="rdq-dev-async-worker", daemon=True).start()
        return {"StatusCode": 202}


class LocalFunctions:
    """The API, worker and reaper functions of one ``rdq dev``, over one shared store."""

    def __init__(self, worker_timeout: float) -> None:
        from ..aws_lambda import api, connection, invoker, reaper, worker
        from ..aws_lambda.local_invoke import LocalLambdaContext, scheduled_event
        from ..aws_lambda.settings import Settings

        self._api, self._worker, self._reaper, self._connection = api, worker, reaper, connection
        self._context, self._scheduled_event = LocalLambdaContext, scheduled_event
        self.worker_timeout = worker_timeout
        self.settings = Settings.from_env()
        self.storage = connection.shared_storage(self.settings)
        invoker.invoker.client = LocalAsyncInvoker(self.invoke_worker, self.settings.max_worker_concurrency)
        # The resolver keeps the current event on a module-level app, like one Lambda container
        # serving one request at a time; serialize requests the same way.
        self._api_lock = threading.Lock()

    def use_publisher(self, publisher: Any) -> None:
        """Where the reaper delivers lifecycle events (instead of an EventBridge bus)."""
        self._reaper.publisher = publisher

    def close(self) -> None:
        self._connection.close_shared_storage()

    # -- the API -----------------------------------------------------------------------------
    def api_unauthorized(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The API's own token check, run on the headers alone (before the body is read)."""
        return self._api._unauthorized(self.settings, event)

    def call_api(self, event: dict[str, Any]) -> dict[str, Any]:
        with self._api_lock:
            answer: dict[str, Any] = self._api.lambda_handler(event, self._context("rdq-dev-api", 29))
            return answer

    # -- the scheduled functions -------------------------------------------------------------
    def invoke_worker(self, event: dict[str, Any]) -> None:
        try:
            self._worker.lambda_handler(event, self._context("rdq-dev-worker", self.worker_timeout))
        except Exception as exc:  # a failed invocation must not stop the dev host
            log.error("worker invocation failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def invoke_scheduled_worker(self) -> None:
        self.invoke_worker(self._scheduled_event("rdq-dev-worker-schedule"))

    def invoke_reaper(self) -> None:
        try:
            self._reaper.lambda_handler(self._scheduled_event("rdq-dev-reaper-schedule"), self._context("rdq-dev-reaper", 60))
        except Exception as exc:
            log.error("reaper invocation failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))


def run_every(stopping: threading.Event, every: float, invoke: Callable[[], None]) -> None:
    """Call ``invoke`` now and then every ``every`` seconds until ``stopping`` is set; a run that
    overruns its period delays the next one instead of piling up."""
    next_run = time.monotonic()
    while not stopping.wait(max(0.0, next_run - time.monotonic())):
        invoke()
        next_run = max(next_run + every, time.monotonic())
