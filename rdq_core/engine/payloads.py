"""Large payloads and results kept outside the store, in a bucket (or, for ``rdq dev``, a directory).

A task whose payload encodes to more than the threshold (``RDQ_PAYLOAD_THRESHOLD_BYTES``, default
200 KiB) is written with ``payload = null`` and a reserved header holding a small reference::

    headers["rdq.payload_ref"] = '{"bucket":"…","key":"payloads/emails/…","size":1048576,"sha256":"…"}'

User headers may never start with ``rdq.`` (``validation.headers``), so the reference cannot be
confused with anything a caller sends. The worker reads the object just before the handler runs,
checks its size and SHA-256, and hands the handler the real payload; a mismatch or a missing
object is a ``PermanentError`` (the task is dead-lettered with a message naming the object).

A handler result too large to keep inline (over the smaller of the threshold and the 64 KiB result
limit) is written to the bucket and the task's result becomes ``{"$rdq_s3": {bucket, key, size,
sha256}}``; a handler may not return an object with that key itself. ``Client.get(id,
resolve=True)`` (and ``HttpClient.get(id, resolve=True)``) fetch both.

Objects are named by the store, under the id of the task they belong to:
``payloads/<queue>/<task id>/<random>`` and ``results/<queue>/<task id>/<random>``. A random name
means an idempotent repeat of an enqueue never overwrites the object an existing task points at
(the repeat's own upload is deleted again). The task id in the name is what makes an object one
task's own: an HTTP upload is offered for one task id, a reference is accepted only on the task
it was offered for, and a purge, or a success's retention tag, touches only objects named under
the task's own id -- so no producer can make one task's purge delete another's payload.
(``payloads/<queue>/<random>``, the name before task ids were part of it, is still read, but no
longer accepted from a producer nor deleted by a purge.)

Which store: ``RDQ_PAYLOAD_BUCKET`` (S3, the deployed stack's bucket: ``rdq_core/aws/s3_payloads.py``)
or ``RDQ_PAYLOAD_DIR`` (a directory; ``rdq dev`` uses ``<store dir>/rdq-payloads``); neither means
payloads stay inline and the 256 KiB limit holds. How objects are deleted (DLQ purge deletes them; retention is an S3
lifecycle rule on objects of finished tasks) is in docs/serverless.md, "Large payloads".

This module holds the format, the limits, the integrity check, the store protocol and the
worker's side; ``payload_uploads`` is the HTTP upload offer and ``payload_retention`` deletes
objects with their tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from . import outcomes
from .. import validation
from ..aws.s3_payloads import S3_SINGLE_PUT_BYTES, S3PayloadStore
from ..errors import ConfigurationError, InvalidInput, PermanentError
from ..model import ClaimedTask, NewTask, Outcome, Settlement, Task, TaskStatus
from .retry import PolicyBook

log = logging.getLogger("rdq.payloads")

#: The reserved task header that holds a payload's reference (the payload itself is null).
REF_HEADER = "rdq.payload_ref"
#: The one key of a result that was stored in the bucket.
RESULT_KEY = "$rdq_s3"
#: Payloads that encode to more than this go to the bucket (``RDQ_PAYLOAD_THRESHOLD_BYTES``).
DEFAULT_THRESHOLD_BYTES = 200 * 1024
#: The largest payload or result kept in the bucket (``RDQ_PAYLOAD_MAX_BYTES``): the worker holds
#: it in memory, decoded, next to the handler's own data.
DEFAULT_MAX_BYTES = 100 * 1024 * 1024

#: The keys this module issues (``new_key``): nothing else is ever read, written or deleted.
_KEY = re.compile(r"payloads/[a-z0-9][a-z0-9._-]{0,119}/(?:[A-Za-z0-9][A-Za-z0-9._~-]{0,127}/)?[0-9a-f]{32}"
                  r"|results/[a-z0-9][a-z0-9._-]{0,119}/[A-Za-z0-9][A-Za-z0-9._~-]{0,127}/[0-9a-f]{32}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class PayloadIntegrityError(PermanentError):
    """A stored payload or result is not what its reference says (size or SHA-256), or is gone."""


@dataclass(frozen=True)
class PayloadRef:
    """Where a payload or result lives and what it must hash to."""

    bucket: str
    key: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "key": self.key, "size": self.size, "sha256": self.sha256}

    def to_header(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, field: str = "payload_ref") -> "PayloadRef":
        """A reference as a caller or the store gives it back; anything else is ``InvalidInput``."""
        if not isinstance(data, Mapping) or set(data) != {"bucket", "key", "size", "sha256"}:
            raise InvalidInput(f"{field} must be an object with exactly bucket, key, size and sha256", field)
        bucket, key, size, sha256 = data["bucket"], data["key"], whole(data["size"]), data["sha256"]
        if not isinstance(bucket, str) or not 0 < len(bucket) <= 255:
            raise InvalidInput(f"{field}.bucket must be a bucket name", field)
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidInput(f"{field}.key is not a key this store issues", field)
        if type(size) is not int or not 0 <= size <= S3_SINGLE_PUT_BYTES:
            raise InvalidInput(f"{field}.size must be an integer in 0..{S3_SINGLE_PUT_BYTES}", field)
        if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
            raise InvalidInput(f"{field}.sha256 must be 64 lowercase hexadecimal digits", field)
        return cls(bucket, key, size, sha256)

    @classmethod
    def from_header(cls, value: str) -> "PayloadRef":
        try:
            data = json.loads(value)
        except ValueError:
            raise InvalidInput(f"the {REF_HEADER} header is not JSON", REF_HEADER) from None
        return cls.from_dict(data, REF_HEADER)


def whole(value: Any) -> Any:
    """JSON does not tell 3 from 3.0 (nor does JSON Schema's "integer")."""
    return int(value) if type(value) is float and value.is_integer() else value


# -- stores ------------------------------------------------------------------------------------
class PayloadStore(Protocol):
    """Where offloaded payloads and results live. ``bucket`` is what references name.
    Implementations: ``S3PayloadStore`` (``rdq_core/aws/s3_payloads.py``) and ``LocalPayloadStore``."""

    bucket: str

    def write(self, key: str, data: bytes) -> None: ...

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is no such object."""

    def size_of(self, key: str) -> int | None:
        """The object's size, or None when there is no such object."""

    def delete(self, keys: Sequence[str]) -> None: ...

    def mark_finished(self, key: str) -> None:
        """Tell the retention rule the object's task finished (S3: a tag; elsewhere nothing)."""

    def clear_pending(self, key: str) -> None:
        """A task now names the uploaded object: it must not expire as a pending upload (S3: the
        tag goes; elsewhere nothing)."""

    def upload_target(self, key: str, size: int, sha256: str) -> dict[str, Any]:
        """Where a caller puts an object of ``size`` bytes hashing to ``sha256`` (hex):
        ``{"url", "method", "headers"}``; the caller sends exactly those headers."""

    def download_url(self, key: str) -> str: ...


def put_object(store: PayloadStore, key: str, data: bytes) -> PayloadRef:
    """Write ``data`` at ``key``; the reference that names it."""
    store.write(key, data)
    return PayloadRef(store.bucket, key, len(data), hashlib.sha256(data).hexdigest())


class LocalPayloadStore:
    """A directory standing in for the bucket (``rdq dev``): same keys, same references.

    Its "presigned" URLs are ``file:`` URLs into the directory: ``rdq dev`` serves loopback, so
    its callers share the machine (``HttpClient`` reads and writes them)."""

    bucket = "local"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory).resolve()

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise InvalidInput("not a key this store issues", "key")
        return self.root / key

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + f".{secrets.token_hex(4)}.part")
        partial.write_bytes(data)
        os.replace(partial, path)  # readers never see half an object

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def size_of(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def mark_finished(self, key: str) -> None:
        return None  # nothing expires a directory's objects: a purge deletes them

    def clear_pending(self, key: str) -> None:
        return None

    def upload_target(self, key: str, size: int, sha256: str) -> dict[str, Any]:
        return {"url": self._path(key).as_uri(), "method": "PUT", "headers": {}}

    def download_url(self, key: str) -> str:
        return self._path(key).as_uri()


# -- configuration -----------------------------------------------------------------------------
_configured: list[PayloadStore | None] = []
_configured_lock = threading.Lock()


def store_from_env() -> PayloadStore | None:
    """``RDQ_PAYLOAD_BUCKET`` (S3) or ``RDQ_PAYLOAD_DIR`` (a directory), else None."""
    bucket = os.environ.get("RDQ_PAYLOAD_BUCKET", "").strip()
    if bucket:
        return S3PayloadStore(bucket)
    directory = os.environ.get("RDQ_PAYLOAD_DIR", "").strip()
    if directory:
        return LocalPayloadStore(directory)
    return None


def default_store() -> PayloadStore | None:
    """The process's store, read from the environment once (``configure`` replaces it)."""
    with _configured_lock:
        if not _configured:
            _configured.append(store_from_env())
        return _configured[0]


def configure(store: PayloadStore | None) -> None:
    """Set the process's store (tests, embedding hosts); ``reset`` goes back to the environment."""
    with _configured_lock:
        _configured[:] = [store]


def reset() -> None:
    with _configured_lock:
        _configured.clear()


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of bytes") from None
    if value < 0:
        raise ConfigurationError(f"{name} must not be negative")
    return value


def threshold_bytes() -> int:
    """Payloads that encode to more than this are offloaded (capped at the inline limit)."""
    return min(_env_bytes("RDQ_PAYLOAD_THRESHOLD_BYTES", DEFAULT_THRESHOLD_BYTES), validation.Limits.payload_bytes)


def result_threshold_bytes() -> int:
    return min(threshold_bytes(), validation.Limits.result_bytes)


def max_bytes() -> int:
    return min(_env_bytes("RDQ_PAYLOAD_MAX_BYTES", DEFAULT_MAX_BYTES), S3_SINGLE_PUT_BYTES)


# -- encoding ----------------------------------------------------------------------------------
def encoded(value: Any) -> bytes:
    """The JSON bytes rdq stores and hashes (compact, UTF-8), the same as the size limits measure."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encoded_size(value: Any) -> int | None:
    """The encoded size, or None when ``value`` is not JSON (validation says why later)."""
    try:
        return len(encoded(value))
    except (TypeError, ValueError, RecursionError):
        return None


def new_key(kind: str, queue: str, task_id: str | None = None) -> str:
    middle = f"{queue}/{task_id}" if task_id else queue
    return f"{kind}/{middle}/{secrets.token_hex(16)}"


# -- producing ---------------------------------------------------------------------------------
def should_offload(payload: Any, store: PayloadStore | None) -> bool:
    if store is None:
        return False
    size = encoded_size(payload)
    return size is not None and size > threshold_bytes()


def offload_payload(store: PayloadStore, queue: str, payload: Any, task_id: str) -> PayloadRef:
    """Check ``payload`` (JSON rules, the offload maximum) and write it as task ``task_id``'s own
    object; its reference."""
    validation.json_value(payload, max_bytes(), "payload")
    return put_object(store, new_key("payloads", queue, validation.task_id(task_id)), encoded(payload))


def owned_by(task: Task, ref: PayloadRef) -> bool:
    """Whether ``ref`` names an object issued for ``task`` itself (its queue and id are in the
    key), the only objects a purge deletes or a success tags for expiry."""
    return ref.key.startswith((f"payloads/{task.queue}/{task.id}/", f"results/{task.queue}/{task.id}/"))


def with_ref(new_task: NewTask, ref: PayloadRef) -> NewTask:
    """``new_task`` carrying ``ref`` instead of its payload."""
    return replace(new_task, payload=None, headers={**new_task.headers, REF_HEADER: ref.to_header()})


# -- the worker's side -------------------------------------------------------------------------
def payload_ref(task: Task) -> PayloadRef | None:
    value = task.headers.get(REF_HEADER)
    return None if value is None else PayloadRef.from_header(value)


def result_ref(result: Any) -> PayloadRef | None:
    if isinstance(result, Mapping) and set(result) == {RESULT_KEY}:
        return PayloadRef.from_dict(result[RESULT_KEY], RESULT_KEY)
    return None


def fetch(store: PayloadStore | None, ref: PayloadRef, what: str) -> Any:
    """The value ``ref`` names, checked against its size and SHA-256."""
    # A process set up without the store is fixed by configuring it: a retryable failure (the
    # task's retries outlast the fix), never a dead letter on the first try.
    if store is None:
        raise ConfigurationError(f"the {what} is stored at {ref.bucket}/{ref.key}, but this process has no payload "
                                 "store (set RDQ_PAYLOAD_BUCKET or RDQ_PAYLOAD_DIR)")
    if ref.bucket != store.bucket:
        raise ConfigurationError(f"the {what} is stored in bucket {ref.bucket!r}, not in this process's "
                                 f"{store.bucket!r}")
    data = store.read(ref.key)
    if data is None:
        raise PayloadIntegrityError(f"the {what} object {ref.bucket}/{ref.key} does not exist (deleted, or never "
                                    "uploaded)")
    return checked_value(data, ref, what)


def checked_value(data: bytes, ref: PayloadRef, what: str) -> Any:
    """The JSON value of ``data``, read from the object ``ref`` names, once size and hash match."""
    if len(data) != ref.size:
        raise PayloadIntegrityError(f"the {what} object {ref.bucket}/{ref.key} holds {len(data)} bytes; its reference "
                                    f"says {ref.size}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise PayloadIntegrityError(f"the {what} object {ref.bucket}/{ref.key} has SHA-256 {digest}; its reference "
                                    f"says {ref.sha256} (changed or corrupted after upload)")
    try:
        return json.loads(data)
    except ValueError:
        raise PayloadIntegrityError(f"the {what} object {ref.bucket}/{ref.key} is not JSON") from None


def task_payload(task: Task, store: PayloadStore | None = None) -> Any:
    """The payload the handler sees: the task's own, or the object its reference names."""
    if REF_HEADER not in task.headers:
        return task.payload
    try:
        ref = payload_ref(task)
    except InvalidInput as exc:
        raise PayloadIntegrityError(str(exc)) from None
    assert ref is not None
    return fetch(store if store is not None else default_store(), ref, "payload")


def reserved_result_problem(result: Any) -> str | None:
    """A handler's own result may not use the reserved shape of a stored result."""
    if isinstance(result, Mapping) and RESULT_KEY in result:
        return f"handler result uses the reserved key {RESULT_KEY!r}"
    return None


def stored_result(task: Task, result: Any, store: PayloadStore | None = None) -> Any:
    """``result``, or the reference to it once written to the store when it is too large to keep
    inline. Anything that cannot be stored is returned as it is, for ``outcomes`` to refuse."""
    store = store if store is not None else default_store()
    if store is None:
        return result
    size = encoded_size(result)
    if size is None or size <= result_threshold_bytes() or size > max_bytes():
        return result
    try:
        validation.json_value(result, max_bytes(), "handler result")
    except InvalidInput:
        return result
    ref = put_object(store, new_key("results", task.queue, task.id), encoded(result))
    return {RESULT_KEY: ref.to_dict()}


def finished(task: Task, store: PayloadStore | None = None) -> None:
    """The task succeeded or was cancelled: its payload object may expire with retention."""
    store = store if store is not None else default_store()
    try:
        ref = payload_ref(task)
    except InvalidInput:
        return
    if ref is None or store is None or ref.bucket != store.bucket or not owned_by(task, ref):
        return  # another task's object (or one named before task ids were) is not this task's to expire
    try:
        store.mark_finished(ref.key)
    except Exception as exc:  # noqa: BLE001 - a missed tag costs storage, never the outcome
        log.warning("could not tag payload object %s of task %s as finished: %s", ref.key, task.id, exc)


# -- reading and deleting ----------------------------------------------------------------------
def resolved(task: Task, store: PayloadStore | None = None) -> Task:
    """``task`` with its payload and result fetched from the store (headers keep the reference)."""
    store = store if store is not None else default_store()
    payload = task_payload(task, store)
    ref = result_ref(task.result)
    result = task.result if ref is None else fetch(store, ref, "result")
    return replace(task, payload=payload, result=result)



def handler_outcome(item: ClaimedTask, result: Any, policies: PolicyBook) -> Settlement:
    """What the worker settles for a handler that returned ``result``: a result too large to keep
    inline is written to the store first (its reference is the task's result); a handler's own
    use of the reserved key is an ``rdq.InvalidResult`` failure; a success tags the payload object."""
    task = item.task
    if result is None:  # most handlers: nothing to check or store (7 -> 2 us per task, timeit)
        settlement = Settlement(task.id, item.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
    else:
        problem = reserved_result_problem(result)
        if problem is not None:
            return outcomes.failed_attempt(policies, task, item.claim_token, Outcome.RETRYABLE_FAILURE,
                                           outcomes.truncated_error(outcomes.INVALID_RESULT, problem))
        try:
            result = stored_result(task, result)
        except Exception as exc:  # noqa: BLE001 - the bucket failed: a retryable failed attempt
            return outcomes.from_exception(item, exc, policies)
        settlement = outcomes.from_result(item, result, policies)
    if settlement.status is TaskStatus.SUCCEEDED and REF_HEADER in task.headers:
        finished(task)
    return settlement
