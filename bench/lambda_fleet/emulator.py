"""The Lambda service, locally: the Invoke API over HTTP, execution environments, concurrency.

``Emulator`` serves ``POST /2015-03-31/functions/{name}/invocations`` on 127.0.0.1, the call
boto3's ``lambda.invoke`` makes, so rdq's own clients reach it through their endpoint setting
(``AWS_ENDPOINT_URL_LAMBDA``). Per function (``Fleet``):

* concurrency: at most ``limit`` invocations run at once (the function's reserved concurrency,
  else the account's). A ``RequestResponse`` call over the limit gets a 429
  ``TooManyRequestsException``; an ``Event`` is queued (202) and a queue dispatcher runs it when
  there is room. A throttled event goes back to the queue with Lambda's documented backoff (1 s,
  doubling, at most 5 min) and is dropped once older than ``MaximumEventAgeInSeconds``
  (``AsyncEventsDropped``). A failed event is retried ``MaximumRetryAttempts`` times, after 1 and
  then 2 minutes, as Lambda does.
* environments: one process each (``runtime.py``) that imports the handler's module once (a
  cold start, whose init time is billed as Lambda bills it since August 2025) and is reused warm.
  Between invocations it is frozen (SIGSTOP) and thawed (SIGCONT) at the next, so its threads
  and open connections sit exactly as on Lambda; the most recently used one is reused first.
* timeout: the environment is SIGKILLed at the function's timeout and the next invocation gets a
  fresh one (a cold start), as Lambda resets an environment after a timeout.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from ..common import ROOT
from .runtime import read_message, write_message
from .template import ACCOUNT, REGION, FunctionConfig

#: Lambda's limit on a function's init phase.
INIT_TIMEOUT_S = 10.0
#: Lambda's retry interval for a throttled asynchronous event: from 1 s, doubling, at most 5 min.
THROTTLE_RETRY_FIRST_S = 1.0
THROTTLE_RETRY_MAX_S = 300.0
#: Lambda's waits before the second and third attempt of an asynchronous event that failed.
ERROR_RETRY_DELAYS_S = (60.0, 120.0)


def event_cause(event: Any) -> str:
    """What started an invocation, from its event: an rdq worker knows these four."""
    if not isinstance(event, Mapping):
        return "other"
    if "rdq_schedule" in event:
        return "scheduler"
    return {"aws.events": "tick", "rdq.fanout": "fanout", "rdq.api": "wake"}.get(str(event.get("source")), "other")


@dataclass
class Invocation:
    """One invocation as billed: ``started``..``ended`` on the monotonic clock."""

    request_id: str
    cause: str
    kind: str
    started: float
    pid: int = 0
    cold: bool = False
    init_ms: float = 0.0
    ended: float = 0.0
    outcome: str = "running"  # ok | error | timeout | init_error
    result: Any = None

    @property
    def billed_ms(self) -> int:
        """Duration rounded up to the millisecond, plus a cold start's init phase."""
        run = max(self.ended - self.started, 0.0) * 1000 - self.init_ms
        return math.ceil(max(run, 0.0)) + math.ceil(self.init_ms)


@dataclass(order=True)
class _Queued:
    due: float
    seq: int
    event: Any = field(compare=False)
    cause: str = field(compare=False)
    received: float = field(compare=False)
    throttles: int = field(compare=False, default=0)
    attempts: int = field(compare=False, default=0)


class InitError(RuntimeError):
    pass


