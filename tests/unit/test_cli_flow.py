"""``rdq enqueue`` takes the flow-control fields as options and refuses bad ones precisely."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rdq_core.storage import open_storage

from .test_cli_trace import REPO, rdq


def test_enqueue_takes_priority_keys_and_group(tmp_path):
    task = json.loads(rdq(tmp_path, "enqueue", "q", "h", "--json", "--priority", "3", "--concurrency-key", "tenant:1",
                          "--rate-key", "smtp", "--group", "tenant:1").stdout)
    assert (task["priority"], task["concurrency_key"], task["rate_key"], task["group"]) == (3, "tenant:1", "smtp", "tenant:1")
    assert json.loads(rdq(tmp_path, "task", "show", task["id"], "--json").stdout)["priority"] == 3


def test_a_bad_priority_is_refused_and_nothing_is_enqueued(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != "RDQ_STORAGE_URL"}
    done = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "enqueue", "q", "h", "--priority", "10"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "priority" in done.stderr and "Traceback" not in done.stderr
    database = tmp_path / "rdq.db"
    if database.exists():
        storage = open_storage(f"sqlite:///{database}")
        try:
            assert storage.stats("q").pending == 0
        finally:
            storage.close()
