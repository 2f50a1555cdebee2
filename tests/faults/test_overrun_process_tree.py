"""An overrunning handler's child processes against a real ``rdq worker`` process: when the
worker gives up on the handler (its self-restart), every process the handler started is dead
before the task's next attempt starts, so two executions of one task never overlap.

The handler (``timeout_seconds=1``) starts ``sh``, which starts ``sleep 10`` in the background
and waits for it: the sleep is the handler's grandchild. The worker runs with ``--lease 2
--overrun-grace 1``. Every attempt records, when it starts, which processes of earlier attempts
are still alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.model import Outcome, TaskStatus
from rdq_core.storage import open_storage

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")

HANDLERS = '''
import json, os, subprocess, time
from rdq_core import handler

LOG = os.environ["OVERRUN_LOG"]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def record(**fields):
    with open(LOG, "a") as log:
        log.write(json.dumps({"at": time.time(), "worker": os.getpid(), **fields}) + "\\n")


def earlier_processes():
    with open(LOG) as log:
        entries = [json.loads(line) for line in log if line.strip()]
    return [pid for e in entries for pid in (e.get("child"), e.get("grandchild")) if pid]


@handler("spawn_and_hang", timeout_seconds=1)
def spawn_and_hang(payload, ctx):
    record(event="start", attempt=ctx.attempt, alive=[pid for pid in earlier_processes() if alive(pid)])
    if ctx.attempt > 1:
        return "done"
    pid_file = LOG + ".grandchild"
    child = subprocess.Popen(["sh", "-c", 'sleep 10 & echo "$!" > "$1"; wait', "sh", pid_file])
    while not os.path.exists(pid_file) or not open(pid_file).read().strip():
        time.sleep(0.01)
    record(event="spawned", attempt=ctx.attempt, child=child.pid, grandchild=int(open(pid_file).read()))
    child.wait()
    record(event="returned", attempt=ctx.attempt, returncode=child.returncode)
    return "finished the hard way"
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _entries(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def test_the_overrun_restart_kills_what_the_handler_started_before_the_task_runs_again(tmp_path: Path) -> None:
    (tmp_path / "overrun_handlers.py").write_text(textwrap.dedent(HANDLERS))
    log = tmp_path / "attempts.jsonl"
    log.touch()
    url = f"sqlite:///{tmp_path}/rdq.db"
    with open_storage(url) as storage:
        storage.migrate()
        task = Client(storage).enqueue("hangs", "spawn_and_hang", max_attempts=3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "OVERRUN_LOG": str(log),
           "RDQ_LOG_FORMAT": "text"}
    env.pop("RDQ_QUEUE_POLICIES", None)
    stderr = tmp_path / "worker.err"
    with open(stderr, "w") as err:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", url, "worker", "--handlers", "overrun_handlers",
             "--queues", "hangs", "--lease", "2", "--overrun-grace", "1", "--idle-poll", "0.1"],
            env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        with open_storage(url) as storage:
            done = wait_until(lambda: (t := storage.get(task.id)) and t.status is TaskStatus.SUCCEEDED and t,
                              timeout=60, interval=0.1, what="the task's second attempt to succeed")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    entries = _entries(log)
    report = stderr.read_text(errors="replace")
    starts = [e for e in entries if e["event"] == "start"]
    (spawned,) = [e for e in entries if e["event"] == "spawned"]
    assert [s["attempt"] for s in starts] == [1, 2], (entries, report)
    assert {s["worker"] for s in starts} == {worker.pid}, "restarted in place: the same PID"
    # The point of it all: when attempt 2 began, nothing attempt 1 started was alive.
    assert starts[1]["alive"] == [], f"attempt 1's processes {starts[1]['alive']} outlived it: {report}"
    assert not _alive(spawned["child"]) and not _alive(spawned["grandchild"])
    assert starts[1]["at"] > spawned["at"]
    # Killed under it, attempt 1's handler must not have had its outcome written: its attempt
    # is the lapsed lease, the task's result is attempt 2's.
    assert [a.outcome for a in done.attempts] == [Outcome.LEASE_EXPIRED, Outcome.SUCCESS], report
    assert done.result == "done"
    assert "ended" in report and "started by the overrunning handler" in report, report


def test_end_descendants_kills_the_tree_but_what_it_is_told_to_leave() -> None:
    from rdq_core.engine import process_tree

    # Whatever this test session runs under it already (servers of other tests) is left alone.
    before = set(process_tree.descendants())
    # A process that moved to its own session but kept its parent is still under this one.
    doomed = subprocess.Popen(["sh", "-c", "setsid sleep 30 & sleep 30 & wait"])
    kept = subprocess.Popen(["sleep", "30"])
    leave = before | {kept.pid}
    try:
        wait_until(lambda: len(process_tree.descendants(exclude=leave)) >= 3, what="the tree to start")
        tree = set(process_tree.descendants(exclude=leave))
        ended = process_tree.end_descendants(exclude=leave)
        assert tree <= set(ended) and kept.pid not in ended
        assert not any(_alive(pid) for pid in ended)
        assert doomed.poll() is not None, "a child of this process is reaped, not left a zombie"
        assert kept.poll() is None and _alive(kept.pid)
    finally:
        for process in (doomed, kept):
            process.kill()
            process.wait()
