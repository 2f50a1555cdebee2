"""How ``rdq`` commands print: human-readable lines with the store's text made printable, tables,
``--json`` (stable, machine-readable), errors on standard error, and the one confirmation prompt.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence, TextIO

from ...errors import InvalidInput
from ...model import TaskStatus
from ...text import printable


def say(text: str, file: TextIO | None = None, flush: bool = False) -> None:
    """``print`` for human-readable output. Text from the store (ids, error messages) can carry
    what a task's payload put there: escape anything non-printable, so a payload cannot drive
    the operator's terminal or forge a line. ``--json`` output needs no help (JSON escapes)."""
    print(printable(text), file=file, flush=flush)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def fail(exc: BaseException | str, code: int) -> int:
    say(f"rdq: error: {exc}", file=sys.stderr)
    return code


def silence_stdout() -> None:
    # Python flushes stdout at exit and would fail again on the closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, empty: str) -> None:
    if not rows:
        say(empty)
        return
    printed = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in [tuple(header), *printed]) for i in range(len(header))]
    for row in [tuple(header), *printed]:
        say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def print_dead_table(tasks: Sequence[Any]) -> None:
    print_table(("ID", "HANDLER", "ERROR", "ATTEMPTS", "DEAD AT"), [
        (t.id, t.handler, t.last_error.type if t.last_error else "-", str(len(t.attempts)),
         t.dead_at.isoformat() if t.dead_at else "-")
        for t in tasks], empty="no dead tasks")


def print_task(task: Any, as_json: bool) -> None:
    if as_json:
        print_json(task.to_dict())
        return
    say(f"{task.id}  {task.status.value}  queue={task.queue} handler={task.handler}")
    due = f" next_attempt_at={at_or_dash(task.next_attempt_at)}" if task.status is TaskStatus.PENDING else ""
    say(f"  attempt_count={task.attempt_count} redrive_count={task.redrive_count}{due}")
    if task.status is TaskStatus.IN_FLIGHT:
        # The running attempt: since when, until when its lease holds, and who holds it.
        say(f"  running: claimed_at={at_or_dash(task.claimed_at)} lease_expires_at={at_or_dash(task.lease_expires_at)} "
            f"worker={task.claimed_by or '-'}")
    if task.result is not None:
        say(f"  result={json.dumps(task.result)[:200]}")
    for a in task.attempts:
        error = f" {a.error.type}: {a.error.message[:120]}" if a.error else ""
        say(f"  #{a.attempt_no:<3} {a.outcome.value:<18} {at_or_dash(a.finished_at)}{error}")


def at_or_dash(value: Any) -> str:
    return value.isoformat() if value is not None else "-"


def print_operation(operation: Any, as_json: bool) -> None:
    if as_json:
        print_json(operation.to_dict())
        return
    rate = f" at {operation.rate_per_second:g}/s" if operation.rate_per_second else ""
    say(f"operation {operation.id}: {operation.action} on queue {operation.queue}{rate}: {operation.status}, "
         f"{operation.done} of {operation.matched} done")


def ask_to_confirm(question: str) -> None:
    if not sys.stdin.isatty():
        raise InvalidInput(f"refusing to {question.rstrip('?')} without confirmation: pass --yes "
                           f"(or --dry-run to see what would change)", "--yes")
    answer = input(printable(f"{question} [y/N] ")).strip().lower()
    if answer not in ("y", "yes"):
        raise InvalidInput("not confirmed; nothing was changed", "--yes")


def hint_full_error_type(error_type: str) -> None:
    say(f"note: error types are matched in full, e.g. 'rdq_core.errors.{error_type}' or 'mymodule.{error_type}'; "
         f"`rdq dlq list QUEUE` shows them", file=sys.stderr)
