"""The one builder of ``application/problem+json`` bodies (RFC 9457), and the map from rdq's
errors to HTTP statuses.

Every answer that is an error -- the Lambda API's, the dev server's own refusals (before a
request reaches the API) and its 401 -- is built here, so the ``type`` URNs, titles and field
order are the same wherever a client meets them (docs/limits.md lists the URNs).

```python
problem_json(404, "task 'x' not found", field="id", instance="/v1/tasks/x")
# '{"type": "urn:rdq:problem:not-found", "title": "Not Found", "status": 404, ...}'
```
No dependency beyond the standard library: the dev server uses it without Powertools.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Mapping

from .errors import InvalidCursor, InvalidInput, RdqError, StorageUnavailable, TaskConflict, TaskNotFound

PROBLEM_JSON = "application/problem+json"

#: RFC 9110 titles, pinned: Python renamed these phrases in 3.13 ("Request Entity Too Large",
#: "Unprocessable Entity" before), and the problem ``type`` URNs derived from them must not change
#: with the runtime.
_TITLES = {413: "Content Too Large", 422: "Unprocessable Content"}


class ApiProblem(RdqError):
    """A request refused before it reached the engine (size, type, syntax, auth), with the exact
    status, and any headers the answer needs (``Allow``, ``Accept-Post``, ``Retry-After``)."""

    def __init__(self, status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})


def problem_title(status: int) -> str:
    return _TITLES.get(status) or HTTPStatus(status).phrase


def problem_type(status: int) -> str:
    return f"urn:rdq:problem:{problem_title(status).lower().replace(' ', '-')}"


def problem_body(status: int, detail: str, field: str | None = None, instance: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": problem_type(status), "title": problem_title(status), "status": status, "detail": detail}
    if field is not None:
        body["field"] = field
    if instance is not None:
        body["instance"] = instance
    return body


def problem_json(status: int, detail: str, field: str | None = None, instance: str | None = None) -> str:
    return json.dumps(problem_body(status, detail, field, instance))


def problem_for(exc: RdqError) -> ApiProblem | None:
    """The problem an engine error answers with over HTTP, or ``None`` when it has no status of its
    own (then it is an unexpected error: a bare 500, its details only in the log)."""
    if isinstance(exc, ApiProblem):
        return exc
    if isinstance(exc, InvalidInput):
        # A cursor is opaque: a bad one is a malformed request (400), not an invalid field value.
        return ApiProblem(400 if isinstance(exc, InvalidCursor) else 422, str(exc), exc.field)
    if isinstance(exc, TaskNotFound):
        return ApiProblem(404, str(exc), "id")
    if isinstance(exc, TaskConflict):
        return ApiProblem(409, str(exc))
    if isinstance(exc, StorageUnavailable):
        # Never the backend's message: it can carry a host name or a driver's detail.
        return ApiProblem(503, "the task store is unavailable; retry later", headers={"Retry-After": "5"})
    return None
