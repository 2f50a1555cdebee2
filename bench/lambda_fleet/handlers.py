"""The bench's handlers, loaded by the worker through ``RDQ_HANDLERS`` like user code.

* ``fleet.noop``: returns at once.
* ``fleet.sleep``: waits ``payload["ms"]`` milliseconds: an I/O-bound task (a call to another
  service), which costs Lambda wall time but no CPU.

Each run is written as one line ``task_id request_id pid start end`` (monotonic seconds) to a
file of this process's own under ``RDQ_FLEET_LOG_DIR``: the bench reads which invocation ran
which task and when, for the overlap check and the "invocations holding tasks" count. A line is
written whole with one ``write`` on an O_APPEND descriptor, so a SIGKILL loses at most the runs
still under way.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from rdq_core import handler

from .runtime import REQUEST_ID_VARIABLE

#: Short, so a worker starts a task while little of its invocation is left, but far above the
#: bench's handler times.
TIMEOUT_SECONDS = 5

_lock = threading.Lock()
_fd: tuple[int, int] | None = None  # (pid, descriptor): a forked child opens its own


def _log_fd() -> int | None:
    global _fd
    directory = os.environ.get("RDQ_FLEET_LOG_DIR")
    if not directory:
        return None
    with _lock:
        if _fd is None or _fd[0] != os.getpid():
            path = os.path.join(directory, f"runs-{os.getpid()}.log")
            _fd = (os.getpid(), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        return _fd[1]


def _record(task_id: str, started: float) -> None:
    fd = _log_fd()
    if fd is not None:
        request = os.environ.get(REQUEST_ID_VARIABLE, "-")
        os.write(fd, f"{task_id} {request} {os.getpid()} {started:.6f} {time.monotonic():.6f}\n".encode())


@handler("fleet.noop", timeout_seconds=TIMEOUT_SECONDS)
def noop(payload: Any, ctx: Any) -> None:
    _record(ctx.task_id, time.monotonic())


@handler("fleet.sleep", timeout_seconds=TIMEOUT_SECONDS)
def sleep(payload: Any, ctx: Any) -> None:
    started = time.monotonic()
    time.sleep(float(payload.get("ms", 100)) / 1000.0)
    _record(ctx.task_id, started)

