"""Processes and ports: how every owned server is started, verified to be ours, and stopped.

A port is only free when chosen, so a server we start is used only once whoever answers on its
port reports the PID we started; every process is stopped by that PID, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Self, TypeVar

from ..conditions import wait_until

SERVER_START_DEADLINE_S = 20.0


def fail_or_skip(message: str) -> None:
    """A server a test needs is missing: a failure under CI, a skip with the reason elsewhere."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


# -- processes and ports --------------------------------------------------------------------------

def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) != 0


class ServerStartError(RuntimeError):
    """An owned server could not be started (its log tail is in the message)."""


def start_owned_server(
    start: Callable[[int], subprocess.Popen[bytes]],
    served_pid: Callable[[int], int | None],
    what: str,
    log_tail: Callable[[], str] = lambda: "",
    attempts: int = 3,
    timeout: float = SERVER_START_DEADLINE_S,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free loopback port and make sure the one answering there is *ours*.

    ``start(port)`` launches the server; ``served_pid(port)`` asks whoever answers on ``port``
    for its PID (None while nothing answers). A port is only free when chosen: another process
    can bind it before our server does. Then our server exits (address in use) or a stranger
    answers with another PID; either way ours is stopped and a new port tried.
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


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop a process we started, by its PID (its own process group if it leads one): SIGTERM,
    then SIGKILL."""
    if process.poll() is not None:
        return
    own_group = _leads_own_group(process)
    try:
        os.killpg(process.pid, signal.SIGTERM) if own_group else process.terminate()
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL) if own_group else process.kill()
        process.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def _leads_own_group(process: subprocess.Popen[bytes]) -> bool:
    try:
        return os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        return False



# -- servers run as our child process -------------------------------------------------------------

class OwnedProcessServer:
    """A server run as our child process (redis-server, nx-27017) in a directory of its own.

    The first ``start`` picks a free loopback port and retries on another if a stranger answers
    there; later starts (after ``stop`` or ``crash``) reuse the port, since clients hold URLs.
    """

    what = "server"

    def __init__(self, prefix: str, new_session: bool = False) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.new_session = new_session  # its own process group: a Ctrl-C to ours does not reach it

    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def served_pid(self, port: int) -> int | None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def _log_tail(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace")

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        with open(self.workdir / "server.log", "ab") as log:
            return subprocess.Popen(self.argv(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.workdir, start_new_session=self.new_session)

    def start(self) -> Self:
        if not self.port:
            self.process, self.port = start_owned_server(self._spawn, self.served_pid, self.what, self._log_tail)
            return self
        self.process = process = self._spawn(self.port)

        def ours() -> bool:
            pid = self.served_pid(self.port)
            if pid is not None and pid != process.pid:
                raise ServerStartError(
                    f"port {self.port} is served by PID {pid}, not by our {self.what} (PID {process.pid})")
            if pid is None and process.poll() is not None:
                raise ServerStartError(f"{self.what} exited with {process.returncode}: {self._log_tail()[-1500:]}")
            return pid is not None

        wait_until(ours, timeout=SERVER_START_DEADLINE_S, interval=0.05, what=f"{self.what} on port {self.port}")
        return self

    def stop(self) -> None:
        """A clean shutdown (SIGTERM to the PID we started)."""
        self._end(signal.SIGTERM)

    def crash(self) -> None:
        """``kill -9`` of the PID we started."""
        self._end(signal.SIGKILL)

    def _end(self, sig: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        wait_until(lambda: port_refuses(self.port), timeout=10, what=f"the owned {self.what} to stop listening")

    def destroy(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)



def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _OwnedServer(Protocol):
    def start(self) -> Any: ...
    def destroy(self) -> None: ...


S = TypeVar("S", bound=_OwnedServer)


@contextmanager
def running(server: S) -> Iterator[S]:
    """``server`` started for the block and destroyed (stopped by PID, its directory removed) after it,
    also when it fails to start half way."""
    try:
        server.start()
        yield server
    finally:
        server.destroy()

