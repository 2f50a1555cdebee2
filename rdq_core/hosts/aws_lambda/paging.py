"""List pages bounded by bytes, so an answer always fits Lambda's response limit.

Lambda refuses an invocation result over 6 MB (API Gateway then answers 502), and a page of 50
dead tasks with 200 KB payloads is 10 MB. The proxy result carries the JSON body as a JSON
string, so each quote and backslash of the body is escaped once more; an item is measured as it
travels (``json.dumps`` of its ``json.dumps``). A page takes items while their total stays within
``RDQ_RESPONSE_BUDGET_BYTES`` (4,000,000 by default: well under 6 MB with the headers and the
rest of the result), always at least one, and ends early with the cursor of its last item: the
next page starts right after it, as if ``limit`` had been that small. Clients page as ever, by
``next_cursor``.

``fields=summary`` leaves each task's payload and result out (``payload_omitted: true``), for
listings that only need ids, statuses and errors.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence, TypeVar

from ...errors import InvalidInput
from ...model import AuditEntry, Task
from ...storage.core import ORDER_FIELD
from ...storage.spi import encode_audit_cursor, encode_dead_cursor, encode_task_cursor

#: The ``fields`` query parameter's values: every field (the default), or tasks without payload and result.
FIELDS = ("", "full", "summary")

Item = TypeVar("Item")


def fields_of(params: Mapping[str, str]) -> str:
    value = params.get("fields") or ""
    if value not in FIELDS:
        raise InvalidInput("fields must be full or summary", "fields")
    return value or "full"


def task_body(task: Task, fields: str) -> dict[str, Any]:
    body = task.to_dict()
    if fields == "summary":
        del body["payload"], body["result"]
        body["payload_omitted"] = True
    return body


def wire_size(body: Any) -> int:
    """Bytes ``body`` takes inside the Lambda proxy result (a JSON string inside JSON)."""
    return len(json.dumps(json.dumps(body)).encode())


def within_budget(items: Sequence[Item], body: Callable[[Item], dict[str, Any]], cursor_after: Callable[[Item], str],
                  next_cursor: str | None, budget: int) -> tuple[list[dict[str, Any]], str | None]:
    """The bodies of the leading ``items`` whose wire size fits ``budget`` (at least one), and the
    cursor that continues after the last one kept (``next_cursor`` when all fit)."""
    kept: list[dict[str, Any]] = []
    used = 0
    for index, item in enumerate(items):
        encoded = body(item)
        size = wire_size(encoded) + 2  # and its separator
        if kept and used + size > budget:
            return kept, cursor_after(items[index - 1])
        kept.append(encoded)
        used += size
    return kept, next_cursor


def dead_cursor_after(queue: str) -> Callable[[Task], str]:
    def cursor(task: Task) -> str:
        assert task.dead_at is not None, "a dead task has a dead_at"
        return encode_dead_cursor(queue, task.dead_at, task.id)

    return cursor


def task_cursor_after(queue: str) -> Callable[[Task], str]:
    def cursor(task: Task) -> str:
        at = getattr(task, ORDER_FIELD[task.status])
        assert at is not None, f"a {task.status.value} task has a {ORDER_FIELD[task.status]}"
        return encode_task_cursor(queue, task.status, at, task.id)

    return cursor


def audit_cursor_after(queue: str | None) -> Callable[[AuditEntry], str]:
    return lambda entry: encode_audit_cursor(queue, entry.at, entry.id)
