"""What reaches the operator's terminal: text a task (or a request) carries is escaped in every
human-readable output, and storage-URL credentials are never printed. Through the real ``rdq``
executable and a real ``rdq dev``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest

from rdq_core.compliance.support import wait_until

from .conftest import REPO

#: Retitles the window, clears the screen, paints red, rewinds the line and forges another.
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[31mFAKE\r\n2026-01-01 00:00:00 ERROR   task  forged\u202e\x9b"
RAW_CONTROLS = ("\x1b", "\x07", "\r", "\u202e", "\x9b")


def _rdq() -> str:
    found = shutil.which("rdq")
    if not found:
        pytest.fail("the rdq executable is not installed (python -m pip install -e .)")
    return found


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update(env or {})
    return subprocess.run([_rdq(), *args], capture_output=True, text=True, timeout=60, env=full_env, errors="strict")


def _assert_escaped(text: str, what: str) -> None:
    for control in RAW_CONTROLS:
        assert control not in text, (what, control, text[-2000:])
    assert "\\x1b]0;owned\\x07" in text, (what, text[-2000:])


def test_task_text_and_request_lines_are_escaped_in_every_human_readable_output(dev_server_factory, tmp_path):
    store = f"sqlite:///{tmp_path}/terminal.db"
    server = dev_server_factory(token=None, storage_url=store, env={"RDQ_LOG_FORMAT": "text"})
    # A handler that puts its input in its error message (the example ``reject`` does).
    status, _, body = server.request("POST", "/v1/queues/term/tasks",
                                     {"handler": "reject", "id": "hostile-1", "payload": {"reason": HOSTILE}}, token=None)
    assert status == 201, body
    wait_until(lambda: json.loads(server.request("GET", "/v1/tasks/hostile-1", token=None)[2])["status"] == "DEAD",
               30, what="the task to be dead-lettered")
    # A request line made of escape sequences (the stdlib refuses it; the log line shows it).
    for request_line in (b"GET /\x1b]0;owned\x07\x1b[2J\x1b[31mFAKE\r\n\r\n",
                         b"GET /v1/tasks/\x1b]0;owned\x07\x1b[2J HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(request_line)
            while sock.recv(65536):
                pass
    wait_until(lambda: server.output().count("owned") >= 3 or None, 10, what="the request log lines")
    log_text = server.output()
    _assert_escaped(log_text, "rdq dev's log (request lines and the rdq.task outcome line)")
    assert "\nERROR forged" not in log_text and "\n2026-01-01" not in log_text

    # The CLI, on the same store.
    for args in (["task", "show", "hostile-1"], ["dlq", "show", "hostile-1"]):
        result = _run("--storage", store, *args)
        assert result.returncode == 0, result.stderr
        _assert_escaped(result.stdout, " ".join(args))
        assert len(result.stdout.splitlines()) == 3, result.stdout  # task, counters, one attempt: no forged line
    listing = _run("--storage", store, "dlq", "list", "term")
    assert listing.returncode == 0 and "hostile-1" in listing.stdout and "PermanentError" in listing.stdout
    assert not any(control in listing.stdout for control in RAW_CONTROLS)
    # --json stays JSON: the message round-trips exactly.
    shown = json.loads(_run("--storage", store, "task", "show", "hostile-1", "--json").stdout)
    assert shown["attempts"][0]["error"]["message"] == HOSTILE


def test_the_text_log_format_escapes_messages():
    import logging

    from rdq_core.engine.logs import TextFormatter

    record = logging.LogRecord("rdq.task", logging.WARNING, __file__, 1, "t1 q/h try 1/1 PERMANENT_FAILURE: %s", (HOSTILE,), None)
    line = TextFormatter().format(record)
    assert "\n" not in line and not any(c in line for c in RAW_CONTROLS), line
    assert "\\x1b[2J" in line and "\\u202e" in line


# -- storage-URL credentials -------------------------------------------------------------------
PASSWORD = "Qs-Pw-0a8d41"


def _with_query(url: str, extra: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{extra}"


@pytest.fixture(params=["postgresql", "redis"])
def url_with_query_password(request) -> str:
    """A working store whose URL carries its password as ``?password=`` (PostgreSQL: trust auth
    ignores it; Redis: an ACL user that needs it)."""
    if request.param == "postgresql":
        from rdq_testing.servers import pg_fresh_schema as fresh_schema_url

        return _with_query(fresh_schema_url(request.getfixturevalue("pg_database_url")),
                           f"password={PASSWORD}&sslpassword={PASSWORD}")
    from rdq_testing.servers import SHARED_REDIS_URL as REDIS_BASE_URL, redis_url_with_prefix as url_with_prefix

    client = request.getfixturevalue("redis_client")
    user = f"rdq-redact-{os.getpid()}"
    client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    request.addfinalizer(lambda: client.execute_command("ACL", "DELUSER", user))
    base = url_with_prefix(REDIS_BASE_URL, request.getfixturevalue("redis_prefix"))
    scheme, rest = base.split("://", 1)
    return _with_query(f"{scheme}://{user}@{rest}", f"password={PASSWORD}")


def _assert_redacted(text: str, what: str) -> None:
    assert PASSWORD not in text, (what, text[-2000:])
    assert "password=***" in text, (what, text[-2000:])


def test_a_password_in_the_url_query_is_never_printed(url_with_query_password, dev_server_factory, tmp_path):
    url = url_with_query_password
    migrated = _run("--storage", url, "migrate")
    assert migrated.returncode == 0, migrated.stderr.replace(PASSWORD, "<PW>")
    _assert_redacted(migrated.stdout + migrated.stderr, "rdq migrate")
    # A usage error that names the URL.
    stats = _run("--storage", url, "stats", "never-used-queue")
    assert stats.returncode != 0
    _assert_redacted(stats.stdout + stats.stderr, "rdq stats (not found)")
    # The rdq dev banner.
    server = dev_server_factory(token=None, storage_url=url)
    _assert_redacted(server.output(), "rdq dev's banner")
    # The start lines of the long-running commands.
    for command in (["worker", "--handlers", "rdq_core.examples"], ["reaper"]):
        log_path = tmp_path / f"{command[0]}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
        env.update({"PYTHONPATH": str(REPO), "RDQ_LOG_FORMAT": "text"})
        with open(log_path, "wb") as log:
            process = subprocess.Popen([_rdq(), "--storage", url, *command], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda log_path=log_path: " on " in log_path.read_text() or None, 30,
                       what=f"rdq {command[0]} to log its start line")
        finally:
            process.terminate()
            process.wait(30)
        _assert_redacted(log_path.read_text(), f"rdq {command[0]}")


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:pw@h:5432/db?sslmode=require&password=s3", "postgresql://u:***@h:5432/db?sslmode=require&password=***"),
    ("postgresql://h/db?sslpassword=s3&pass%77ord=s3&PWD=s3&sslkey=/k.pem", "postgresql://h/db?sslpassword=***&pass%77ord=***&PWD=***&sslkey=/k.pem"),
    ("redis://:pw@h:6379/0?prefix=p&password=s3", "redis://:***@h:6379/0?prefix=p&password=***"),
    ("rediss://h/0?token=s3&secret_key=s3&access_key=s3&key=s3", "rediss://h/0?token=***&secret_key=***&access_key=***&key=***"),
    ("mongodb://u:pw@h/db?authSource=admin&authMechanismProperties=AWS_SESSION_TOKEN:s3",
     "mongodb://u:***@h/db?authSource=admin&authMechanismProperties=***"),
    ("sqlite:///rdq.db", "sqlite:///rdq.db"),
    ("postgresql://u@h/db?application_name=a", "postgresql://u@h/db?application_name=a"),
])
def test_redact_url_hides_every_credential_and_keeps_the_rest(url, shown):
    from rdq_core.storage import redact_url

    assert redact_url(url) == shown
