"""The docs name facts the code decides; these tests fail when the two drift apart.

Each check reads a doc and the code it describes: the migration steps each backend has, the
migration that holds the wake-up trigger, and what a handler's log lines carry.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "rdq_core" / "storage"
DOCS = ROOT / "docs"


def _schema_table() -> dict[str, list[str]]:
    """The 'Schema versions' table of docs/upgrading.md, as the file names listed per backend."""
    text = (DOCS / "upgrading.md").read_text()
    section = text.split("## Schema versions", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, list[str]] = {"postgres": [], "sqlite": [], "mongo": []}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        for backend, cell in zip(("postgres", "sqlite", "mongo"), cells[1:], strict=True):
            listed[backend].extend(re.findall(r"`([^`]+)`", cell))
    return listed


@pytest.mark.parametrize("backend", ["postgres", "sqlite", "mongo"])
def test_the_schema_table_lists_every_migration_a_backend_has(backend: str) -> None:
    present = sorted(path.name for path in (MIGRATIONS / backend / "migrations").iterdir()
                     if path.suffix in (".sql", ".json"))
    assert present, f"no migrations found for {backend}"
    assert _schema_table()[backend] == present


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_each_sql_migration_names_its_own_step(backend: str) -> None:
    # A step's opening comment that names another version number is how a reader got lost.
    for path in sorted((MIGRATIONS / backend / "migrations").glob("*.sql")):
        step = int(path.name.split("_", 1)[0])
        named = re.match(r"--\s*rdq schema v(\d+)", path.read_text())
        if named:
            assert int(named.group(1)) == step, f"{path.name} calls itself schema v{named.group(1)}"


def test_running_workers_names_the_migration_that_holds_the_wakeup_trigger() -> None:
    text = (DOCS / "running-workers.md").read_text()
    holder = [path.name for path in (MIGRATIONS / "postgres" / "migrations").glob("*.sql")
              if "rdq_wake_workers" in path.read_text()]
    assert len(holder) == 1
    assert f"`rdq_wake_workers`, migration `{holder[0]}`" in text
    assert "schema v4" not in text


HANDLER_MODULE = """
import logging
from rdq_core import handler

@handler("says_hi")
def says_hi(payload, ctx):
    logging.getLogger("myapp").warning("handler says hi")
"""


def test_handler_log_lines_under_rdq_worker_carry_the_task_keys_as_docs_handlers_says(
        tmp_path: Path) -> None:
    doc = (DOCS / "handlers.md").read_text()
    assert "do not carry the task keys" not in doc
    assert "carry `task_id`, `queue` and `attempt`, under\n  `rdq worker`" in doc

    (tmp_path / "my_handlers.py").write_text(HANDLER_MODULE)
    env = {**os.environ, "RDQ_STORAGE_URL": f"sqlite:///{tmp_path / 'rdq.db'}",
           "PYTHONPATH": str(tmp_path)}
    enqueued = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "enqueue", "default", "says_hi"],
                              env=env, capture_output=True, text=True, timeout=60, check=True)
    task_id = enqueued.stdout.split()[0]
    worker = subprocess.Popen(
        [sys.executable, "-m", "rdq_core.hosts.cli", "--log-format", "json", "worker",
         "--handlers", "my_handlers"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert worker.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = worker.stdout.readline()
            if not line or "handler says hi" in line:
                break
        record = json.loads(line)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert (record["task_id"], record["queue"], record["attempt"]) == (task_id, "default", 1)
