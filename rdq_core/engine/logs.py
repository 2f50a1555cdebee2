"""How the rdq processes (``rdq worker``, ``rdq reaper``, ``rdq dev``, the other commands) write
their logs: one short readable line per record on a terminal, one JSON object per line
otherwise -- what container log collectors (CloudWatch, Loki, Datadog, ``kubectl logs``) expect.

```python
from rdq_core.engine.logs import configure_logging
configure_logging("auto", "INFO")      # text on a TTY, JSON lines when stderr is a pipe or file
```

* ``text``: ``2026-01-02 10:55:16 INFO    task  ID demo/greet try 1/5 SUCCESS in 3 ms``
  (local time, level, the logger name without its ``rdq.`` prefix, the message; scalar extra
  fields and the task keys of a handler's own lines follow as ``key=value``; no JSON).
* ``json``: ``{"time": "2026-01-02T09:55:16.616Z", "level": "INFO", "logger": "rdq.task",
  "message": "...", "task_id": "...", "queue": "demo", ...}``: the engine's per-outcome fields
  (``record.rdq_task``, see ``rdq_core.engine.outcomes.log_outcome``) flattened into the object, plus
  every other extra field of the record.

A handler's own log lines (any logger) carry the task they run for while ``task_log_keys`` is
active on their thread: ``task_id``, ``queue`` and ``attempt``.

The deployed Lambda functions do not use this module: they keep Powertools' JSON lines for
CloudWatch (``rdq_core.hosts.aws_lambda.observability``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, TextIO

from ..errors import InvalidInput
from ..text import printable

#: The values ``--log-format`` / ``RDQ_LOG_FORMAT`` accept.
LOG_FORMATS = ("auto", "text", "json")
FORMAT_ENV = "RDQ_LOG_FORMAT"
LEVEL_ENV = "RDQ_LOG_LEVEL"

#: The attributes every ``LogRecord`` has; anything else on a record is an extra field.
_STANDARD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "rdq_task", "rdq_keys",
}
_SCALARS = (str, int, float, bool, type(None))


def default_log_format() -> str:
    """``$RDQ_LOG_FORMAT`` if set, else ``auto`` (a default for ``--log-format``)."""
    return os.environ.get(FORMAT_ENV, "").strip().lower() or "auto"


def default_log_level() -> str:
    """``$RDQ_LOG_LEVEL`` if set, else ``INFO``."""
    return os.environ.get(LEVEL_ENV, "").strip().upper() or "INFO"


def configure_logging(fmt: str = "auto", level: str | int = "INFO", stream: TextIO | None = None) -> logging.Handler:
    """Send every log record of this process to ``stream`` (default: ``sys.stderr`` at call time)
    in format ``fmt``: ``text``, ``json``, or ``auto`` (text if ``stream`` is a TTY, else JSON).

    Installs one handler on the root logger and sets the root level to ``level``. Calling it
    again replaces the handler it installed before, as well as a plain stderr/stdout
    ``StreamHandler`` (what ``logging.basicConfig`` adds); other handlers (files, test capture)
    are left alone. Returns the handler. Raises ``InvalidInput`` for an unknown format or level.
    """
    chosen = (fmt or "auto").strip().lower()
    if chosen not in LOG_FORMATS:
        raise InvalidInput(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}", field="log_format")
    numeric_level = _level(level)
    stream = stream if stream is not None else sys.stderr
    if chosen == "auto":
        chosen = "text" if _is_tty(stream) else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter() if chosen == "text" else JsonFormatter())
    handler.addFilter(_TaskKeysFilter())
    handler.rdq_format = chosen  # type: ignore[attr-defined]  # marks the handler as ours
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, "rdq_format", None) or _is_plain_std_stream_handler(existing):
            root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    return handler


def configured_format() -> str | None:
    """``text`` or ``json`` if ``configure_logging`` has set up this process, else None."""
    for existing in logging.getLogger().handlers:
        chosen: str | None = getattr(existing, "rdq_format", None)
        if chosen:
            return chosen
    return None


# -- task keys on a handler's own lines --------------------------------------------------------
_current = threading.local()


class task_log_keys:
    """While active, every record logged on this thread carries ``keys`` (e.g. ``task_id``,
    ``queue``, ``attempt``): as ``key=value`` in text, as fields in JSON. A class rather than a
    generator: it wraps every attempt, and costs half of what ``@contextmanager`` did (timeit)."""

    __slots__ = ("keys", "previous")

    def __init__(self, **keys: Any) -> None:
        self.keys = keys

    def __enter__(self) -> None:
        self.previous = previous = getattr(_current, "keys", None)
        _current.keys = {**previous, **self.keys} if previous else self.keys

    def __exit__(self, *exc_info: object) -> None:
        _current.keys = self.previous


def current_task_keys() -> dict[str, Any]:
    return dict(getattr(_current, "keys", None) or {})


class _TaskKeysFilter(logging.Filter):
    """Stamps the thread's task keys on the record while still on the thread that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:  # stdlib name
        if not hasattr(record, "rdq_keys"):
            record.rdq_keys = current_task_keys()
        return True


# -- formatters --------------------------------------------------------------------------------
def short_name(name: str) -> str:
    """``rdq.task`` -> ``task``; other loggers keep their name."""
    return name[4:] if name.startswith("rdq.") and len(name) > 4 else name


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRIBUTES and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """``2026-01-02 10:55:16 INFO    task  message  key=value ...`` (local time)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        # The message can hold a task's text (an error message built from its payload): escape
        # control characters so it cannot drive the terminal or start a forged line.
        line = f"{stamp} {record.levelname:<7} {short_name(record.name)}  {printable(record.getMessage())}"
        if not isinstance(getattr(record, "rdq_task", None), dict):
            # The engine's outcome line already says everything in its message.
            pairs = {**(getattr(record, "rdq_keys", None) or {}), **_extras(record)}
            shown = " ".join(f"{k}={_text_value(v)}" for k, v in pairs.items() if isinstance(v, _SCALARS))
            if shown:
                line = f"{line}  {shown}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        elif record.exc_text:
            line = f"{line}\n{record.exc_text}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or not text.isprintable() or any(c.isspace() for c in text)) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the task's
    fields flattened, every extra field; ``exception`` with the traceback if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=timezone.utc)
        document: dict[str, Any] = {
            "time": created.strftime("%Y-%m-%dT%H:%M:%S.") + f"{created.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields: dict[str, Any] = dict(getattr(record, "rdq_keys", None) or {})
        fields.update(_extras(record))
        task_fields = getattr(record, "rdq_task", None)
        if isinstance(task_fields, dict):
            fields.update(task_fields)
        for key, value in fields.items():
            document[key if key not in document else f"field_{key}"] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
            document["exception_type"] = getattr(record.exc_info[0], "__name__", None)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, default=str, ensure_ascii=False, separators=(",", ":"))


# -- helpers -----------------------------------------------------------------------------------
def _level(level: str | int) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    name = str(level).strip().upper()
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise InvalidInput(f"log level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not {level!r}", field="log_level")
    return value


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _is_plain_std_stream_handler(handler: logging.Handler) -> bool:
    if type(handler) is not logging.StreamHandler:
        return False
    return handler.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
