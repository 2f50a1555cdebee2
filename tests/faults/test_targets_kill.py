"""kill -9 of ``rdq worker`` processes while they are calling an HTTPS target, on PostgreSQL.

Each kill lands while a request is at the receiver. Afterwards every task SUCCEEDED once, and
the history and the deliveries agree: no attempt lost, none doubled. Every delivery's
``Idempotency-Key`` names an attempt the history holds (a run cut by a kill is its LEASE_EXPIRED
attempt), no key was delivered twice, and each SUCCESS attempt was delivered. The receiver saw
some tasks more than once (at least once): the same ``Rdq-Task-Id``, a new key each time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.model import Outcome, TaskStatus
from rdq_core.storage import open_storage

from ..unit.target_receivers import Answer, Receiver, make_authority

REPO = Path(__file__).resolve().parents[2]
TASKS = 24
KILLS = 3


@pytest.mark.timeout(180)
def test_kill_9_mid_delivery_loses_and_doubles_no_attempt(tmp_path, fresh_pg_url):
    authority = make_authority(tmp_path)
    receiver = Receiver(authority)
    receiver.route("/hook", Answer(200, {"ok": True}, delay=0.25))
    (tmp_path / "rdq-targets.json").write_text(json.dumps({"notify": {
        "https": receiver.url("/hook"), "secret": "whsec_chaos", "ca_file": str(authority.ca_file),
        "timeout_seconds": 5}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    env.update({"PYTHONPATH": str(REPO), "RDQ_LOG_LEVEL": "WARNING"})
    storage = open_storage(fresh_pg_url)
    storage.migrate()
    client = Client(storage)
    ids = [client.enqueue("hooks", "notify", {"n": n}, max_attempts=10).id for n in range(TASKS)]

    def start_worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", fresh_pg_url, "worker", "--queues", "hooks",
             "--batch", "1", "--lease", "2"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    worker = start_worker()
    try:
        for _ in range(KILLS):
            # A request of this worker (the killed one's may still be held): one that arrived since.
            seen = len(receiver.requests)
            wait_until(lambda seen=seen: len(receiver.requests) > seen and receiver.active > 0, timeout=30,
                       what="a request of the new worker at the receiver")
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
            worker = start_worker()
        wait_until(lambda: storage.stats("hooks").succeeded == TASKS, timeout=90, what="every task to succeed")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(5)
        receiver.close()

    tasks = {task_id: client.get(task_id) for task_id in ids}
    storage.close()
    delivered = Counter(r.headers["Idempotency-Key"] for r in receiver.requests)
    assert max(delivered.values()) == 1, "an attempt was delivered twice"
    recorded = set()
    for task in tasks.values():
        assert task.status is TaskStatus.SUCCEEDED
        outcomes = [a.outcome for a in task.attempts]
        assert outcomes.count(Outcome.SUCCESS) == 1 and outcomes[-1] is Outcome.SUCCESS, outcomes
        assert set(outcomes[:-1]) <= {Outcome.LEASE_EXPIRED}, outcomes
        assert [a.attempt_no for a in task.attempts] == list(range(1, len(task.attempts) + 1))
        keys = {f"{task.id}:0:{a.attempt_no}": a.outcome for a in task.attempts}
        recorded |= set(keys)
        success_key = next(k for k, o in keys.items() if o is Outcome.SUCCESS)
        assert success_key in delivered, f"{task.id}: its SUCCESS attempt was never delivered"
    assert set(delivered) <= recorded, f"deliveries no attempt records: {sorted(set(delivered) - recorded)}"
    expired = sum(1 for t in tasks.values() for a in t.attempts if a.outcome is Outcome.LEASE_EXPIRED)
    # Each kill cut one delivery (batch 1), and may also have lost the settle of the one before.
    assert KILLS <= expired <= 2 * KILLS, expired
    by_task = Counter(r.headers["Rdq-Task-Id"] for r in receiver.requests)
    assert sum(by_task.values()) == len(delivered) and max(by_task.values()) >= 2  # at least once, seen
