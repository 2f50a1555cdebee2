"""The processes a worker's handlers started, found and ended when the worker gives up on them.

Python cannot stop a thread, so ``rdq worker`` replaces its process image when a handler
overruns (``docs/running-workers.md``). That ends every thread, but not the processes a handler
started (``subprocess``, ``os.fork``): they are other processes and would keep running while the
task, its lease lapsed, runs again. ``end_descendants`` ends them first.

What it finds is the process tree under the worker: every process whose chain of parents leads
to it, read from ``/proc`` (Linux) or ``ps`` (elsewhere). A process that has left that tree (a
double fork: its parent exited and it was re-parented to init) is not found; one that called
``setsid`` or ``setpgid`` but kept its parent is. The tree is frozen first (``SIGSTOP``, until a
walk finds nothing new), so nothing in it can fork a process that escapes the walk, and then
killed (``SIGKILL``); the call returns once each is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Collection, Mapping

log = logging.getLogger(__name__)

#: The processes ``rdq worker`` found under it when it first started (ones it inherited, e.g.
#: from a shell script that ``exec``'d it), carried across its restarts: never its handlers'.
INHERITED_ENV = "RDQ_WORKER_INHERITED_PIDS"

_PROC = "/proc"
#: Process states that will never run again: zombie, dead.
_ENDED = {"Z", "X", "x"}
_STOPPED = {"T", "t"} | _ENDED


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as handle:
            text = handle.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def _table() -> Mapping[int, tuple[str, int]]:
    """pid -> (state, parent pid) of every process visible."""
    if os.path.isdir(f"{_PROC}/self"):
        table: dict[int, tuple[str, int]] = {}
        for name in os.listdir(_PROC):
            if name.isdigit() and (found := _stat(int(name))) is not None:
                table[int(name)] = found
        return table
    listing = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "stat="], capture_output=True,
                             text=True, check=True, timeout=10).stdout
    rows = (line.split() for line in listing.splitlines())
    return {int(row[0]): (row[2][:1], int(row[1])) for row in rows if len(row) >= 3}


def descendants(root: int | None = None, exclude: Collection[int] = ()) -> dict[int, tuple[str, int]]:
    """Every process under ``root`` (this process by default): pid -> (state, parent pid). A
    process in ``exclude`` is left out with everything under it."""
    root = os.getpid() if root is None else root
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (_, parent) in table.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, tuple[str, int]] = {}
    frontier = [root]
    while frontier:
        for pid in children.get(frontier.pop(), ()):
            if pid not in exclude and pid not in found and pid != root:
                found[pid] = table[pid]
                frontier.append(pid)
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:  # it changed its user: the one thing this cannot end
        log.warning("cannot signal process %d under this worker (it runs as another user)", pid)


def _state(pid: int) -> str | None:
    found = _stat(pid) if os.path.isdir(f"{_PROC}/self") else _table().get(pid)
    return found[0] if found else None


def _wait_for(pids: Collection[int], states: set[str], deadline: float) -> None:
    """Until each of ``pids`` is gone or in one of ``states``, or ``deadline`` (monotonic)."""
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        waiting = {pid for pid in waiting if (state := _state(pid)) is not None and state not in states}
        if waiting:
            time.sleep(0.005)


def end_descendants(exclude: Collection[int] = (), timeout_seconds: float = 5.0) -> list[int]:
    """Kill every process under this one but those in ``exclude`` (and what is under them), and
    return their pids. Frozen first, to a fixed point, then killed; this process's own children
    among them are reaped, so none is left a zombie. Returns once all are gone or
    ``timeout_seconds`` passed (then logged)."""
    me = os.getpid()
    deadline = time.monotonic() + timeout_seconds
    frozen: dict[int, int] = {}  # pid -> parent pid
    while time.monotonic() < deadline:
        new = {pid: parent for pid, (_, parent) in descendants(me, exclude).items() if pid not in frozen}
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen.update(new)
        # A process that is stopped cannot fork; the next walk finds what any of them forked meanwhile.
        _wait_for(new, _STOPPED, deadline)
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    # This process's own children: reaped here (the image that started them may be gone by the
    # time anything else would wait for them).
    unreaped = {pid for pid, parent in frozen.items() if parent == me}
    while unreaped and time.monotonic() < deadline:
        for pid in list(unreaped):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    unreaped.discard(pid)
            except ChildProcessError:  # reaped already (by the handler's own wait)
                unreaped.discard(pid)
        if unreaped:
            time.sleep(0.005)
    _wait_for(frozen, _ENDED, deadline)
    left = [pid for pid in frozen if _state(pid) not in (None, *_ENDED)]
    if left:
        log.error("processes under this worker still alive after %gs: %s", timeout_seconds, left)
    return sorted(frozen)


def inherited_pids() -> frozenset[int]:
    """The processes ``rdq worker`` must leave alone: those under it when it first started.
    Read from (and removed from) the environment after a restart, so that handlers never see it;
    on a first start, the processes under it now (normally none)."""
    carried = os.environ.pop(INHERITED_ENV, None)
    if carried is not None:
        return frozenset(int(pid) for pid in carried.split(",") if pid.strip().isdigit())
    return frozenset(descendants())


def restarted() -> bool:
    """Whether this process image replaced an earlier one (``carry_inherited`` ran before it)."""
    return INHERITED_ENV in os.environ


def carry_inherited(pids: Collection[int]) -> None:
    """Before the worker replaces its process image: keep ``pids`` for the next image."""
    os.environ[INHERITED_ENV] = ",".join(str(pid) for pid in sorted(pids))
