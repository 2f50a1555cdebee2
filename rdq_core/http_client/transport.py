"""The wire under ``HttpClient``: the API's address, one request over ``http.client`` (HTTPS
with certificate verification, a connect and a read timeout), retries, and the API's problems
turned into rdq's exceptions.

Retries (capped, jittered exponential backoff, bounded in total time) follow how a request may
be repeated: ``IDEMPOTENT`` -- reads, and enqueues (which always carry an id): any failure may be
retried; ``ONCE`` -- redrive, purge and cancel. A repeat after the API acted would not be a no-op
in what it answers (a second redrive/purge counts 0, or acts on tasks that died in between; a
second cancel answers 409), so these are retried only when the API certainly did not act: the
connection failed before the request was sent, or the answer was 429 (throttled at the gateway)
or 503 (the store was unreachable; nothing was written).
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import time
import urllib.parse
from typing import Any, Mapping, TypedDict, Unpack

from ..errors import (
    ApiUnavailable,
    ConfigurationError,
    InvalidCursor,
    InvalidInput,
    NotAuthorized,
    RdqError,
    TaskConflict,
    TaskNotFound,
)
from .auth import Auth, default_auth

IDEMPOTENT, ONCE = "idempotent", "once"
_RETRY_STATUSES = {IDEMPOTENT: frozenset({429, 500, 502, 503, 504}), ONCE: frozenset({429, 503})}


class NotSent(Exception):
    """A connection failure before any byte of the request left: always safe to retry."""


class Response:
    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


class ApiEndpoint:
    """A deployed API's (or ``rdq dev``'s) base URL, ``http(s)://host[:port][/stage]``, and the
    connections to it; shared by ``HttpClient`` and ``rdq console``, which both sign what they send."""

    def __init__(self, api_url: str) -> None:
        parts = urllib.parse.urlsplit(api_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError("the API URL must be http(s)://host[:port][/stage]")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ConfigurationError("the API URL must not carry credentials, a query or a fragment")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        if (parts.scheme, parts.port) in (("https", 443), ("http", 80)):
            self.port = None  # the Host header then matches the host SigV4 signs (no default port)
        self.base_path = parts.path.rstrip("/")
        #: What messages name: scheme, host and port, never a path, key or token.
        self.api = f"{parts.scheme}://{parts.netloc}"

    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.port else host

    def target(self, path: str) -> str:
        """The request target of an API path (``/v1/...``, with its query): under the stage."""
        return self.base_path + path

    def url(self, path: str) -> str:
        """The full URL of an API path, as it is signed."""
        return f"{self.scheme}://{self.netloc()}{self.target(path)}"

    def connect(self, connect_timeout: float, read_timeout: float, ssl_context: ssl.SSLContext) -> http.client.HTTPConnection:
        """A connection, open, whose reads then time out after ``read_timeout``; ``NotSent`` if it
        could not be opened (nothing was sent). The caller closes it."""
        connection: http.client.HTTPConnection
        if self.scheme == "https":
            connection = http.client.HTTPSConnection(self.host, self.port, timeout=connect_timeout, context=ssl_context)
        else:
            connection = http.client.HTTPConnection(self.host, self.port, timeout=connect_timeout)
        try:
            connection.connect()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise NotSent() from exc
        assert connection.sock is not None
        connection.sock.settimeout(read_timeout)
        return connection


class TransportOptions(TypedDict, total=False):
    """How requests travel; each has a default. ``connect_timeout`` (5 s) and ``read_timeout``
    (35 s, past API Gateway's 29 s); ``retry_seconds`` (30 s), the total a call may spend
    retrying, with backoff from ``backoff_initial`` (0.2 s) doubling up to ``backoff_max`` (5 s);
    ``ssl_context`` (the system's, verifying certificate and host name)."""

    connect_timeout: float
    read_timeout: float
    retry_seconds: float
    backoff_initial: float
    backoff_max: float
    ssl_context: ssl.SSLContext | None


class ApiTransport:
    """Requests to the rdq API, signed with ``auth``, retried as their kind allows."""

    def __init__(self, api_url: str, *, auth: Auth | None = None, **options: Unpack[TransportOptions]) -> None:
        unknown = sorted(set(options) - set(TransportOptions.__annotations__))
        if unknown:  # a misspelt option must not be dropped silently
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        self.endpoint = ApiEndpoint(api_url)
        #: What messages name: scheme, host and port, never a path, key or token.
        self.api = self.endpoint.api
        #: ``None``: ``default_auth`` (no credentials on loopback, SigV4 elsewhere).
        self.auth: Auth = auth if auth is not None else default_auth(api_url)
        self.connect_timeout = options.get("connect_timeout", 5.0)
        self.read_timeout = options.get("read_timeout", 35.0)
        self.retry_seconds = options.get("retry_seconds", 30.0)
        self.backoff_initial = options.get("backoff_initial", 0.2)
        self.backoff_max = options.get("backoff_max", 5.0)
        # None, or not given: the system's, which verifies the certificate and the host name.
        self._ssl_context = options.get("ssl_context") or ssl.create_default_context()

    def _call(self, method: str, path: str, retry: str, *, body: Any = None, task_id: str | None = None,
              headers: Mapping[str, str] | None = None) -> Response:
        data = b"" if body is None else json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            attempt += 1
            failure: str
            retry_after: float | None = None
            try:
                response = self._send(method, path, data, headers)
            except NotSent as exc:
                failure = f"could not connect ({exc.__cause__.__class__.__name__})"
            except (OSError, http.client.HTTPException) as exc:  # a read timeout is an OSError too
                # The request may have reached the API: only an idempotent one is repeated.
                failure = f"the connection failed ({type(exc).__name__})"
                if retry != IDEMPOTENT:
                    raise ApiUnavailable(f"rdq API at {self.api}: {failure}; the {method} may or may not have been"
                                         " applied") from None
            else:
                if response.status < 400:
                    return response
                if response.status not in _RETRY_STATUSES[retry]:
                    raise self._error(response, task_id)
                failure = f"answered {response.status}"
                retry_after = _retry_after(response.headers.get("retry-after"))
            pause = min(self.backoff_max, self.backoff_initial * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            if retry_after is not None:
                pause = max(pause, min(retry_after, self.backoff_max))
            if time.monotonic() + pause > deadline:
                raise ApiUnavailable(f"rdq API at {self.api}: {failure}; gave up after {attempt} attempt(s)")
            time.sleep(pause)

    def _send(self, method: str, path: str, data: bytes, extra: Mapping[str, str] | None = None) -> Response:
        headers = {"Accept": "application/json"}
        if data:
            headers["Content-Type"] = "application/json"
        headers.update(extra or {})  # the trace context of an enqueue (traceparent, tracestate)
        headers.update(self.auth.headers(method, self.endpoint.url(path), headers, data))
        connection = self.endpoint.connect(self.connect_timeout, self.read_timeout, self._ssl_context)
        try:
            connection.request(method, self.endpoint.target(path), body=data if data or method in ("POST", "PUT") else None,
                               headers=headers)
            response = connection.getresponse()
            return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            connection.close()

    def _error(self, response: Response, task_id: str | None) -> RdqError:
        problem = response.json()
        problem = problem if isinstance(problem, dict) else {}
        detail = str(problem.get("detail") or problem.get("message") or f"HTTP {response.status}")
        field = problem.get("field") if isinstance(problem.get("field"), str) else None
        status = response.status
        if status in (400, 413, 415, 422):
            if status == 400 and field == "cursor":
                return InvalidCursor(detail)
            return InvalidInput(detail, field)
        if status == 404 and task_id is not None and _is_rdq_not_found(response, problem):
            return TaskNotFound(task_id)
        if status == 409:
            return TaskConflict(detail)
        if status in (401, 403):
            return NotAuthorized(f"rdq API at {self.api} refused the credentials ({status}): {detail}")
        if status in (404, 405):
            # A route the API does not have, or not rdq at all: most often a URL without its
            # stage (…/prod). Never reported as a missing task, which would hide the mistake.
            return ConfigurationError(f"rdq API at {self.api} answered {status} for one of rdq's routes"
                                      " without rdq's not-found problem; check the API URL and its stage path")
        if status >= 500 or status == 429:
            return ApiUnavailable(f"rdq API at {self.api} answered {status}: {detail}")
        return RdqError(f"rdq API at {self.api} answered {status}: {detail}")


def _is_rdq_not_found(response: Response, problem: Mapping[str, Any]) -> bool:
    """Whether a 404 is rdq's own "no such task/operation/schedule" problem (field ``id``), not a
    route missing under a wrong base URL or another server's page."""
    content_type = (response.headers.get("content-type") or "").split(";")[0].strip().lower()
    return (content_type == "application/problem+json" and problem.get("type") == "urn:rdq:problem:not-found"
            and problem.get("field") == "id")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
