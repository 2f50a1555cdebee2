"""Server instances a fault test owns: started in a temp dir on a free loopback port, stopped,
crashed and restarted by the test, and always stopped by PID at the end. The shared servers
(PostgreSQL :5432, Redis :6379) are never restarted or stopped by these tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from rdq_core.compliance.support import wait_until
from tests.loopback import free_loopback_port, mongo_served_pid, redis_served_pid

PG_BIN = Path(os.environ.get("RDQ_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _port_refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) != 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class OwnedPostgres:
    """A throwaway PostgreSQL cluster (initdb in a temp dir), run as the ``postgres`` user when
    the tests run as root (PostgreSQL refuses to run as root)."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="rdq-fault-pg-"))
        self.data = self.workdir / "data"
        self.log = self.workdir / "server.log"
        self.port = free_loopback_port()
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_postgres:
            shutil.chown(self.workdir, "postgres")
        self._run(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: object) -> None:
        subprocess.run(self.as_postgres + [str(a) for a in argv], check=True, capture_output=True, timeout=60)

    @property
    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.workdir} -c fsync=off -c full_page_writes=off"
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "30", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (sessions terminated); ``immediate``: a crash (recovery on start)."""
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "30", "stop")
        wait_until(lambda: _port_refuses(self.port), timeout=10, what="the owned PostgreSQL to stop listening")

    def destroy(self) -> None:
        pid = self.postmaster_pid
        try:
            self.stop("immediate")
        except Exception:  # noqa: BLE001 - fall back to the PID we started
            if pid and _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)


class _OwnedProcessServer:
    """A server run as our child process (Redis, the MongoDB wire server), with its own port,
    pid file and data directory. Ready means the server answering on the port reports *our*
    child's PID: a stranger that took the port is never used as ours."""

    def __init__(self, prefix: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.port = free_loopback_port()
        self.process: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def served_pid(self) -> int | None:
        """The PID of whoever answers on our port, or None."""
        raise NotImplementedError

    def ready(self) -> bool:
        pid = self.served_pid()
        if pid is not None and self.process is not None and pid != self.process.pid:
            raise RuntimeError(f"port {self.port} is served by PID {pid}, not by our {self.argv()[0]} (PID {self.process.pid})")
        if pid is None and self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.argv()[0]} exited with {self.process.returncode}: "
                               f"{(self.workdir / 'server.log').read_text(errors='replace')[-1500:]}")
        return pid is not None

    def start(self) -> None:
        with open(self.workdir / "server.log", "ab") as log:
            self.process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.workdir)
        wait_until(self.ready, timeout=20, interval=0.05, what=f"{self.argv()[0]} on port {self.port}")

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
        wait_until(lambda: _port_refuses(self.port), timeout=10, what="the owned server to stop listening")

    def destroy(self) -> None:
        self._end(signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)


class OwnedRedis(_OwnedProcessServer):
    """redis-server on a free port with an append-only file fsynced on every write: without
    persistence a restarted Redis is empty, and "no task lost" would test nothing but that.
    (rdq on Redis keeps tasks through a restart only as well as Redis persistence does.)"""

    def __init__(self) -> None:
        super().__init__("rdq-fault-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
                "--pidfile", str(self.workdir / "redis.pid")]

    def served_pid(self) -> int | None:
        return redis_served_pid(self.port)


class OwnedMongoWire(_OwnedProcessServer):
    """The nx-27017 MongoDB wire server over a SQLite file, so data survives a restart."""

    def __init__(self) -> None:
        super().__init__("rdq-fault-mongo-")
        self.url = f"mongodb://127.0.0.1:{self.port}/rdq_faults"

    def argv(self) -> list[str]:
        executable = shutil.which("nx-27017") or "nx-27017"
        return [executable, "--host", "127.0.0.1", "-p", str(self.port), "--db", str(self.workdir / "data.db"),
                "--log-file", str(self.workdir / "nx.log"), "--pid-file", str(self.workdir / "nx.pid")]

    def served_pid(self) -> int | None:
        return mongo_served_pid(self.port)
