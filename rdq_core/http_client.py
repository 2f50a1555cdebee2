"""``HttpClient``: the ``Client`` interface over a deployed rdq API (or ``rdq dev``), over HTTPS.

```python
from rdq_core.http_client import ApiKey, BearerToken, HttpClient, SigV4

# A deployed stack (IAM auth): SigV4 is the default for any API that is not on a loopback
# address, with the standard AWS credential chain as the AWS CLI resolves it (environment,
# profile, SSO, instance/container role); region from the profile, else from the execute-api host.
rdq = HttpClient("https://abc123.execute-api.eu-west-1.amazonaws.com/prod")
rdq = HttpClient("https://abc123.execute-api.eu-west-1.amazonaws.com/prod", auth=SigV4(profile="ops"))
rdq = HttpClient(url, auth=ApiKey("…"))                        # AuthMode=apikey stacks (x-api-key)
rdq = HttpClient("http://127.0.0.1:8787")                       # rdq dev: loopback, no credentials by default
rdq = HttpClient("http://127.0.0.1:8787", auth=BearerToken(os.environ["RDQ_API_TOKEN"]))  # rdq dev with a token

task = rdq.enqueue("emails", "send_email", {"to": "a@b.c"}, id="order-42")
rdq.get(task.id).attempts
rdq.stats("emails").pending
page = rdq.list_dead("emails", error_type="TimeoutError")
rdq.redrive("emails", ids=[t.id for t in page.tasks])
```

Methods, signatures, return types and exceptions are ``Client``'s. The API validates (the same
code as ``Client``), so its refusals come back as the same exceptions: ``InvalidInput`` (with
``field``; ``InvalidCursor`` for a bad cursor), ``TaskNotFound``, ``TaskConflict``. Besides:
``NotAuthorized`` (401/403), and ``ApiUnavailable`` -- a ``StorageUnavailable`` -- when the API
cannot be reached or keeps answering 429/5xx until the retry budget (``retry_seconds``) is spent.
Its message names the API's host, never credentials.

Retries (capped, jittered exponential backoff, bounded in total time): reads and enqueues are
retried on connection errors, 429 and 5xx. That is safe for enqueue because every task carries an
id: one is generated here, before the first attempt, when the caller gave none, so a repeat after
a lost response finds the task already written (``created`` False) instead of writing another.

Differences from ``Client``: ``connection=`` (joining a database transaction) cannot cross HTTP
and raises ``UnsupportedOperation``; ``enqueue_many``'s per-item results carry what the batch
route answers (id, queue, status) with the request's own fields (handler, payload, headers,
max_attempts, backoff), no timestamps; a conflicting item's task has only its id, the requested
queue and status PENDING, because the API does not reveal the other queue's task.

Transport is the standard library (``http.client``): HTTPS with certificate verification, a
connect timeout and a read timeout. botocore is needed only for ``SigV4`` and imported then.
"""

from __future__ import annotations

import enum
import hashlib
import http.client
import ipaddress
import json
import os
import random
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, Unpack

from .errors import (
    ApiUnavailable,
    ConfigurationError,
    InvalidCursor,
    InvalidInput,
    NotAuthorized,
    RdqError,
    TaskConflict,
    TaskNotFound,
    UnsupportedOperation,
)
from .engine import payloads as payload_objects
from .engine import operations, tracecontext
from .client_protocol import EnqueueOptions, QueueClient, check_enqueue_options
from .ids import new_task_id
from .validation import Limits
from .engine.operations import Operation
from .model import AuditPage, Backoff, DeadPage, EnqueueResult, NewTask, QueueStats, Task, TaskPage, TaskStatus

__all__ = ["ApiKey", "Auth", "BearerToken", "HttpClient", "NoAuth", "SigV4", "default_auth", "plaintext_credential_warning"]


# -- authentication ----------------------------------------------------------------------------
class Auth(Protocol):
    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """The headers to add to a request about to be sent (called again for every retry)."""


@dataclass(frozen=True)
class BearerToken:
    """``Authorization: Bearer <token>``: ``rdq dev`` with ``RDQ_API_TOKEN``."""

    token: str

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def __repr__(self) -> str:
        return "BearerToken(***)"


