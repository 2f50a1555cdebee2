"""Shared helpers: statistics, machine facts, per-process job counters, child processes."""

from __future__ import annotations

import json
import mmap
import os
import platform
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, in MiB.

    ``VmHWM`` from /proc, not ``getrusage().ru_maxrss``: Linux carries ru_maxrss across
    fork + execve, so a worker started by the (large) harness would report the harness's size.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                facts["mem_total_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except OSError:
        pass
    return facts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain_seconds(reports: list[dict], n: int, what: str) -> float:
    """Seconds from the first task any worker process ran to the last, from their reports
    (``tasks``, ``first``, ``last``); refuses a run whose workers did not run all ``n``."""
    tasks = sum(r["tasks"] for r in reports)
    if tasks != n:
        raise RuntimeError(f"{what}: workers ran {tasks} tasks, expected {n}")
    busy = [r for r in reports if r["tasks"]]
    return max(r["last"] for r in busy) - min(r["first"] for r in busy)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM by PID, then SIGKILL; only processes this harness started."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM) if _own_group(proc) else proc.terminate()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
        proc.wait(5)
    except ProcessLookupError:
        pass


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


# -- job counters ----------------------------------------------------------------------------------
# Peer workers run their own process models (asyncio, prefork pools, forking workers), so a no-op
# job records its own timing: on first call a process maps a 32-byte file of its own
# (count, first start, last end, peak RSS) and updates it in place -- no syscall per job.

_COUNTER = struct.Struct("<qddd")


class JobCounter:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._map: mmap.mmap | None = None
        self._pid = 0
        self.count = 0
        self.first = 0.0

    def start(self) -> None:
        if self._map is None or self._pid != os.getpid():
            self._open()
        if self.count == 0:
            self.first = time.time()

    def end(self) -> None:
        self.count += 1
        if self._map is None:
            return
        rss = peak_rss_mb() if self.count % 256 == 1 else None
        if rss is None:
            _, _, _, rss = _COUNTER.unpack_from(self._map, 0)
        _COUNTER.pack_into(self._map, 0, self.count, self.first, time.time(), rss)

    def _open(self) -> None:
        self._pid = os.getpid()
        self.count = 0
        path = os.path.join(self.directory, f"{self._pid}.cnt")
        with open(path, "wb") as fh:
            fh.write(b"\0" * _COUNTER.size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _COUNTER.size)
        finally:
            os.close(fd)


def read_counters(directory: str) -> dict[str, Any]:
    """Sum of every process's counter in ``directory``: count, first start, last end, peak RSS."""
    count, first, last, rss = 0, None, None, 0.0
    for name in os.listdir(directory):
        if not name.endswith(".cnt"):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                data = fh.read(_COUNTER.size)
        except OSError:
            continue
        if len(data) < _COUNTER.size:
            continue
        c, f, last_at, r = _COUNTER.unpack(data)
        if c <= 0:
            continue
        count += c
        first = f if first is None else min(first, f)
        last = last_at if last is None else max(last, last_at)
        rss = max(rss, r)
    return {"count": count, "first": first, "last": last, "peak_rss_mb": rss}


def wait_for_count(directory: str, n: int, timeout: float, procs: Sequence[subprocess.Popen] = ()) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = read_counters(directory)
        if info["count"] >= n:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {info['count']} of {n} jobs ran within {timeout:.0f}s")
        for proc in procs:
            if proc.poll() is not None and proc.returncode not in (0, None):
                raise RuntimeError(f"worker process {proc.pid} exited with {proc.returncode}")
        time.sleep(0.005)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def ready_then_go() -> bool:
    """The timed process's side of ``run_on_barrier``: say ``ready`` (connected, set up), then
    wait for ``go``; False when told anything else (the run was called off)."""
    print("ready", flush=True)
    return sys.stdin.readline().strip() == "go"


def run_on_barrier(argv: list[str], processes: int, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float = 300.0) -> list[dict[str, Any]]:
    """Start ``processes`` copies of ``python <argv>``, release them together once every one is
    connected (a ``ready`` line each, then ``go`` to all), and return each one's last output
    line as JSON, with ``spawned``: the wall time just before the first process was started
    (what a drain counted with start-up begins at). Each process runs in a session of its own
    and is stopped by PID afterwards."""
    spawned = time.time()
    procs = [
        subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env if env is not None else child_env(), cwd=cwd, start_new_session=True)
        for _ in range(processes)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"{' '.join(argv[:2])} did not start (said {line!r}, rc={proc.poll()})")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        deadline = time.monotonic() + timeout
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            reports.append({**json.loads(out.strip().splitlines()[-1]), "spawned": spawned})
        return reports
    finally:
        for proc in procs:
            stop_process(proc)
