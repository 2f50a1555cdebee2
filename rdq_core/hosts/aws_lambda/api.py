"""The API function: the route table (``routes.py``) served by Powertools' ``APIGatewayRestResolver``.

Errors are ``application/problem+json`` (RFC 9457, built by ``rdq_core.problems``) with a precise
status: 400 malformed JSON, 401 missing bearer token (only when ``RDQ_API_TOKEN`` is set), 404
unknown task or route, 405 known route with another method, 409 conflicts, 413 body or payload
too large, 415 not JSON, 422 invalid fields, 503 storage unreachable. Anything unexpected is a
bare 500 problem: the stack trace goes to the log, never into the response. Payloads are never
logged unless the deployer opts in with ``RDQ_LOG_PAYLOADS=true``.

This module only adapts: it registers every route of the table on the resolver, turns a route's
``Reply`` or an ``RdqError`` into the proxy result, and checks the local bearer token.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable, Mapping

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response

from ...errors import RdqError, StorageUnavailable
from ...problems import PROBLEM_JSON, ApiProblem, problem_for, problem_json
from .invocation import ModulePin
from .invoker import invoker
from .observability import logger, metrics, tracer
from .request import ApiRequest, Reply
from .routes import ROUTES, Route, allowed_methods
from .settings import Settings

__all__ = ["ApiProblem", "PROBLEM_JSON", "app", "handle_api_event", "lambda_handler"]

app = APIGatewayRestResolver()


def _instance() -> str | None:
    try:
        return app.current_event.path
    except Exception:  # noqa: BLE001 - no current event (resolver failed early)
        return None


def problem(status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None) -> Response[str]:
    return Response(status_code=status, content_type=PROBLEM_JSON, body=problem_json(status, detail, field, _instance()),
                    headers=dict(headers or {}))


def _response(reply: Reply) -> Response[str]:
    return Response(status_code=reply.status, content_type="application/json", body=json.dumps(reply.body),
                    headers=dict(reply.headers))


# -- the routes, registered from the table -----------------------------------------------------
def _serve(route: Route) -> Callable[..., Response[str]]:
    def serve(**path_parameters: str) -> Response[str]:
        request = ApiRequest(app.current_event.raw_event, app.context["settings"])
        return _response(route.handler(request, **path_parameters))

    serve.__name__ = route.handler.__name__
    return serve


for _route in ROUTES:
    app.route(_route.resolver_rule, _route.method)(_serve(_route))


# -- errors -----------------------------------------------------------------------------------
@app.not_found
def not_found(exc: Exception) -> Response[str]:
    path = app.current_event.path
    methods = allowed_methods(path)
    if methods is not None:
        return problem(405, f"{app.current_event.http_method} is not allowed here; use {methods}", headers={"Allow": methods})
    return problem(404, f"no route for {app.current_event.http_method} {path}")


@app.exception_handler(RdqError)
def on_rdq_error(exc: RdqError) -> Response[str]:
    answer = problem_for(exc)
    if answer is None:
        return _internal_error()
    if isinstance(exc, StorageUnavailable):
        logger.warning("storage unavailable", extra={"error": str(exc)})
    return problem(answer.status, answer.detail, answer.field, answer.headers)


@app.exception_handler(Exception)
def on_unexpected(exc: Exception) -> Response[str]:
    return _internal_error()


def _internal_error() -> Response[str]:
    # Called while the exception is being handled: the log line carries its stack trace.
    logger.exception("unhandled error in the API")
    return problem(500, "internal error; see the function's log")


# -- entry point ------------------------------------------------------------------------------
def _unauthorized(settings: Settings, event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The local bearer-token check (``RDQ_API_TOKEN``); deployed APIs authenticate at API Gateway."""
    if not settings.api_token:
        return None
    headers = {k.lower(): v for k, v in (event.get("headers") or {}).items()}
    supplied = headers.get("authorization") or ""
    scheme, _, token = supplied.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_token.encode()):
        return None
    body = problem_json(401, "send Authorization: Bearer <RDQ_API_TOKEN>", instance=event.get("path"))
    return {"statusCode": 401, "headers": {"Content-Type": PROBLEM_JSON, "WWW-Authenticate": 'Bearer realm="rdq"'},
            "multiValueHeaders": {}, "body": body, "isBase64Encoded": False}


#: On every answer of the API: its bodies are per caller and per moment (no cache may keep one),
#: and JSON must never be sniffed into something a browser would render.
RESPONSE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def _with_response_headers(result: dict[str, Any]) -> dict[str, Any]:
    multi = result.get("multiValueHeaders") or {}
    present = {name.lower() for name in (*multi, *(result.get("headers") or {}))}
    missing = {name: value for name, value in RESPONSE_HEADERS.items() if name.lower() not in present}
    if missing:
        result["headers"] = {**(result.get("headers") or {}), **missing}
    return result


def handle_api_event(event: dict[str, Any], context: Any) -> dict[str, Any]:
    settings = Settings.from_env()
    if settings.wake_worker and settings.worker_function:
        invoker.prepare()  # the client a wake-up needs, built while this request does its I/O
    denied = _unauthorized(settings, event)
    if denied is not None:
        return _with_response_headers(denied)
    app.append_context(settings=settings)
    try:
        return _with_response_headers(app.resolve(event, context))
    finally:
        app.clear_context()


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId", clear_state=True)
@tracer.capture_lambda_handler(capture_response=False)
@metrics.log_metrics
def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    _modules.restore()  # before the lazy imports: the storage driver, boto3 for the wake-up
    return handle_api_event(event, context)


#: Taken last, when every module this entry point needs is loaded.
_modules = ModulePin(__name__)
