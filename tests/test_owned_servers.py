"""Servers the tests and the benchmarks start are theirs: their own port, pid file and data, and
verified to be the process answering on that port -- never a stranger already listening there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("pymongo")

import tests.loopback as loopback  # noqa: E402
from tests.backends.test_mongo import mongo_server_url  # noqa: E402,F401 - the session fixture under test
from tests.loopback import ServerStartError, mongo_served_pid, start_owned_server, stop_process  # noqa: E402
NX = shutil.which("nx-27017")
needs_nx = pytest.mark.skipif(NX is None, reason="nx-27017 is not installed (pip install nx-27017)")


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="rdq-owned-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nx(workdir: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [NX, "--host", "127.0.0.1", "-p", str(port), "--db", "memory",
         "--pid-file", str(workdir / f"nx-{port}.pid"), "--log-file", str(workdir / f"nx-{port}.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=workdir,
    )


@pytest.fixture
def stranger(workdir):
    """Another nx-27017 already listening on a port, as on a shared machine."""
    process, port = start_owned_server(lambda p: _nx(workdir, p), mongo_served_pid, "stranger nx-27017")
    yield port, process.pid
    stop_process(process)


def _ports_starting_with(first: int):
    handed = iter([first])
    real = loopback.free_loopback_port
    return lambda: next(handed, None) or real()


@needs_nx
def test_a_stranger_on_the_chosen_port_is_never_taken_for_our_server(stranger, workdir, monkeypatch):
    taken_port, stranger_pid = stranger
    monkeypatch.setattr(loopback, "free_loopback_port", _ports_starting_with(taken_port))
    ours, port = start_owned_server(lambda p: _nx(workdir, p), mongo_served_pid, "nx-27017")
    try:
        assert port != taken_port
        assert mongo_served_pid(port) == ours.pid != stranger_pid
    finally:
        stop_process(ours)
    assert mongo_served_pid(taken_port) == stranger_pid, "the stranger was left alone"


def test_giving_up_names_the_stranger_and_stops_what_we_started():
    started: list[subprocess.Popen] = []

    def start(port: int) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    with pytest.raises(ServerStartError, match=r"served by PID 1, not by the fake server we started"):
        start_owned_server(start, lambda port: 1, "fake server", attempts=2, timeout=1)
    assert len(started) == 2 and all(p.poll() is not None for p in started)


@needs_nx
def test_the_mongodb_tests_use_the_server_they_started(request):
    if os.environ.get("RDQ_TEST_MONGO_URL"):
        pytest.skip("RDQ_TEST_MONGO_URL names the server to use")
    url = request.getfixturevalue("mongo_server_url")
    pid = mongo_served_pid(int(url.rsplit(":", 1)[1].strip("/")))
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert parent == os.getpid(), "the server answering is the child this test session started"


@needs_nx
def test_the_benchmark_mongodb_server_is_its_own(stranger, monkeypatch):
    import bench.servers

    taken_port, stranger_pid = stranger
    handed = _ports_starting_with(taken_port)
    monkeypatch.setattr(bench.servers, "free_port", handed)
    with bench.servers.mongo_server() as url:
        port = int(url.rsplit(":", 1)[1])
        pid = mongo_served_pid(port)
        assert port != taken_port and pid != stranger_pid
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == os.getpid()
    assert mongo_served_pid(port) is None, "stopped on exit"
    assert mongo_served_pid(taken_port) == stranger_pid
