"""Servers the tests and the benchmarks start are theirs: their own port, pid file and data, and
verified to be the process answering on that port -- never a stranger already listening there.
Both start nx-27017 the one way ``rdq_testing.servers`` does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pymongo")

from rdq_testing import servers
from rdq_testing.servers import ServerStartError, mongo_served_pid, processes, start_owned_server, stop_process

needs_nx = pytest.mark.skipif(shutil.which("nx-27017") is None, reason="nx-27017 is not installed (pip install nx-27017)")


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture
def stranger():
    """Another nx-27017 already listening on a port, as on a shared machine."""
    with servers.nx_27017() as other:
        yield other.port, other.process.pid


def _ports_starting_with(first: int):
    handed = iter([first])
    real = processes.free_loopback_port
    return lambda: next(handed, None) or real()


@needs_nx
def test_a_stranger_on_the_chosen_port_is_never_taken_for_our_server(stranger, monkeypatch):
    taken_port, stranger_pid = stranger
    monkeypatch.setattr(processes, "free_loopback_port", _ports_starting_with(taken_port))
    with servers.nx_27017() as ours:
        assert ours.port != taken_port
        assert mongo_served_pid(ours.port) == ours.process.pid != stranger_pid
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
    assert _parent_of(pid) == os.getpid(), "the server answering is the child this test session started"


@needs_nx
def test_the_benchmark_mongodb_server_is_its_own(stranger, monkeypatch):
    import bench.servers

    taken_port, stranger_pid = stranger
    monkeypatch.setattr(processes, "free_loopback_port", _ports_starting_with(taken_port))
    with bench.servers.mongo_server() as url:
        port = int(url.rsplit(":", 1)[1])
        pid = mongo_served_pid(port)
        assert port != taken_port and pid != stranger_pid
        assert _parent_of(pid) == os.getpid()
    assert mongo_served_pid(port) is None, "stopped on exit"
    assert mongo_served_pid(taken_port) == stranger_pid


@needs_nx
def test_an_owned_server_restarts_on_its_port_and_stops_by_pid():
    """What the fault suite relies on: stop, crash and start again on the same port."""
    server = servers.OwnedNx27017(durable=True)
    try:
        server.start()
        port, first = server.port, server.process.pid
        server.crash()
        assert mongo_served_pid(port) is None
        server.start()
        assert server.port == port and mongo_served_pid(port) == server.process.pid != first
    finally:
        server.destroy()
    assert mongo_served_pid(port) is None


def test_stop_process_ends_only_the_process_it_was_given():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        stop_process(target)
        assert target.poll() is not None and bystander.poll() is None
    finally:
        stop_process(bystander)
