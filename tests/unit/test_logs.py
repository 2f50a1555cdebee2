"""rdq_core.engine.logs: text on a terminal, JSON lines otherwise, every outcome field in JSON."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re

import pytest

from rdq_core.errors import InvalidInput
from rdq_core.engine.logs import (
    JsonFormatter,
    TextFormatter,
    configure_logging,
    configured_format,
    default_log_format,
    task_log_keys,
)
from rdq_core.model import ErrorInfo, Outcome, Settlement, Task, TaskStatus
from rdq_core.engine.retry import PolicyBook
from rdq_core.engine.outcomes import log_outcome

OUTCOME_FIELDS = {"task_id", "queue", "handler", "try", "max_tries", "outcome", "status", "duration_ms", "error_type"}


@pytest.fixture(autouse=True)
def clean_logging():
    """Leave the root logger and the ``rdq`` logger as they were (the Lambda host, imported by
    other tests in this process, gives ``rdq`` a Powertools handler and stops its propagation)."""
    root, rdq = logging.getLogger(), logging.getLogger("rdq")
    saved = (list(root.handlers), root.level, list(rdq.handlers), rdq.level, rdq.propagate)
    rdq.handlers, rdq.propagate = [], True
    rdq.setLevel(logging.NOTSET)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    rdq.handlers[:] = saved[2]
    rdq.setLevel(saved[3])
    rdq.propagate = saved[4]


def _task(**changes) -> Task:
    fields = dict(id="order-42", queue="emails", handler="send_email", payload=None, status=TaskStatus.IN_FLIGHT, attempt_count=0)
    fields.update(changes)
    return Task(**fields)


def _log_outcomes() -> None:
    policies = PolicyBook()
    log_outcome(_task(), Settlement("order-42", "t", Outcome.SUCCESS, TaskStatus.SUCCEEDED), policies, 0.0123)
    log_outcome(_task(id="order-43", attempt_count=1),
                Settlement("order-43", "t", Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, retry_delay_seconds=2.0,
                           error=ErrorInfo("ConnectionError", "smtp down")), policies, 1.5)
    log_outcome(_task(id="order-44"),
                Settlement("order-44", "t", Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                           error=ErrorInfo("rdq_core.errors.PermanentError", "bad address")), policies, 0.002)


def test_text_is_one_readable_line_per_outcome():
    stream = io.StringIO()
    configure_logging("text", "INFO", stream)
    _log_outcomes()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r" INFO    task  order-42 emails/send_email try 1/5 SUCCESS in 12 ms", lines[0]), lines[0]
    assert re.fullmatch(stamp + r" INFO    task  order-43 emails/send_email try 2/5 RETRYABLE_FAILURE in 1.5 s: "
                                r"ConnectionError: smtp down; retry in 2.0 s", lines[1]), lines[1]
    assert re.fullmatch(stamp + r" WARNING task  order-44 emails/send_email try 1/5 PERMANENT_FAILURE in 2 ms: "
                                r"rdq_core.errors.PermanentError: bad address; dead-lettered", lines[2]), lines[2]
    assert "{" not in stream.getvalue(), "no JSON in the text format"


def test_json_is_one_object_per_line_with_every_outcome_field_flattened():
    stream = io.StringIO()
    configure_logging("json", "INFO", stream)
    _log_outcomes()
    documents = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [d["level"] for d in documents] == ["INFO", "INFO", "WARNING"]
    for document in documents:
        assert {"time", "level", "logger", "message"} | OUTCOME_FIELDS <= set(document)
        assert document["logger"] == "rdq.task"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", document["time"])
        assert "rdq_task" not in document, "flattened, not nested"
    dead = documents[2]
    assert dead["task_id"] == "order-44" and dead["status"] == "DEAD" and dead["outcome"] == "PERMANENT_FAILURE"
    assert dead["error_type"] == "rdq_core.errors.PermanentError" and dead["try"] == 1 and dead["max_tries"] == 5
    assert documents[0]["duration_ms"] == 12.3 and documents[0]["error_type"] is None
    assert dead["message"].endswith("dead-lettered")


def test_auto_is_text_on_a_terminal_and_json_otherwise():
    assert configure_logging("auto", "INFO", io.StringIO()).rdq_format == "json"
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            handler = configure_logging("auto", "INFO", terminal)
            assert handler.rdq_format == "text" and configured_format() == "text"
            logging.getLogger("rdq.task").info("hello on a terminal")
            terminal.flush()
            written = os.read(leader, 4096).decode()
        assert "INFO    task  hello on a terminal" in written and "{" not in written
    finally:
        os.close(leader)
        os.close(follower)


def test_a_handlers_own_lines_carry_its_task_keys():
    text, structured = io.StringIO(), io.StringIO()
    configure_logging("text", "INFO", text)
    app = logging.getLogger("myapp.emails")
    with task_log_keys(task_id="order-42", queue="emails", attempt=2):
        app.info("sending to %s", "the customer")
    app.info("outside any task")
    first, second = text.getvalue().splitlines()
    assert first.endswith("myapp.emails  sending to the customer  task_id=order-42 queue=emails attempt=2")
    assert second.endswith("myapp.emails  outside any task")

    configure_logging("json", "INFO", structured)
    with task_log_keys(task_id="order-42", queue="emails", attempt=2):
        app.info("sending")
    document = json.loads(structured.getvalue())
    assert (document["task_id"], document["queue"], document["attempt"], document["logger"]) == (
        "order-42", "emails", 2, "myapp.emails")


def test_extra_fields_scalars_in_text_everything_in_json():
    text, structured = io.StringIO(), io.StringIO()
    configure_logging("text", "INFO", text)
    logging.getLogger("rdq.dev").info("enqueued", extra={"task_id": "a b", "is_new": True, "summary": {"claimed": 3}})
    line = text.getvalue().rstrip("\n")
    assert line.endswith('dev  enqueued  task_id="a b" is_new=True'), line
    configure_logging("json", "INFO", structured)
    logging.getLogger("rdq.dev").info("done", extra={"summary": {"claimed": 3}, "message_id": 7, "level": "x"})
    document = json.loads(structured.getvalue())
    assert document["summary"] == {"claimed": 3} and document["message_id"] == 7
    assert document["level"] == "INFO" and document["field_level"] == "x", "an extra never overwrites a standard key"


def test_exceptions_keep_their_traceback():
    text, structured = io.StringIO(), io.StringIO()
    for stream, fmt in ((text, "text"), (structured, "json")):
        configure_logging(fmt, "INFO", stream)
        try:
            raise KeyError("boom")
        except KeyError:
            logging.getLogger("rdq.worker").exception("handler crashed")
    assert "handler crashed\nTraceback (most recent call last):" in text.getvalue()
    document = json.loads(structured.getvalue())
    assert document["exception_type"] == "KeyError" and "KeyError: 'boom'" in document["exception"]


def test_reconfiguring_replaces_its_own_handler_and_basicconfigs_but_no_other():
    root = logging.getLogger()
    root.handlers[:] = []
    logging.basicConfig(format="%(message)s")  # what the CLI did before: a plain stderr handler
    keep = logging.StreamHandler(io.StringIO())
    root.addHandler(keep)
    first, second = io.StringIO(), io.StringIO()
    configure_logging("text", "INFO", first)
    configure_logging("json", "INFO", second)
    assert [h for h in root.handlers if h is not keep] and len(root.handlers) == 2 and keep in root.handlers
    logging.getLogger("rdq.task").info("once")
    assert first.getvalue() == "" and json.loads(second.getvalue())["message"] == "once"


def test_level_hides_what_is_below_it():
    stream = io.StringIO()
    configure_logging("text", "warning", stream)
    _log_outcomes()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "dead-lettered" in lines[0]


@pytest.mark.parametrize("fmt, level", [("yaml", "INFO"), ("text", "LOUD")])
def test_unknown_formats_and_levels_are_invalid_input(fmt, level):
    with pytest.raises(InvalidInput):
        configure_logging(fmt, level, io.StringIO())


def test_the_format_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("RDQ_LOG_FORMAT", raising=False)
    assert default_log_format() == "auto"
    monkeypatch.setenv("RDQ_LOG_FORMAT", " JSON ")
    assert default_log_format() == "json"


def test_the_formatters_work_on_any_record():
    record = logging.LogRecord("other.lib", logging.ERROR, __file__, 1, "plain %d", (1,), None)
    assert TextFormatter().format(record).endswith("ERROR   other.lib  plain 1")
    assert json.loads(JsonFormatter().format(record))["message"] == "plain 1"
