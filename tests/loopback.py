"""Loopback helpers shared by the tests that start servers of their own."""

import re
import socket
import subprocess
import time
from typing import Callable


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: The first line ``rdq dev`` prints once it serves: its real address, so a test can start it
#: with ``--port 0`` (the kernel picks a free port at bind time) instead of guessing a free port
#: beforehand and racing every other process for it.
_DEV_BANNER = re.compile(r"rdq dev: API on http://(\S+):(\d+)\s")


def rdq_dev_address(output: str) -> tuple[str, int] | None:
    """(host, port) from ``rdq dev``'s banner in ``output``, or None if not printed yet."""
    found = _DEV_BANNER.search(output)
    return (found.group(1), int(found.group(2))) if found else None


class ServerStartError(RuntimeError):
    """An owned server could not be started (its log tail is in the message)."""


def start_owned_server(
    start: Callable[[int], subprocess.Popen],
    served_pid: Callable[[int], int | None],
    what: str,
    log_tail: Callable[[], str] = lambda: "",
    attempts: int = 3,
    timeout: float = 20.0,
) -> tuple[subprocess.Popen, int]:
    """Start a server on a free loopback port and make sure the one answering there is *ours*.

    ``start(port)`` launches the server (with its own pid file, log and data in a directory of
    its own); ``served_pid(port)`` asks whoever answers on ``port`` for its PID (None while
    nothing answers). A port is only free when chosen: another process can bind it before our
    server does. Then our server exits (address in use) or a stranger answers with another PID;
    either way ours is stopped and a new port tried, never the stranger used.
    """
    problems: list[str] = []
    for _ in range(attempts):
        port = free_loopback_port()
        process = start(port)
        deadline = time.monotonic() + timeout
        while True:
            pid = served_pid(port)
            if pid == process.pid:
                return process, port
            if pid is not None:
                problems.append(f"port {port} is served by PID {pid}, not by the {what} we started (PID {process.pid})")
                break
            if process.poll() is not None:
                problems.append(f"{what} exited with {process.returncode} on port {port}: {log_tail()[-1500:]}")
                break
            if time.monotonic() > deadline:
                problems.append(f"{what} did not answer on port {port} within {timeout:g}s: {log_tail()[-1500:]}")
                break
            time.sleep(0.05)
        stop_process(process)
    raise ServerStartError("; ".join(problems))


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a server we started, by its PID: SIGTERM, then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


def mongo_served_pid(port: int) -> int | None:
    """The PID the MongoDB wire server on ``port`` reports (``serverStatus``), or None."""
    import pymongo

    client = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}/", serverSelectionTimeoutMS=250, connectTimeoutMS=250)
    try:
        return int(client.admin.command("serverStatus")["pid"])
    except (pymongo.errors.PyMongoError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()


def redis_served_pid(port: int) -> int | None:
    """The PID the Redis server on ``port`` reports (``INFO server``), or None."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.25, socket_timeout=1)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()