class Environment:
    """An execution environment: a ``runtime.py`` process and its two pipes."""

    def __init__(self, config: FunctionConfig, environment: dict[str, str], log_dir: Path, index: int) -> None:
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        log = open(log_dir / f"env-{index:03d}.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.lambda_fleet.runtime", str(to_child), str(from_child), config.handler],
                cwd=config.code_dir, env=environment, pass_fds=(to_child, from_child),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(to_child)
            os.close(from_child)
            log.close()
        self.pid = self.proc.pid
        self.invocations = 0

    def init(self) -> float:
        """Wait for the handler's import; its duration in ms."""
        ready = self._read_until(time.monotonic() + INIT_TIMEOUT_S)
        if not ready or not ready.get("ready"):
            self.kill()
            raise InitError(json.dumps((ready or {}).get("error") or "init phase timed out or crashed"))
        return float(ready["init_ms"])

    def invoke(self, message: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """Thaw, send, wait for the answer until ``deadline``; None if it never came."""
        os.kill(self.pid, signal.SIGCONT)
        self.invocations += 1
        try:
            write_message(self._to_child, message)
        except OSError:
            return None
        return self._read_until(deadline)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL (it works on a frozen process too) and reap; only this environment's PID."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass

    def _read_until(self, deadline: float) -> dict[str, Any] | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([self._from_child], [], [], left)
            if readable:
                return read_message(self._from_child)


class Fleet:
    """One function's environments, concurrency and asynchronous event queue."""

    def __init__(self, config: FunctionConfig, environment: dict[str, str], log_dir: Path, *,
                 account_concurrency: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.environment = environment
        self.log_dir = log_dir
        self.limit = config.reserved_concurrency if config.reserved_concurrency is not None else account_concurrency
        self.clock = clock
        self._cond = threading.Condition()
        self._busy = 0
        self._idle: list[Environment] = []  # the most recently used last
        self._environments: list[Environment] = []
        self._queue: list[_Queued] = []
        self._seq = itertools.count()
        self._closed = False
        self._threads: set[threading.Thread] = set()
        # What the bench reads.
        self.invocations: list[Invocation] = []
        self.busy_timeline: list[tuple[float, int]] = []
        self.peak_busy = 0
        self.events_accepted: Counter[str] = Counter()
        self.throttled_events: Counter[str] = Counter()  # each time a queued event found no room
        self.throttled_sync: Counter[str] = Counter()  # 429 answers
        self.dropped_events: Counter[str] = Counter()  # AsyncEventsDropped
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"lambda-queue-{config.name}", daemon=True)
        self._dispatcher.start()

    # -- the two invocation types ------------------------------------------------------------------
    def invoke_async(self, event: Any) -> None:
        now = self.clock()
        cause = event_cause(event)
        with self._cond:
            self.events_accepted[cause] += 1
            heapq.heappush(self._queue, _Queued(now, next(self._seq), event, cause, now))
            self._cond.notify_all()

    def invoke_sync(self, event: Any) -> Invocation | None:
        """Run it now, or None when the function is at its limit (a 429)."""
        cause = event_cause(event)
        with self._cond:
            if self._closed or self._busy >= self.limit:
                self.throttled_sync[cause] += 1
                return None
            self._take_slot()
        return self._run(event, cause, "RequestResponse")

    def prewarm(self, count: int) -> None:
        """Start ``count`` environments and freeze them idle (a fleet warm from earlier traffic)."""
        started = [self._new_environment() for _ in range(count)]
        for env in started:
            env.init()
            env.freeze()
        with self._cond:
            self._idle.extend(started)

    def idle(self) -> bool:
        with self._cond:
            return self._busy == 0 and not self._queue

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop dispatching, wait up to ``wait_s`` for running invocations, then kill every
        environment this fleet started (by PID)."""
        end = self.clock() + wait_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._busy and self.clock() < end:
                self._cond.wait(max(end - self.clock(), 0.0))
            environments = list(self._environments)
        for env in environments:
            env.kill()
        for thread in list(self._threads):
            thread.join(5)

    # -- inside -----------------------------------------------------------------------------------
    def _take_slot(self) -> None:
        self._busy += 1
        self.peak_busy = max(self.peak_busy, self._busy)
        self.busy_timeline.append((self.clock(), self._busy))

    def _give_slot(self) -> None:
        with self._cond:
            self._busy -= 1
            self.busy_timeline.append((self.clock(), self._busy))
            self._cond.notify_all()

    def _dispatch(self) -> None:
        with self._cond:
            while not self._closed:
                now = self.clock()
                if not self._queue or self._queue[0].due > now:
                    self._cond.wait(min(self._queue[0].due - now, 1.0) if self._queue else 1.0)
                    continue
                item = heapq.heappop(self._queue)
                if now - item.received > self.config.max_event_age_s:
                    self.dropped_events[item.cause] += 1
                    continue
                if self._busy >= self.limit:
                    self.throttled_events[item.cause] += 1
                    item.throttles += 1
                    backoff = min(THROTTLE_RETRY_FIRST_S * 2 ** (item.throttles - 1), THROTTLE_RETRY_MAX_S)
                    item.due, item.seq = now + backoff, next(self._seq)
                    heapq.heappush(self._queue, item)
                    continue
                self._take_slot()
                thread = threading.Thread(target=self._run_queued, args=(item,), daemon=True)
                self._threads.add(thread)
                thread.start()

    def _run_queued(self, item: _Queued) -> None:
        try:
            done = self._run(item.event, item.cause, "Event")
            if done.outcome != "ok" and item.attempts < min(self.config.max_retry_attempts, len(ERROR_RETRY_DELAYS_S)):
                with self._cond:
                    item.due = self.clock() + ERROR_RETRY_DELAYS_S[item.attempts]
                    item.attempts += 1
                    item.seq = next(self._seq)
                    heapq.heappush(self._queue, item)
                    self._cond.notify_all()
        finally:
            self._threads.discard(threading.current_thread())

    def _new_environment(self) -> Environment:
        with self._cond:
            index = len(self._environments)
            env = Environment(self.config, self.environment, self.log_dir, index)
            self._environments.append(env)
            return env

    def _run(self, event: Any, cause: str, kind: str) -> Invocation:
        """The invocation, on a slot already taken (given back here)."""
        record = Invocation(request_id=str(uuid.uuid4()), cause=cause, kind=kind, started=self.clock())
        try:
            with self._cond:
                env = self._idle.pop() if self._idle else None
            if env is None:
                record.cold = True
                env = self._new_environment()
                try:
                    record.init_ms = env.init()
                except InitError as exc:
                    record.outcome, record.result, record.ended = "init_error", str(exc), self.clock()
                    return record
            record.pid = env.pid
            deadline = self.clock() + self.config.timeout_s
            reply = env.invoke({
                "request_id": record.request_id, "event": event, "deadline": deadline,
                "function_name": self.config.name, "function_arn": self.config.arn,
                "memory_mb": self.config.memory_mb, "log_stream": f"env-{env.pid}",
            }, deadline)
            record.ended = self.clock()
            if reply is None:
                # Past the deadline: Lambda's timeout. Before it: the process died (an exit error).
                record.outcome = "timeout" if record.ended >= deadline else "error"
                env.kill()
            else:
                record.outcome = "error" if "error" in reply else "ok"
                record.result = reply.get("error") or reply.get("result")
                env.freeze()
                with self._cond:
                    self._idle.append(env)
            return record
        finally:
            with self._cond:
                self.invocations.append(record)
            self._give_slot()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fleets: dict[str, Fleet]


class _InvokeHandler(BaseHTTPRequestHandler):
    server: _Server
    #: Socket timeout: a caller frozen mid-request (a worker's fan-out thread) does not hold a
    #: server thread forever.
    timeout = 10
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        parts = urlsplit(self.path).path.split("/")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if len(parts) != 5 or parts[1] != "2015-03-31" or parts[2] != "functions" or parts[4] != "invocations":
            return self._error(404, "UnknownOperationException", f"no route for {self.path}")
        name = unquote(parts[3]).split(":function:")[-1].split(":")[0]
        fleet = self.server.fleets.get(name)
        if fleet is None:
            return self._error(404, "ResourceNotFoundException", f"Function not found: {name}")
        try:
            event = json.loads(body) if body else {}
        except ValueError:
            return self._error(400, "InvalidRequestContentException", "Could not parse request body into json")
        kind = self.headers.get("X-Amz-Invocation-Type") or "RequestResponse"
        if kind == "DryRun":
            return self._answer(204, b"")
        if kind == "Event":
            fleet.invoke_async(event)
            return self._answer(202, b"")
        done = fleet.invoke_sync(event)
        if done is None:
            return self._error(429, "TooManyRequestsException", "Rate Exceeded.",
                               Reason="ReservedFunctionConcurrentInvocationLimitExceeded")
        if done.outcome == "ok":
            return self._answer(200, json.dumps(done.result, default=str).encode())
        error = done.result if isinstance(done.result, dict) else {
            "errorType": "Sandbox.Timedout" if done.outcome == "timeout" else "Runtime.ExitError",
            "errorMessage": f"{done.request_id} {done.outcome}"}
        return self._answer(200, json.dumps(error).encode(), {"X-Amz-Function-Error": "Unhandled"})

    def _error(self, status: int, error_type: str, message: str, **extra: str) -> None:
        body = json.dumps({"Type": "User", "message": message, "__type": error_type, **extra}).encode()
        self._answer(status, body, {"x-amzn-ErrorType": error_type})

    def _answer(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.send_header("X-Amz-Executed-Version", "$LATEST")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


class Emulator:
    """The Invoke API on ``127.0.0.1:<port>`` over the fleets it is given."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _InvokeHandler)
        self._server.fleets = {}
        self._thread = threading.Thread(target=self._server.serve_forever, name="lambda-api", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, fleet: Fleet) -> Fleet:
        self._server.fleets[fleet.config.name] = fleet
        return fleet

    def start(self) -> "Emulator":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def function_environment(config: FunctionConfig, endpoint: str, extra: Mapping[str, str]) -> dict[str, str]:
    """What a process of this function sees: the template's variables, what Lambda itself sets,
    then ``extra`` (the bench's own, e.g. where its handlers log). Nothing of the caller's own
    environment leaks in but PATH and the locale."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "TZ": ":UTC",
        # /var/task first, then the layer (rdq_core and, for the bench, its handler modules).
        "PYTHONPATH": os.pathsep.join([str(config.code_dir), str(ROOT)]),
        "LAMBDA_TASK_ROOT": str(config.code_dir),
        "AWS_EXECUTION_ENV": "AWS_Lambda_python3.12",
        "AWS_LAMBDA_FUNCTION_NAME": config.name,
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(config.memory_mb),
        "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{config.name}",
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "emulator",
        "AWS_SECRET_ACCESS_KEY": "emulator",
        "AWS_SESSION_TOKEN": "emulator",
        "AWS_ACCOUNT_ID": ACCOUNT,
        # Not set on Lambda: how rdq's unmodified clients reach this emulator.
        "AWS_ENDPOINT_URL_LAMBDA": endpoint,
        **config.environment,
        **extra,
    }
    return env
