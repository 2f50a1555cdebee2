"""The request checks the storage core makes before any store sees a call.

A leaf (the vocabulary only), shared by ``core.py`` and its per-resource parts.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidInput
from ..model import TaskStatus

_DOCUMENT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:~-]{0,199}")


def require_text(value: Any, field: str) -> None:
    # A request value must never reach a store as anything but text: {"$gt": ""} as an id would
    # read as a query operator on a document store.
    if not isinstance(value, str):
        raise InvalidInput(f"{field} must be a string", field=field)


def require_limit(limit: Any) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInput("limit must be a positive integer", field="limit")


def require_status(status: Any) -> TaskStatus:
    try:
        return TaskStatus(status)
    except ValueError:
        raise InvalidInput(f"status must be one of {', '.join(s.value for s in TaskStatus)}", field="status") from None


def require_document_key(kind: Any, key: Any) -> None:
    for field, value in (("kind", kind), ("key", key)):
        if not isinstance(value, str) or not _DOCUMENT_KEY.fullmatch(value):
            raise InvalidInput(f"a document {field} is 1..200 characters of [A-Za-z0-9._:~-]", field=field)
