"""One execution environment: ``python -m bench.lambda_fleet.runtime <in_fd> <out_fd> <handler>``.

Started by the emulator with the function's environment and its code directory first on
``sys.path`` (as ``/var/task`` is on Lambda). It imports the handler's module once (the init
phase, timed and reported), then answers invocations one at a time over a pipe pair: each
message is a 4-byte big-endian length and a JSON document. Between invocations the emulator
freezes the whole process (SIGSTOP), so its threads and open connections sit as on Lambda.
Its stdout and stderr (the function's logs) go where the emulator points them.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import time
import traceback
from typing import Any

_LENGTH = struct.Struct(">I")
#: Set for the length of each invocation, so a bench handler can say which invocation ran it
#: (Lambda sets ``_X_AMZN_TRACE_ID`` per invocation the same way).
REQUEST_ID_VARIABLE = "RDQ_FLEET_REQUEST_ID"


def write_message(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message, default=str).encode()
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None  # the other end is gone
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> dict[str, Any] | None:
    head = read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    body = read_exactly(fd, _LENGTH.unpack(head)[0])
    return None if body is None else dict(json.loads(body))


class Context:
    """The Lambda context attributes rdq and Powertools read; the remaining time counts down from
    the deadline the emulator set (CLOCK_MONOTONIC is one clock for every process on Linux)."""

    def __init__(self, message: dict[str, Any]) -> None:
        self.function_name: str = message["function_name"]
        self.function_version = "$LATEST"
        self.invoked_function_arn: str = message["function_arn"]
        self.memory_limit_in_mb: int = message["memory_mb"]
        self.aws_request_id: str = message["request_id"]
        self.log_group_name = f"/aws/lambda/{self.function_name}"
        self.log_stream_name: str = message["log_stream"]
        self.identity = None
        self.client_context = None
        self._deadline: float = message["deadline"]

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def main(argv: list[str]) -> int:
    in_fd, out_fd, handler_path = int(argv[0]), int(argv[1]), argv[2]
    started = time.monotonic()
    module_name, _, function_name = handler_path.rpartition(".")
    try:
        handler = getattr(importlib.import_module(module_name), function_name)
    except Exception as exc:  # noqa: BLE001 - an init error is the invocation's answer on Lambda
        traceback.print_exc()
        write_message(out_fd, {"ready": False, "error": {"errorType": type(exc).__name__, "errorMessage": str(exc)}})
        return 1
    write_message(out_fd, {"ready": True, "init_ms": (time.monotonic() - started) * 1000})
    while True:
        message = read_message(in_fd)
        if message is None:
            return 0
        os.environ[REQUEST_ID_VARIABLE] = message["request_id"]
        try:
            result = handler(message["event"], Context(message))
            reply: dict[str, Any] = {"result": result}
        except Exception as exc:  # noqa: BLE001 - reported as the function's error, as Lambda does
            traceback.print_exc()
            reply = {"error": {"errorType": type(exc).__name__, "errorMessage": str(exc)}}
        finally:
            os.environ.pop(REQUEST_ID_VARIABLE, None)
        sys.stdout.flush()
        sys.stderr.flush()
        write_message(out_fd, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
