"""What a new user meets in the first hour, through the real ``rdq`` executable in a fresh
directory: handler modules next to them, the store it opened, usage errors that say so, pipes,
bulk operations with confirmation, Ctrl-C, and replaying the shipped events."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rdq_core.compliance.support import wait_until
from rdq_testing.servers import free_loopback_port

REPO = Path(__file__).resolve().parents[2]
RDQ = shutil.which("rdq") or pytest.fail("the rdq executable is not installed (python -m pip install -e .)")

HANDLERS = textwrap.dedent('''
    import time
    from rdq_core import PermanentError, handler

    @handler("hello")
    def hello(payload, ctx):
        return {"hi": (payload or {}).get("name")}

    @handler("fatal")
    def fatal(payload, ctx):
        raise PermanentError("no")

    @handler("slow", timeout_seconds=30)
    def slow(payload, ctx):
        open(f"started-{ctx.task_id}", "w").close()
        time.sleep(payload["seconds"])
        return "slept"
''')


@pytest.fixture
def rdq(tmp_path):
    """``rdq`` in a fresh directory with no PYTHONPATH and no store configured."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RDQ_STORAGE_URL", "RDQ_HANDLERS")}
    env["RDQ_LOG_LEVEL"] = "INFO"
    (tmp_path / "my_handlers.py").write_text(HANDLERS)

    def run(*args: str, check: bool = True, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run([RDQ, *args], cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=60,
                              input=stdin if stdin is not None else "")
        if check and done.returncode != 0:
            raise AssertionError(f"rdq {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([RDQ, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)

    run.start = start  # type: ignore[attr-defined]  # read back by the tests
    run.cwd = tmp_path  # type: ignore[attr-defined]  # read back by the tests
    run.env = env  # type: ignore[attr-defined]  # read back by the tests
    return run


def stats(rdq, queue: str) -> dict:
    return json.loads(rdq("stats", queue, "--json").stdout)


def stop(process: subprocess.Popen) -> tuple[int, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate(timeout=5)
    return process.returncode, err


def dead_letter_with_a_worker(rdq, queue: str) -> None:
    """Run ``rdq worker`` until the queue's one task is DEAD."""
    worker = rdq.start("worker", "--handlers", "my_handlers", "--queues", queue)
    try:
        wait_until(lambda: stats(rdq, queue)["dead"] == 1, timeout=30, what="the task to die")
    finally:
        stop(worker)


def test_worker_imports_handlers_from_the_working_directory_and_names_its_store(rdq):
    rdq("enqueue", "greetings", "hello", "--payload", '{"name": "Ada"}', "--id", "ada")
    worker = rdq.start("worker", "--handlers", "my_handlers", "--queues", "greetings")
    try:
        wait_until(lambda: stats(rdq, "greetings")["succeeded"] == 1, timeout=30, what="the task to run")
    finally:
        code, err = stop(worker)
    assert code == 0, err
    assert "unexpected" not in err and "ModuleNotFoundError" not in err
    assert "sqlite:///rdq.db" in err and "greetings" in err, "the start line names the store and the queues"
    assert "ada" in err and "hello" in err and "SUCCESS" in err, "one line per task outcome"
    assert json.loads(rdq("task", "show", "ada", "--json").stdout)["result"] == {"hi": "Ada"}


def test_a_command_that_creates_a_new_sqlite_store_says_so(rdq, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    first = rdq("enqueue", "q", "hello", cwd=elsewhere)
    assert "creating a new, empty one" in first.stderr and str(elsewhere / "rdq.db") in first.stderr
    second = rdq("enqueue", "q", "hello", cwd=elsewhere)
    assert "creating" not in second.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--storage", "ftp://example/x", "stats", "q"], "unsupported storage URL scheme"),
    (["--storage", "sqlite://", "stats", "q"], "needs a file path"),
    (["worker", "--handlers", "no_such_module_here"], "cannot import handler module"),
    (["worker", "--queues", "BAD!", "--handlers", "my_handlers"], "queue"),
    (["dev", "--host", "0.0.0.0"], "RDQ_API_TOKEN"),
])
def test_usage_and_configuration_errors_exit_2_and_say_what_is_wrong(rdq, args, fragment):
    done = rdq(*args, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert fragment in done.stderr and "unexpected" not in done.stderr and "Traceback" not in done.stderr


def test_a_handler_name_registered_twice_is_a_usage_error(rdq):
    (rdq.cwd / "twice.py").write_text("from rdq_core import handler\n\n@handler('hello')\ndef again(p, c):\n    return 1\n")
    done = rdq("worker", "--handlers", "my_handlers,twice", check=False)
    assert done.returncode == 2 and "already registered" in done.stderr, done.stderr


def test_a_second_rdq_dev_on_a_busy_port_names_the_port(rdq):
    port = free_loopback_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        done = rdq("dev", "--port", str(port), check=False)
    assert done.returncode == 2 and str(port) in done.stderr and "--port" in done.stderr, done.stderr


def test_output_into_a_closed_pipe_ends_quietly(rdq):
    for n in range(30):
        rdq("enqueue", "q", "hello", "--id", f"t{n:02d}")
    done = subprocess.run(f"'{RDQ}' task show t00 --json | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", cwd=rdq.cwd, env=rdq.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_redrive_and_purge_by_id_say_what_is_wrong_and_change_nothing(rdq):
    rdq("enqueue", "q", "fatal", "--id", "dead-1", "--max-attempts", "1")
    rdq("enqueue", "q", "hello", "--id", "pending-1", "--delay", "3600")
    rdq("reaper", "--once")
    dead_letter_with_a_worker(rdq, "q")
    missing = rdq("dlq", "redrive", "q", "--id", "nope-404", check=False)
    assert missing.returncode == 3 and "nope-404" in missing.stderr
    not_dead = rdq("dlq", "redrive", "q", "--id", "dead-1", "--id", "pending-1", check=False)
    assert not_dead.returncode == 4 and "pending-1 is PENDING" in not_dead.stderr
    assert stats(rdq, "q")["dead"] == 1, "nothing was redriven"
    shown = rdq("dlq", "show", "pending-1", check=False)
    assert shown.returncode == 4 and "not DEAD" in shown.stderr
    hint = rdq("dlq", "list", "q", "--error-type", "PermanentError")
    assert "rdq_core.errors.PermanentError" in hint.stderr
    assert json.loads(rdq("dlq", "redrive", "q", "--id", "dead-1", "--json").stdout) == {"redriven": 1}


def test_purge_all_asks_for_confirmation_and_has_a_dry_run(rdq):
    rdq("enqueue", "q", "fatal", "--id", "dead-1", "--max-attempts", "1")
    dead_letter_with_a_worker(rdq, "q")
    refused = rdq("dlq", "purge", "q", "--all", check=False)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    dry = json.loads(rdq("dlq", "purge", "q", "--all", "--dry-run", "--json").stdout)
    assert dry == {"dry_run": True, "matching": 1}
    assert stats(rdq, "q")["dead"] == 1
    assert json.loads(rdq("dlq", "purge", "q", "--all", "--yes", "--json").stdout) == {"purged": 1}


def test_enqueue_reads_large_payloads_from_a_file_or_stdin_and_says_when_an_id_existed(rdq):
    big = {"blob": "x" * 200_000}  # over what a command line can carry, under the 256 KiB limit
    (rdq.cwd / "big.json").write_text(json.dumps(big))
    created = json.loads(rdq("enqueue", "q", "hello", "--payload", "@big.json", "--id", "big", "--json").stdout)
    assert created["created"] is True and created["payload"] == big
    piped = json.loads(rdq("enqueue", "q", "hello", "--payload", "-", "--json", stdin='{"name": "stdin"}').stdout)
    assert piped["payload"] == {"name": "stdin"}
    again = rdq("enqueue", "q", "other", "--id", "big")
    assert "already existed" in again.stdout
    assert json.loads(rdq("enqueue", "q", "other", "--id", "big", "--json").stdout)["created"] is False
    broken = rdq("enqueue", "q", "hello", "--payload", "@missing.json", check=False)
    assert broken.returncode == 2 and "missing.json" in broken.stderr


def test_cancel_many_and_stats_of_an_unknown_queue(rdq):
    for n in range(3):
        rdq("enqueue", "q", "hello", "--id", f"c{n}", "--delay", "3600")
    done = rdq("task", "cancel", "c0", "c1", "nope", check=False)
    assert done.returncode == 3 and "c0 CANCELLED" in done.stdout and "c1 CANCELLED" in done.stdout
    assert stats(rdq, "q")["cancelled"] == 2
    unknown = rdq("stats", "never-used", check=False)
    assert unknown.returncode == 3 and "never-used" in unknown.stderr


def test_task_show_wait_follows_a_task_to_the_end(rdq):
    rdq("enqueue", "q", "fatal", "--id", "w1", "--max-attempts", "1")
    worker = rdq.start("worker", "--handlers", "my_handlers", "--queues", "q")
    try:
        shown = json.loads(rdq("task", "show", "w1", "--wait", "--timeout", "30", "--json").stdout)
    finally:
        stop(worker)
    assert shown["status"] == "DEAD"
    text = rdq("task", "show", "w1").stdout
    assert "next_attempt_at" not in text, "a finished task has no next attempt"


def test_ctrl_c_says_it_is_draining_and_a_second_one_stops_at_once(rdq):
    rdq("enqueue", "q", "slow", "--payload", '{"seconds": 20}', "--id", "long")
    for n in range(3):
        rdq("enqueue", "q", "hello", "--id", f"behind-{n}")
    worker = rdq.start("worker", "--handlers", "my_handlers", "--queues", "q", "--batch", "4")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(worker.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: (rdq.cwd / "started-long").exists(), timeout=30, what="the slow handler to start")
        worker.send_signal(signal.SIGINT)
        wait_until(lambda: "Ctrl-C again" in "".join(lines), timeout=10, what="the draining message")
        assert worker.poll() is None, "the first Ctrl-C drains: the running task may finish"
        began = time.monotonic()
        worker.send_signal(signal.SIGINT)
        worker.wait(10)
        assert time.monotonic() - began < 8, "the second Ctrl-C stops at once"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(5)
    reader.join(5)
    err = "".join(lines)
    assert worker.returncode == 130, err
    assert "waiting for 1 running task" in err and "long (slow)" in err
    assert "stopping at once: released 3 unstarted claim(s)" in err
    assert stats(rdq, "q")["pending"] == 3, "the unstarted claims went back"


def test_rdq_invoke_replays_a_shipped_event_without_docker(rdq):
    result = json.loads(rdq("invoke", "api", str(REPO / "events" / "api-enqueue.json")).stdout)
    assert result["statusCode"] == 201, result
    assert json.loads(result["body"])["id"] == "order-42"
    worker = json.loads(rdq("invoke", "worker", str(REPO / "events" / "worker-scheduled.json"), "--timeout", "30").stdout)
    assert worker["outcomes"] == {"SUCCESS": 1}
    assert json.loads(rdq("task", "show", "order-42", "--json").stdout)["status"] == "SUCCEEDED"



def test_a_redis_database_the_server_does_not_have_is_a_usage_error(rdq):
    url = os.environ.get("RDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/999"
    done = rdq("--storage", url, "stats", "q", check=False)
    if done.returncode == 1 and "unavailable" in done.stderr and not os.environ.get("CI"):
        pytest.skip(f"Redis is not reachable at {url}")
    assert done.returncode == 2 and "database this server does not have" in done.stderr, done.stderr
