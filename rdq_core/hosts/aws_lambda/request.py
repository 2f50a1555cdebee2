"""One API request as the route functions see it, and the reply they return.

The route functions (``routes.py``) read the REST proxy event only through ``ApiRequest`` and
answer with a ``Reply``; ``api.py`` turns the reply into the resolver's response. So a route is
plain Python: no resolver, no Powertools, no module-level "current event".
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...errors import InvalidInput
from ...problems import ApiProblem
from .settings import Settings


@dataclass(frozen=True)
class Reply:
    """A JSON answer: status, body (serialised by the API), extra headers."""

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


class ApiRequest:
    """The REST proxy event of one request, and the settings it is served under."""

    def __init__(self, event: Mapping[str, Any], settings: Settings) -> None:
        self.event = event
        self.settings = settings

    @property
    def path(self) -> str:
        return self.event.get("path") or "/"

    @property
    def stage_prefix(self) -> str:
        """What precedes the routed path in the URL the client used: behind API Gateway the request
        context path carries the stage (``/Prod/v1/...``); locally there is none."""
        full_path = (self.event.get("requestContext") or {}).get("path") or self.path
        return full_path[: -len(self.path)] if full_path.endswith(self.path) else ""

    @property
    def actor(self) -> str:
        """Who the audit trail records for this request: the caller's IAM principal (SigV4), the
        id of the API key it presented, or ``local`` for ``rdq dev``. API Gateway fills these in
        ``requestContext.identity`` after it authenticated the caller; nothing the client sends
        in headers or body can set them."""
        context = self.event.get("requestContext") or {}
        identity = context.get("identity") or {}
        if identity.get("userArn"):
            return str(identity["userArn"])
        if identity.get("apiKeyId"):
            return f"api-key:{identity['apiKeyId']}"
        if context.get("apiId") == "local":
            return "local"
        return "anonymous"

    def header(self, name: str) -> str | None:
        wanted = name.lower()
        headers: Mapping[str, str] = self.event.get("headers") or {}
        for key, value in headers.items():
            if key.lower() == wanted:
                return value
        return None

    def query(self, allowed: tuple[str, ...]) -> dict[str, str]:
        """The query parameters, refusing any not in ``allowed``: a misspelt filter must not
        silently widen what a request lists (or invites purging)."""
        params = self.event.get("queryStringParameters") or {}
        unknown = set(params) - set(allowed)
        if unknown:
            raise InvalidInput(f"unknown query parameters: {', '.join(sorted(unknown))}", sorted(unknown)[0])
        return dict(params)

    def _raw_body(self) -> bytes:
        body = self.event.get("body")
        if body is None:
            return b""
        if self.event.get("isBase64Encoded"):
            try:
                return base64.b64decode(body, validate=True)
            except (binascii.Error, ValueError):
                raise ApiProblem(400, "the request body is not valid base64") from None
        return body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)

    def require_json_type(self) -> None:
        """415 unless the request says ``Content-Type: application/json`` (or ``application/*+json``)."""
        content_type = (self.header("content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json" and not (
                content_type.startswith("application/") and content_type.endswith("+json")):
            raise ApiProblem(415, "send the body as application/json", headers={"Accept-Post": "application/json"})

    def json_body(self) -> dict[str, Any]:
        """The request body as a JSON object, or the precise 4xx for why it is not one."""
        raw = self._raw_body()
        limit = self.settings.max_body_bytes
        if len(raw) > limit:
            raise ApiProblem(413, f"the request body exceeds {limit} bytes")
        self.require_json_type()
        if not raw.strip():
            raise ApiProblem(400, "the request body is empty; a JSON object is required")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiProblem(400, f"the request body is not valid JSON: {exc}"[:300]) from None
        except RecursionError:
            raise ApiProblem(400, "the request body nests too deeply") from None
        if not isinstance(data, dict):
            raise InvalidInput("the request body must be a JSON object", "body")
        return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # {"handler": "a", "handler": "b"} means different things to different parsers (a gateway or
    # WAF may read the first, Python keeps the last): refuse the ambiguity instead of picking.
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:100]!r} in an object")
            seen.add(key)
    return data
