"""The ``rdq`` command line, run as a real subprocess against the embedded SQLite default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rdq_core.compliance.support import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def rdq(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RDQ_LOG_LEVEL": "WARNING"}
    env.pop("RDQ_STORAGE_URL", None)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"rdq {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done

    run.env = env  # type: ignore[attr-defined]  # read back by the tests
    run.cwd = tmp_path  # type: ignore[attr-defined]  # read back by the tests
    return run


def test_embedded_default_needs_no_setup(rdq):
    created = json.loads(rdq("enqueue", "emails", "send", "--payload", '{"to": "a@b.c"}', "--id", "order-42", "--json").stdout)
    assert created["id"] == "order-42" and created["status"] == "PENDING" and created["payload"] == {"to": "a@b.c"}
    assert (rdq.cwd / "rdq.db").exists()
    again = json.loads(rdq("enqueue", "emails", "other", "--id", "order-42", "--json").stdout)
    assert again["handler"] == "send"
    stats = json.loads(rdq("stats", "emails", "--json").stdout)
    assert (stats["pending"], stats["in_flight"], stats["dead"]) == (1, 0, 0)
    shown = json.loads(rdq("task", "show", "order-42", "--json").stdout)
    assert shown["attempts"] == [] and shown["queue"] == "emails"


def test_task_show_names_the_worker_running_a_task_and_only_while_it_runs(rdq):
    from rdq_core.storage import open_storage

    rdq("enqueue", "jobs", "send", "--id", "held-1")
    store = open_storage(f"sqlite:///{rdq.cwd}/rdq.db")
    try:
        (claimed,) = store.claim("jobs", 1, 300, worker="ip-10-0-3-7:4242 billing")
        shown = rdq("task", "show", "held-1").stdout
        assert "IN_FLIGHT" in shown
        running = [line.strip() for line in shown.splitlines() if line.strip().startswith("running:")]
        assert running == [f"running: claimed_at={claimed.claimed_at.isoformat()} "
                           f"lease_expires_at={claimed.lease_expires_at.isoformat()} worker=ip-10-0-3-7:4242 billing"]
        as_json = json.loads(rdq("task", "show", "held-1", "--json").stdout)
        assert as_json["claimed_by"] == "ip-10-0-3-7:4242 billing"
        store.release([claimed.ref])
    finally:
        store.close()
    assert "running:" not in rdq("task", "show", "held-1").stdout
    assert json.loads(rdq("task", "show", "held-1", "--json").stdout)["claimed_by"] is None


def test_rdq_worker_name_labels_its_claims_with_host_pid_and_name(rdq):
    release = rdq.cwd / "release"
    rdq("enqueue", "jobs", "sample.hold", "--id", "held-by-name", "--payload", json.dumps({"until": str(release)}))
    worker = subprocess.Popen(
        [sys.executable, "-m", "rdq_core.hosts.cli", "worker", "--handlers", "tests.unit.sample_handlers", "--queues", "jobs",
         "--name", "billing-blue"],
        cwd=rdq.cwd, env=rdq.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        def shown() -> dict:
            return json.loads(rdq("task", "show", "held-by-name", "--json").stdout)

        wait_until(lambda: shown()["status"] == "IN_FLIGHT", timeout=30, what="the worker to start the task")
        assert shown()["claimed_by"] == f"{os.uname().nodename}:{worker.pid} billing-blue"
        release.touch()
        wait_until(lambda: shown()["status"] == "SUCCEEDED", timeout=30, what="the task to finish")
        assert shown()["claimed_by"] is None
    finally:
        release.touch()
        worker.send_signal(signal.SIGTERM)
        worker.wait(15)
    assert worker.returncode == 0, worker.stderr.read()


def test_errors_go_to_stderr_with_distinct_exit_codes(rdq):
    missing = rdq("task", "show", "nope", check=False)
    assert missing.returncode == 3 and "not found" in missing.stderr and missing.stdout == ""
    invalid = rdq("enqueue", "Bad Queue", "h", check=False)
    assert invalid.returncode == 2 and "queue must match" in invalid.stderr
    bad_json = rdq("enqueue", "q", "h", "--payload", "{not json", check=False)
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
    rdq("enqueue", "q", "h", "--id", "taken")
    conflict = rdq("enqueue", "other", "h", "--id", "taken", check=False)
    assert conflict.returncode == 4 and "Traceback" not in conflict.stderr
    empty = rdq("dlq", "redrive", "q", check=False)
    assert empty.returncode == 2
    refused = rdq("--storage", "postgresql://nobody@127.0.0.1:1/none", "stats", "q", check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr


def test_worker_reaper_and_dlq_commands_end_to_end(rdq):
    rdq("migrate")
    for n in range(3):
        rdq("enqueue", "jobs", "sample.ok", "--payload", json.dumps({"n": n}))
    rdq("enqueue", "jobs", "sample.fatal", "--id", "doomed")
    rdq("enqueue", "jobs", "nobody.handles.this", "--id", "orphan")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rdq_core.hosts.cli", "worker", "--handlers", "tests.unit.sample_handlers", "--queues", "jobs",
         "--lease", "5"],
        cwd=rdq.cwd, env=rdq.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until(lambda: json.loads(rdq("stats", "jobs", "--json").stdout)["succeeded"] == 3
                   and json.loads(rdq("stats", "jobs", "--json").stdout)["dead"] == 2, timeout=30, what="the worker to drain")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(15)
    assert worker.returncode == 0, worker.stderr.read()
    dead = json.loads(rdq("dlq", "list", "jobs", "--json").stdout)
    assert {t["id"]: t["last_error"]["type"] for t in dead["tasks"]} == {
        "doomed": "rdq_core.errors.PermanentError", "orphan": "rdq.UnknownHandler"}
    listed = json.loads(rdq("dlq", "list", "jobs", "--error-type", "rdq.UnknownHandler", "--json").stdout)
    assert [t["id"] for t in listed["tasks"]] == ["orphan"]
    assert json.loads(rdq("dlq", "redrive", "jobs", "--id", "doomed", "--json").stdout) == {"redriven": 1}
    redriven = json.loads(rdq("task", "show", "doomed", "--json").stdout)
    assert (redriven["status"], redriven["redrive_count"], len(redriven["attempts"])) == ("PENDING", 1, 1)
    assert json.loads(rdq("dlq", "purge", "jobs", "--all", "--yes", "--json").stdout) == {"purged": 1}
    assert rdq("task", "show", "orphan", check=False).returncode == 3
    assert json.loads(rdq("task", "cancel", "doomed", "--json").stdout)["status"] == "CANCELLED"
    assert json.loads(rdq("reaper", "--once").stdout)["reaped"] == 0


@pytest.mark.parametrize("argv", [
    ["worker", "--handlers", "m", "--queues", "jobs", "--name", "blue"],
    ["--storage", "sqlite:///x.db", "--log-format", "json", "reaper", "--once"],
    ["--api", "http://127.0.0.1:8787", "enqueue", "emails", "send", "--payload", "{}"],
    ["dlq", "redrive", "q", "--all", "--rate", "5"],
    ["schedules", "add", "n", "rate(5 minutes)", "--queue", "q", "--handler", "h"],
    ["console", "--port", "0"],
    ["--profile=p", "task", "show", "t-1", "--json"],
])
def test_the_parser_built_for_the_named_command_reads_argv_as_the_whole_one_does(argv):
    from rdq_core.hosts.cli.main import build_parser, command_named

    assert command_named(argv) == next(word for word in argv if word in COMMAND_WORDS)
    assert vars(build_parser(command_named(argv)).parse_args(argv)) == vars(build_parser().parse_args(argv))


COMMAND_WORDS = {"worker", "reaper", "enqueue", "dlq", "schedules", "console", "task"}


@pytest.mark.parametrize("argv", [[], ["--help"], ["wrker"], ["--log-format", "yaml", "worker"], ["--storage"]])
def test_argv_naming_no_command_gets_the_whole_parser_and_its_message(argv):
    from rdq_core.hosts.cli.main import command_named

    assert command_named(argv) is None