@dataclass(frozen=True)
class ApiKey:
    """``x-api-key: <key>``: a stack deployed with the API-key auth mode."""

    key: str

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {"x-api-key": self.key}

    def __repr__(self) -> str:
        return "ApiKey(***)"


@dataclass(frozen=True)
class NoAuth:
    """No credentials at all: ``rdq dev`` without ``RDQ_API_TOKEN`` (the default for a loopback
    API), or an API behind a gateway of your own that authenticates by other means."""

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        return {}


def default_auth(api_url: str, *, profile: str | None = None, region: str | None = None) -> Auth:
    """The credentials ``HttpClient`` and ``rdq --api`` send when none are named: none to an API
    on a loopback address (``rdq dev``, which without a token serves loopback callers only and
    never checks AWS credentials), SigV4 to any other (a deployed stack's IAM auth)."""
    host = urllib.parse.urlsplit(api_url).hostname or ""
    if _is_loopback(host):
        return NoAuth()
    return SigV4(profile=profile, region=region)


class SigV4:
    """AWS Signature Version 4 for API Gateway (service ``execute-api``) with botocore's signer.

    Credentials come from the standard chain of ``botocore.session.Session(profile=profile)``
    and are asked for at each request, so expiring ones (SSO, roles) are refreshed by botocore.
    The region is ``region`` if given, else the session's (``AWS_DEFAULT_REGION``, the profile),
    else the one in an ``….execute-api.<region>.amazonaws.com`` host name.
    """

    def __init__(self, *, profile: str | None = None, region: str | None = None, service: str = "execute-api",
                 session: Any = None) -> None:
        try:
            import botocore.session
        except ImportError:
            raise ConfigurationError(
                "SigV4 signing needs botocore: pip install botocore (or rdq's dev extra), or use an API key,"
                " a bearer token or NoAuth()") from None
        self._session = session if session is not None else botocore.session.Session(profile=profile)
        self._region = region or self._session.get_config_variable("region")
        self.service = service

    def region_for(self, url: str) -> str:
        if self._region:
            return str(self._region)
        host = urllib.parse.urlsplit(url).hostname or ""
        parts = host.split(".")
        if len(parts) >= 4 and parts[1] == "execute-api":
            return parts[2]
        raise ConfigurationError("no AWS region: pass region=, set AWS_REGION/AWS_DEFAULT_REGION, or set one in the profile")

    def headers(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        credentials = self._session.get_credentials()
        if credentials is None:
            raise NotAuthorized("no AWS credentials found (environment, profile, SSO or instance role)")
        request = AWSRequest(method=method, url=url, data=body, headers=dict(headers))
        SigV4Auth(credentials.get_frozen_credentials(), self.service, self.region_for(url)).add_auth(request)
        signed = {"Authorization", "X-Amz-Date", "X-Amz-Security-Token"}
        return {name: str(value) for name, value in request.headers.items() if name in signed}

    def __repr__(self) -> str:
        return f"SigV4(region={self._region!r}, service={self.service!r})"


# -- retries -----------------------------------------------------------------------------------
#: How a request may be repeated.
#: ``IDEMPOTENT``: reads, and enqueues (which always carry an id): any failure may be retried.
#: ``ONCE``: redrive, purge and cancel. A repeat after the API acted would not be a no-op in what
#: it answers (a second redrive/purge counts 0, or acts on tasks that died in between; a second
#: cancel answers 409), so these are retried only when the API certainly did not act: the
#: connection failed before the request was sent, or the answer was 429 (throttled at the gateway)
#: or 503 (the store was unreachable; nothing was written).
IDEMPOTENT, ONCE = "idempotent", "once"
_RETRY_STATUSES = {IDEMPOTENT: frozenset({429, 500, 502, 503, 504}), ONCE: frozenset({429, 503})}


class _NotSent(Exception):
    """A connection failure before any byte of the request left: always safe to retry."""


class _Response:
    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


class HttpClient:
    def __init__(
        self,
        api_url: str,
        *,
        auth: Auth | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 35.0,
        retry_seconds: float = 30.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        payload_threshold_bytes: int | None = None,
        payload_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(api_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError("the API URL must be http(s)://host[:port][/stage]")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ConfigurationError("the API URL must not carry credentials, a query or a fragment")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        if (parts.scheme, parts.port) in (("https", 443), ("http", 80)):
            self._port = None  # the Host header then matches the host SigV4 signs (no default port)
        self._base_path = parts.path.rstrip("/")
        #: What messages name: scheme, host and port, never a path, key or token.
        self.api = f"{parts.scheme}://{parts.netloc}"
        #: ``None``: ``default_auth`` (no credentials on loopback, SigV4 elsewhere).
        self.auth: Auth = auth if auth is not None else default_auth(api_url)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.retry_seconds, self.backoff_initial, self.backoff_max = retry_seconds, backoff_initial, backoff_max
        self._ssl_context = ssl_context or ssl.create_default_context()  # verifies certificate and host name
        #: Payloads that encode to more than this are uploaded first (None: $RDQ_PAYLOAD_THRESHOLD_BYTES or 200 KiB).
        self.payload_threshold_bytes = payload_threshold_bytes
        #: rdq dev's payload directory, the only place its file: URLs may point (None: $RDQ_PAYLOAD_DIR,
        #: else any directory named rdq-payloads); see ``local_object_path``.
        self.payload_dir = os.fspath(payload_dir) if payload_dir is not None else None

    def close(self) -> None:
        """Nothing to release (one connection per request); here for ``Client``'s interface."""

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- producing -------------------------------------------------------------------------
    def enqueue(
        self,
        queue: str,
        handler: str,
        payload: Any = None,
        *,
        connection: Any = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> Task:
        """Enqueue one task; an existing id on the same queue returns the existing task.

        Raises ``TaskConflict`` if ``id`` is taken on another queue. The trace context (as
        ``Client.enqueue`` chooses it) travels as the request's ``traceparent`` header.
        """
        _no_connection(connection)
        item = _task_body({"handler": handler, "payload": payload, **check_enqueue_options(options)})
        item = self._offloaded(queue, item)  # a payload over the threshold is uploaded first
        trace = tracecontext.http_headers(tracecontext.enqueue_headers(traceparent, tracestate))
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks", IDEMPOTENT, body=item, headers=trace)
        return Task.from_dict(response.json())

    def enqueue_new(self, new_task: NewTask, *, connection: Any = None) -> EnqueueResult:
        """``Client.enqueue_new`` over HTTP: one task already validated by ``build_new_task``;
        ``created`` is False when the id already existed on that queue. A conflict is the API's
        409, raised as ``TaskConflict``."""
        _no_connection(connection)
        # A stored trace context travels as the traceparent header (the API refuses rdq.* in the body).
        trace = tracecontext.http_headers(new_task.headers)
        item = _new_task_body(new_task)
        response = self._call("POST", f"/v1/queues/{_segment(new_task.queue)}/tasks", IDEMPOTENT, body=item, headers=trace)
        body = response.json()
        return EnqueueResult(task=Task.from_dict(body), created=bool(body.get("created", response.status == 201)),
                             deduplicated=bool(body.get("deduplicated", False)))

    def enqueue_many(
        self, queue: str, items: Sequence[Mapping[str, Any]], *, connection: Any = None,
        traceparent: str | None = None, tracestate: str | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue up to ``Limits.batch_items`` tasks in one request; per-item results (one trace
        context for all of them, as ``enqueue``)."""
        _no_connection(connection)
        if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
            raise InvalidInput("tasks must be a list", "tasks")
        # Items that are not objects are sent as they are: the API refuses them with their index.
        bodies = [_task_body(item) if isinstance(item, Mapping) else item for item in items]
        bodies = [self._offloaded(queue, body) if isinstance(body, dict) else body for body in bodies]  # large payloads
        trace = tracecontext.http_headers(tracecontext.enqueue_headers(traceparent, tracestate))
        return self._enqueue_batch(queue, bodies, trace)

    def enqueue_new_many(self, new_tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        """``Client.enqueue_new_many`` over HTTP: tasks already validated by ``build_new_tasks``;
        per-item results in order, a conflict included (``conflict=True``), never raised.

        One request per queue and trace context (the batch route takes one of each), in chunks of
        ``Limits.batch_items``; tasks from one producer call usually make a single request."""
        _no_connection(connection)
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[int]] = {}
        for index, new_task in enumerate(new_tasks):
            trace = tuple(sorted(tracecontext.http_headers(new_task.headers).items()))
            groups.setdefault((new_task.queue, trace), []).append(index)
        results: dict[int, EnqueueResult] = {}
        for (queue, trace), indexes in groups.items():
            for start in range(0, len(indexes), Limits.batch_items):
                chunk = indexes[start:start + Limits.batch_items]
                answers = self._enqueue_batch(queue, [_new_task_body(new_tasks[i]) for i in chunk], dict(trace))
                results.update(zip(chunk, answers, strict=True))
        return [results[index] for index in range(len(new_tasks))]

    def _enqueue_batch(self, queue: str, bodies: list[Any], trace: Mapping[str, str]) -> list[EnqueueResult]:
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks:batch", IDEMPOTENT, body={"tasks": bodies},
                              headers=trace)
        results = []
        for sent, answer in zip(bodies, response.json()["results"], strict=True):
            task = Task(
                id=answer["id"], queue=answer.get("queue", queue), handler=sent.get("handler", ""),
                payload=sent.get("payload"), status=TaskStatus(answer.get("status", TaskStatus.PENDING.value)),
                headers=dict(sent.get("headers") or {}), max_attempts=sent.get("max_attempts"),
                backoff=Backoff.from_dict(sent.get("backoff")), priority=int(sent.get("priority") or 0),
                concurrency_key=sent.get("concurrency_key"), rate_key=sent.get("rate_key"), group=sent.get("group"),
                dedupe_key=sent.get("dedupe_key"),
            )
            results.append(EnqueueResult(task=task, created=answer["result"] == "created",
                                         conflict=answer["result"] == "conflict",
                                         deduplicated=bool(answer.get("deduplicated", False))))
        return results

    # -- reading and operating -------------------------------------------------------------
    def get(self, task_id: str, *, resolve: bool = False) -> Task:
        """``resolve=True`` downloads a payload or result kept in the payload store (presigned URLs
        from ``GET /v1/tasks/{id}/objects``) and checks its size and SHA-256."""
        task = Task.from_dict(self._call("GET", f"/v1/tasks/{_segment(task_id, 'id')}", IDEMPOTENT, task_id=task_id).json())
        return self._resolved(task) if resolve else task

    def cancel(self, task_id: str) -> Task:
        return Task.from_dict(self._call("DELETE", f"/v1/tasks/{_segment(task_id, 'id')}", ONCE, task_id=task_id).json())

    def stats(self, queue: str) -> QueueStats:
        return QueueStats.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/stats", IDEMPOTENT).json())

    def list_queues(self) -> list[QueueStats]:
        """Every queue that holds at least one task or is paused, by name, with its counts."""
        return [QueueStats.from_dict(item) for item in self._call("GET", "/v1/queues", IDEMPOTENT).json()["queues"]]

    def list_dead(
        self,
        queue: str,
        *,
        limit: int = 50,
        cursor: str | None = None,
        error_type: str | None = None,
        handler: str | None = None,
    ) -> DeadPage:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        query = {"limit": str(limit), "cursor": cursor, "error_type": error_type, "handler": handler}
        return DeadPage.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/dlq?{_query(query)}", IDEMPOTENT).json())

    def list_tasks(
        self,
        queue: str,
        *,
        status: TaskStatus | str | None = None,
        handler: str | None = None,
        error_type: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> TaskPage:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        status_text = status.value if isinstance(status, TaskStatus) else status
        query = {"status": status_text, "handler": handler, "error_type": error_type, "limit": str(limit), "cursor": cursor}
        return TaskPage.from_dict(self._call("GET", f"/v1/queues/{_segment(queue)}/tasks?{_query(query)}", IDEMPOTENT).json())

    def redrive(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/dlq:redrive", "redriven", ids, error_type, handler, all, dry_run)

    def purge_dead(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                   handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/dlq:purge", "purged", ids, error_type, handler, all, dry_run)

    def cancel_selected(self, queue: str, *, ids: Iterable[str] | None = None, error_type: str | None = None,
                        handler: str | None = None, all: bool = False, dry_run: bool = False) -> int:
        return self._bulk(f"/v1/queues/{_segment(queue)}/tasks:cancel", "cancelled", ids, error_type, handler, all,
                          dry_run)

    def pause(self, queue: str) -> QueueStats:
        # Pausing twice is pausing: a repeat after a lost answer is harmless.
        return QueueStats.from_dict(self._call("POST", f"/v1/queues/{_segment(queue)}:pause", IDEMPOTENT, body={}).json())

    def resume(self, queue: str) -> QueueStats:
        return QueueStats.from_dict(self._call("POST", f"/v1/queues/{_segment(queue)}:resume", IDEMPOTENT, body={}).json())

    def list_audit(self, *, queue: str | None = None, limit: int = 50, cursor: str | None = None) -> AuditPage:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidInput("limit must be an integer", "limit")
        query = {"queue": queue, "limit": str(limit), "cursor": cursor}
        return AuditPage.from_dict(self._call("GET", f"/v1/audit?{_query(query)}", IDEMPOTENT).json())

    # -- schedules (rdq_core.engine.schedules) ----------------------------------------------------
    def put_schedule(self, definition: Any) -> Any:
        """Create or replace a schedule (a ``Schedule`` or its fields); returns it as stored.
        Replacing is idempotent: a repeat after a lost answer stores the same definition."""
        from .engine.schedules import Schedule, schedule_from_body

        body = dict(definition.to_dict() if isinstance(definition, Schedule) else definition)
        body.pop("created_at", None)
        return schedule_from_body(self._call("POST", "/v1/schedules", IDEMPOTENT, body=body).json())

    def list_schedules(self) -> list[Any]:
        from .engine.schedules import schedule_from_body

        return [schedule_from_body(item) for item in self._call("GET", "/v1/schedules", IDEMPOTENT).json()["schedules"]]

    def delete_schedule(self, name: str) -> None:
        from .engine.schedules import ScheduleNotFound

        try:
            self._call("DELETE", f"/v1/schedules/{_segment(name, 'name')}", IDEMPOTENT, task_id=name)
        except TaskNotFound:
            raise ScheduleNotFound(name) from None

    def _bulk(self, path: str, done_key: str, ids: Iterable[str] | None, error_type: str | None, handler: str | None,
              all: bool, dry_run: bool) -> int:
        body = _selection(ids, error_type, handler, all)
        if dry_run:
            body["dry_run"] = True  # read-only: safe to repeat
            return int(self._call("POST", path, IDEMPOTENT, body=body).json()["matched"])
        response = self._call("POST", path, ONCE, body=body)
        answer = response.json()
        if response.status == 202:
            # Too large for one request: the API started a background operation. Wait for it, so
            # the call means what it means on a store: done when it returns.
            return self.wait_for_operation(answer["operation"]["id"]).done
        return int(answer[done_key])

    # -- bulk operations as jobs --------------------------------------------------------------
    def start_operation(self, action: str, queue: str, *, ids: Iterable[str] | None = None,
                        error_type: str | None = None, handler: str | None = None, all: bool = False,
                        rate_per_second: float | None = None) -> Operation:
        """Start a background redrive, purge or cancel (the API answers 202 at once)."""
        paths = {"redrive": "dlq:redrive", "purge": "dlq:purge", "cancel": "tasks:cancel"}
        if action not in paths:
            raise InvalidInput(f"action must be one of {', '.join(paths)}", "action")
        body = {**_selection(ids, error_type, handler, all), "background": True}
        if rate_per_second is not None:
            body["rate_per_second"] = rate_per_second
        # Not repeated after it may have acted: a second start would be refused as a conflict.
        answer = self._call("POST", f"/v1/queues/{_segment(queue)}/{paths[action]}", ONCE, body=body).json()
        return Operation.from_dict(answer["operation"])

    def get_operation(self, operation_id: str) -> Operation:
        path = f"/v1/operations/{_segment(operation_id, 'operation_id')}"
        return Operation.from_dict(self._call("GET", path, IDEMPOTENT, task_id=operation_id).json())

    def list_operations(self, *, queue: str | None = None, limit: int = 50) -> list[Operation]:
        answer = self._call("GET", f"/v1/operations?{_query({'queue': queue, 'limit': str(limit)})}", IDEMPOTENT).json()
        return [Operation.from_dict(item) for item in answer["operations"]]

    def cancel_operation(self, operation_id: str) -> Operation:
        path = f"/v1/operations/{_segment(operation_id, 'operation_id')}:cancel"
        return Operation.from_dict(self._call("POST", path, ONCE, body={}, task_id=operation_id).json())

    def wait_for_operation(self, operation_id: str, *, timeout: float = 3600.0, poll: float = 1.0) -> Operation:
        """Poll until the operation is finished; ``ApiUnavailable`` past ``timeout`` seconds."""
        return operations.wait_until_finished(self.get_operation, operation_id, timeout=timeout, poll=poll,
                                              still_running=ApiUnavailable)

    # -- large payloads (rdq_core/engine/payloads.py) -----------------------------------------------
    def enqueue_item(self, queue: str, item: Mapping[str, Any], *, connection: Any = None) -> EnqueueResult:
        """``Client.enqueue_item`` over HTTP: one task from its fields, a large payload uploaded first."""
        _no_connection(connection)
        body = self._offloaded(queue, _task_body(item))
        trace = tracecontext.http_headers(tracecontext.enqueue_headers())  # as enqueue chooses it
        response = self._call("POST", f"/v1/queues/{_segment(queue)}/tasks", IDEMPOTENT, body=body, headers=trace)
        answer = response.json()
        return EnqueueResult(task=Task.from_dict(answer), created=bool(answer.get("created", response.status == 201)),
                             deduplicated=bool(answer.get("deduplicated", False)))

    def _offloaded(self, queue: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with a payload over the threshold uploaded through a presigned URL and replaced
        by its ``payload_ref``. An API without a payload bucket gets the payload inline."""
        size = payload_objects.encoded_size(body.get("payload"))
        threshold = self.payload_threshold_bytes
        if size is None or size <= (payload_objects.threshold_bytes() if threshold is None else threshold):
            return body
        data = payload_objects.encoded(body["payload"])
        sha256 = hashlib.sha256(data).hexdigest()
        try:
            offer = self._call("POST", f"/v1/queues/{_segment(queue)}/payloads", IDEMPOTENT,
                               body={"size": len(data), "sha256": sha256, "task_id": body["id"]}).json()
        except InvalidInput as exc:
            if "no payload bucket" in str(exc):
                return body  # inline: the API refuses it (413) if it is over 256 KiB
            raise InvalidInput(str(exc), "payload") from None
        upload = offer["upload"]
        ref = payload_objects.PayloadRef.from_dict(offer.get("payload_ref"))
        self._transfer(upload["method"], upload["url"], upload.get("headers") or {}, data, ref)
        slim = {name: value for name, value in body.items() if name != "payload"}
        slim["payload_ref"] = offer["payload_ref"]
        return slim

    def _resolved(self, task: Task) -> Task:
        if payload_objects.REF_HEADER not in task.headers and payload_objects.result_ref(task.result) is None:
            return task
        objects = self._call("GET", f"/v1/tasks/{_segment(task.id, 'id')}/objects", IDEMPOTENT, task_id=task.id).json()
        values: dict[str, Any] = {}
        for name in ("payload", "result"):
            entry = objects.get(name)
            if entry:
                ref = payload_objects.PayloadRef.from_dict(entry["payload_ref"])
                data = self._transfer("GET", entry["url"], {}, b"", ref)
                values[name] = payload_objects.checked_value(data, ref, name)
        return replace(task, **values)

    def _transfer(self, method: str, url: str, headers: Mapping[str, str], data: bytes,
                  ref: payload_objects.PayloadRef) -> bytes:
        """A presigned transfer of the object ``ref`` names; a ``file:`` URL only as the checks of
        ``local_object_path`` allow it (``rdq dev`` on loopback, inside its payload directory)."""
        if urllib.parse.urlsplit(url).scheme == "file":
            return _local_transfer(method, self.local_object_path(url, ref), data)
        return _transfer(method, url, headers, data, self.read_timeout)

    def local_object_path(self, url: str, ref: payload_objects.PayloadRef) -> str:
        """The file a ``file:`` URL from the API names, once it is safe to read or write: the API is
        ``rdq dev`` on this machine (http on a loopback address), and the file is the object
        ``ref`` names inside its payload directory -- ``payload_dir`` (``RDQ_PAYLOAD_DIR``) when
        set, else a directory named ``rdq-payloads``, as ``rdq dev`` names its own -- with no
        symbolic link or ``..`` leading elsewhere. Anything else is ``ConfigurationError``, and
        nothing is read or written: a server must not choose which of the caller's files to write."""
        refused = f"rdq API at {self.api} answered a file: URL for a payload object"
        if self._scheme != "http" or not _is_loopback(self._host):
            raise ConfigurationError(f"{refused}; only rdq dev on a loopback address may, not this API")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ConfigurationError(f"{refused} that names another host, a query or a fragment")
        path = urllib.request.url2pathname(parts.path)
        suffix = os.sep + ref.key.replace("/", os.sep)
        if not os.path.isabs(path) or not path.endswith(suffix) or ".." in path.split(os.sep):
            raise ConfigurationError(f"{refused} that is not the object {ref.key!r}")
        root = path[: -len(suffix)]
        expected = self.payload_dir or os.environ.get("RDQ_PAYLOAD_DIR", "").strip()
        real_root = os.path.realpath(root)
        if expected:
            if real_root != os.path.realpath(expected):
                raise ConfigurationError(f"{refused} outside the payload directory {expected!r}")
        elif os.path.basename(root) != _DEV_PAYLOAD_DIR:
            raise ConfigurationError(f"{refused} outside a {_DEV_PAYLOAD_DIR!r} directory; set payload_dir "
                                     "(RDQ_PAYLOAD_DIR) to rdq dev's payload directory")
        if os.path.realpath(path) != os.path.join(real_root, ref.key.replace("/", os.sep)):
            raise ConfigurationError(f"{refused} whose path leads out of the payload directory (a symbolic link)")
        return path

    # -- the transport ---------------------------------------------------------------------
    def _call(self, method: str, path: str, retry: str, *, body: Any = None, task_id: str | None = None,
              headers: Mapping[str, str] | None = None) -> _Response:
        data = b"" if body is None else json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            attempt += 1
            failure: str
            retry_after: float | None = None
            try:
                response = self._send(method, path, data, headers)
            except _NotSent as exc:
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

    def _send(self, method: str, path: str, data: bytes, extra: Mapping[str, str] | None = None) -> _Response:
        target = self._base_path + path
        url = f"{self._scheme}://{self._netloc()}{target}"
        headers = {"Accept": "application/json"}
        if data:
            headers["Content-Type"] = "application/json"
        headers.update(extra or {})  # the trace context of an enqueue (traceparent, tracestate)
        headers.update(self.auth.headers(method, url, headers, data))
        connection: http.client.HTTPConnection
        if self._scheme == "https":
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=self.connect_timeout,
                                                     context=self._ssl_context)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self.connect_timeout)
        try:
            try:
                connection.connect()
            except (OSError, http.client.HTTPException) as exc:
                raise _NotSent() from exc
            assert connection.sock is not None
            connection.sock.settimeout(self.read_timeout)
            connection.request(method, target, body=data if data or method in ("POST", "PUT") else None, headers=headers)
            response = connection.getresponse()
            return _Response(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            connection.close()

    def _netloc(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}" if self._port else host

    def _error(self, response: _Response, task_id: str | None) -> RdqError:
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


def plaintext_credential_warning(api_url: str, auth: Auth | None) -> str | None:
    """A warning for sending an API key or bearer token over plain HTTP to another machine
    (anyone on the path reads and replays it), else None. Loopback (``rdq dev``) is exempt."""
    if not isinstance(auth, (ApiKey, BearerToken)):
        return None
    parts = urllib.parse.urlsplit(api_url)
    if parts.scheme != "http" or not parts.hostname or _is_loopback(parts.hostname):
        return None
    what = "API key" if isinstance(auth, ApiKey) else "bearer token"
    return (f"warning: the {what} travels unencrypted to http://{parts.netloc}: anyone on the network path can "
            "read and reuse it; use https://")


# -- presigned transfers (large payloads) ------------------------------------------------------
#: The name ``rdq dev`` gives its payload directory (next to its store).
_DEV_PAYLOAD_DIR = "rdq-payloads"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_rdq_not_found(response: _Response, problem: Mapping[str, Any]) -> bool:
    """Whether a 404 is rdq's own "no such task/operation/schedule" problem (field ``id``), not a
    route missing under a wrong base URL or another server's page."""
    content_type = (response.headers.get("content-type") or "").split(";")[0].strip().lower()
    return (content_type == "application/problem+json" and problem.get("type") == "urn:rdq:problem:not-found"
            and problem.get("field") == "id")


def _local_transfer(method: str, path: str, data: bytes) -> bytes:
    """A PUT or GET of a checked path in ``rdq dev``'s payload directory; the last component is
    never followed if it is a symbolic link (it could be made one after the check)."""
    try:
        if method == "PUT":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            return b""
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ApiUnavailable(f"payload store: {method} of a local object failed ({exc.strerror})") from None


def _transfer(method: str, url: str, headers: Mapping[str, str], data: bytes, timeout: float) -> bytes:
    """One presigned PUT or GET (no rdq credentials: the URL carries its own signature)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiUnavailable("payload store: the API answered an object URL that is not http(s) or file")
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=ssl.create_default_context())
        if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout))
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request(method, target, body=data if method == "PUT" else None,
                           headers={**headers, **({"Content-Length": str(len(data))} if method == "PUT" else {})})
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise ApiUnavailable(f"payload store at {parts.hostname}: {method} failed ({type(exc).__name__})") from None
    finally:
        connection.close()
    if response.status >= 300:
        raise ApiUnavailable(f"payload store at {parts.hostname} answered {response.status} to the presigned {method}")
    return body


# -- request bodies ----------------------------------------------------------------------------
def _new_task_body(new_task: NewTask) -> dict[str, Any]:
    """A validated task's JSON body; its trace context is left out (it travels as a header)."""
    return _task_body({"id": new_task.id, "handler": new_task.handler, "payload": new_task.payload,
                       "headers": tracecontext.with_trace(new_task.headers, {}) or None,
                       "max_attempts": new_task.max_attempts,
                       "backoff": new_task.backoff, "run_at": new_task.run_at,
                       "delay_seconds": new_task.delay_seconds or None, **new_task.flow_fields()})


def _task_body(item: Mapping[str, Any]) -> dict[str, Any]:
    """One task's JSON body, with an id: generated here when absent, so retries are repeats."""
    body: dict[str, Any] = {}
    for name, value in item.items():
        if value is None and name != "payload":
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, Backoff):
            value = value.to_dict()
        elif name == "headers" and isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif name == "dedupe_states" and isinstance(value, (list, tuple)):
            value = [getattr(state, "value", state) for state in value]
        body[name] = value
    if body.get("id") is None:
        body["id"] = new_task_id()
    return body


def _selection(ids: Iterable[str] | None, error_type: str | None, handler: str | None, all: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"all": all}
    if ids is not None:
        body["ids"] = list(ids)
    if error_type is not None:
        body["error_type"] = error_type
    if handler is not None:
        body["handler"] = handler
    return body


def _query(params: Mapping[str, str | None]) -> str:
    return urllib.parse.urlencode({name: value for name, value in params.items() if value is not None})


def _segment(value: str, field: str = "queue") -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{field} must be a non-empty string", field)
    return urllib.parse.quote(value, safe="")


def _no_connection(connection: Any) -> None:
    if connection is not None:
        raise UnsupportedOperation("connection= joins a database transaction; it cannot cross the HTTP API")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


if TYPE_CHECKING:  # mypy proves HttpClient is a QueueClient (rdq_core/client_protocol.py); nothing runs here
    def _conforms(client: HttpClient) -> QueueClient:
        return client
