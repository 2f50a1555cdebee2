"""Lambda-shaped events and a Lambda context with a real deadline, for local hosts and tests.

``rdq dev`` and the test suite drive the real handlers with these, so the code paths are the
ones Lambda runs: the same REST proxy event (API Gateway "aws-proxy" shape), the same
EventBridge scheduled event, and a context whose ``get_remaining_time_in_millis`` counts down.
"""

from __future__ import annotations

import base64
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Mapping
from urllib.parse import parse_qs, urlsplit

REGION = "us-east-1"
ACCOUNT = "123456789012"


class LocalLambdaContext:
    """The attributes Powertools and the rdq functions read from a Lambda context."""

    def __init__(self, function_name: str, timeout_seconds: float, memory_mb: int = 512) -> None:
        self.function_name = function_name
        self.function_version = "$LATEST"
        self.memory_limit_in_mb = memory_mb
        self.invoked_function_arn = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{function_name}"
        self.aws_request_id = str(uuid.uuid4())
        self.log_group_name = f"/aws/lambda/{function_name}"
        self.log_stream_name = "local"
        self._deadline = time.monotonic() + timeout_seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def scheduled_event(rule_name: str) -> dict[str, Any]:
    """The event EventBridge sends to a schedule target."""
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": ACCOUNT,
        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": REGION,
        "resources": [f"arn:aws:events:{REGION}:{ACCOUNT}:rule/{rule_name}"],
        "detail": {},
    }


# template.yaml declares one resource, ``/{proxy+}``, which takes every path (the function routes
# on the full path, from routes.ROUTES): the event's ``resource`` and ``pathParameters`` are
# filled the way API Gateway fills them for it.
PROXY_RESOURCE = "/{proxy+}"


def api_proxy_event(
    method: str,
    target: str,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    stage: str = "local",
    source_ip: str = "127.0.0.1",
) -> dict[str, Any]:
    """An API Gateway REST "aws-proxy" event for ``method target`` (path with query string)."""
    split = urlsplit(target)
    path = split.path or "/"
    query = parse_qs(split.query, keep_blank_values=True)
    headers = dict(headers or {})
    text_body: str | None = None
    is_base64 = False
    if body:
        try:
            text_body = body.decode("utf-8")
        except UnicodeDecodeError:
            text_body, is_base64 = base64.b64encode(body).decode(), True
    now = datetime.now(timezone.utc)
    return {
        "resource": PROXY_RESOURCE,
        "path": path,
        "httpMethod": method.upper(),
        "headers": headers or None,
        "multiValueHeaders": {k: [v] for k, v in headers.items()} or None,
        "queryStringParameters": {k: v[-1] for k, v in query.items()} or None,
        "multiValueQueryStringParameters": query or None,
        "pathParameters": {"proxy": path.lstrip("/")},
        "stageVariables": None,
        "requestContext": {
            "accountId": ACCOUNT,
            "apiId": "local",
            "resourceId": "local",
            "resourcePath": PROXY_RESOURCE,
            "httpMethod": method.upper(),
            "path": path,
            "stage": stage,
            "protocol": "HTTP/1.1",
            "requestId": str(uuid.uuid4()),
            "requestTime": now.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "requestTimeEpoch": int(now.timestamp() * 1000),
            "identity": {"sourceIp": source_ip, "userAgent": headers.get("User-Agent") or headers.get("user-agent")},
        },
        "body": text_body,
        "isBase64Encoded": is_base64,
    }


_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_STRING_MAPS = ("headers", "queryStringParameters", "pathParameters", "stageVariables")
_LIST_MAPS = ("multiValueHeaders", "multiValueQueryStringParameters")


def proxy_event_problem(event: Mapping[str, Any]) -> str | None:
    """What keeps ``event`` from being an API Gateway REST "aws-proxy" event the API function can
    serve, else None. API Gateway always sends a well-formed one; a hand-written event file
    (``rdq invoke api``) may not, and deserves a sentence rather than a ``KeyError``."""
    method = event.get("httpMethod")
    if not isinstance(method, str) or method.upper() not in _HTTP_METHODS:
        return (f"'httpMethod' must be one of {', '.join(sorted(_HTTP_METHODS))}"
                if "httpMethod" in event else "it has no 'httpMethod'")
    path = event.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        return "'path' must be a string starting with /" if "path" in event else "it has no 'path'"
    for name in _STRING_MAPS:
        value = event.get(name)
        if value is not None and not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
            return f"'{name}' must be null or an object of strings"
    for name in _LIST_MAPS:
        value = event.get(name)
        if value is not None and not (isinstance(value, dict) and all(
                isinstance(v, list) and all(isinstance(item, str) for item in v) for v in value.values())):
            return f"'{name}' must be null or an object of lists of strings"
    if event.get("body") is not None and not isinstance(event["body"], str):
        return "'body' must be null or a string"
    if not isinstance(event.get("isBase64Encoded", False), bool):
        return "'isBase64Encoded' must be true or false"
    if event.get("requestContext") is not None and not isinstance(event["requestContext"], dict):
        return "'requestContext' must be an object"
    return None


def proxy_result_body(result: Mapping[str, Any]) -> bytes:
    body = result.get("body") or ""
    if result.get("isBase64Encoded"):
        return base64.b64decode(body)
    return body.encode("utf-8")


def proxy_result_headers(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Single- and multi-value headers of a proxy result, as HTTP header lines."""
    lines: list[tuple[str, str]] = []
    multi = result.get("multiValueHeaders") or {}
    for name, values in multi.items():
        for value in values:
            lines.append((name, str(value)))
    for name, value in (result.get("headers") or {}).items():
        if name not in multi:
            lines.append((name, str(value)))
    return lines
