"""The PostgreSQL statement watchdog wakes only for a deadline that comes first, yet still cuts
off every watched connection whose deadline passes (whatever else waits in its heap)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("psycopg")

from rdq_core.storage.postgres.pool import Watchdog


class _Conn:
    """What the watchdog uses of a connection: its socket's file descriptor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()


def _cut_off(peer: socket.socket, within: float) -> bool:
    """True once the watched end was shut down (the peer reads end-of-stream)."""
    peer.settimeout(within)
    try:
        return peer.recv(1) == b""
    except TimeoutError:
        return False


@pytest.fixture
def pairs():
    made: list[tuple[socket.socket, socket.socket]] = []

    def make() -> tuple[socket.socket, socket.socket]:
        made.append(socket.socketpair())
        return made[-1]

    yield make
    for a, b in made:
        a.close()
        b.close()


def test_a_short_deadline_behind_a_long_one_still_fires_on_time(pairs):
    watchdog = Watchdog()
    (slow, slow_peer), (fast, fast_peer) = pairs(), pairs()
    slow_watch = watchdog.watch(_Conn(slow), 60)  # type: ignore[arg-type]
    started = time.monotonic()
    fast_watch = watchdog.watch(_Conn(fast), 0.2)  # type: ignore[arg-type]
    assert _cut_off(fast_peer, within=5)
    assert 0.15 <= time.monotonic() - started < 5
    assert watchdog.done(fast_watch) is True
    assert not _cut_off(slow_peer, within=0.1) and watchdog.done(slow_watch) is False


def test_a_watch_queued_behind_finished_ones_fires_without_a_wake_up(pairs):
    """Finished watches with earlier deadlines stay in the heap (a new later watch does not wake
    the thread): the thread pops them when they come up and still cuts off the live one."""
    watchdog = Watchdog()
    finished = [watchdog.watch(_Conn(pairs()[0]), 0.1 + i * 0.05) for i in range(3)]  # type: ignore[arg-type]
    for watch in finished:
        assert watchdog.done(watch) is False
    live, live_peer = pairs()
    started = time.monotonic()
    watch = watchdog.watch(_Conn(live), 0.4)  # type: ignore[arg-type]
    assert _cut_off(live_peer, within=5)
    assert 0.35 <= time.monotonic() - started < 5
    assert watchdog.done(watch) is True


def test_a_refreshed_watch_gets_its_full_time_again(pairs):
    """A call's next statement restarts its deadline: the cut-off comes a full deadline after
    the refresh, not after the first statement."""
    watchdog = Watchdog()
    sock, peer = pairs()
    conn = _Conn(sock)
    started = time.monotonic()
    watch = watchdog.watch(conn, 0.4)  # type: ignore[arg-type]
    assert not _cut_off(peer, within=0.3)  # the first statement's time, not yet spent
    watchdog.refresh(conn)  # type: ignore[arg-type]
    assert _cut_off(peer, within=5)
    assert time.monotonic() - started >= 0.65
    assert watchdog.done(watch) is True
