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

Which store: ``RDQ_PAYLOAD_BUCKET`` (S3, the deployed stack's bucket) or ``RDQ_PAYLOAD_DIR`` (a
directory; ``rdq dev`` uses ``<store dir>/rdq-payloads``); neither means payloads stay inline and
the 256 KiB limit holds. How objects are deleted (DLQ purge deletes them; retention is an S3
lifecycle rule on objects of finished tasks) is in docs/serverless.md, "Large payloads".
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import secrets
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import outcomes
from .. import validation
from ..errors import ConfigurationError, InvalidInput, PermanentError, StorageUnavailable, TaskConflict
from ..model import ClaimedTask, NewTask, Outcome, Settlement, Task, TaskFilter, TaskStatus
from .retry import PolicyBook
from ..storage.spi import Storage

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
#: S3's limit for one PUT (and so for a presigned upload): 5 GiB.
S3_SINGLE_PUT_BYTES = 5 * 1024**3
#: The tag the worker puts on a succeeded task's payload object; the bucket's lifecycle rule
#: expires tagged objects (and every ``results/`` object) after the retention period.
FINISHED_TAG = ("rdq-finished", "true")
#: The tag a presigned upload carries until a task is enqueued with it (``enqueued`` clears it):
#: the bucket's lifecycle rule expires tagged objects after ``PENDING_UPLOAD_DAYS``, so an upload
#: no task ever names does not stay in the bucket.
PENDING_TAG = ("rdq-pending", "true")
#: Days the lifecycle rule keeps a pending upload (template.yaml, PayloadBucket: never-enqueued-uploads).
PENDING_UPLOAD_DAYS = 2
#: Presigned URLs are valid this long.
PRESIGN_SECONDS = 900

#: The keys this module issues (``new_key``): nothing else is ever read, written or deleted.
_KEY = re.compile(r"payloads/[a-z0-9][a-z0-9._-]{0,119}/(?:[A-Za-z0-9][A-Za-z0-9._~-]{0,127}/)?[0-9a-f]{32}"
                  r"|results/[a-z0-9][a-z0-9._-]{0,119}/[A-Za-z0-9][A-Za-z0-9._~-]{0,127}/[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
        bucket, key, size, sha256 = data["bucket"], data["key"], _whole(data["size"]), data["sha256"]
        if not isinstance(bucket, str) or not 0 < len(bucket) <= 255:
            raise InvalidInput(f"{field}.bucket must be a bucket name", field)
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidInput(f"{field}.key is not a key this store issues", field)
        if type(size) is not int or not 0 <= size <= S3_SINGLE_PUT_BYTES:
            raise InvalidInput(f"{field}.size must be an integer in 0..{S3_SINGLE_PUT_BYTES}", field)
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise InvalidInput(f"{field}.sha256 must be 64 lowercase hexadecimal digits", field)
        return cls(bucket, key, size, sha256)

    @classmethod
    def from_header(cls, value: str) -> "PayloadRef":
        try:
            data = json.loads(value)
        except ValueError:
            raise InvalidInput(f"the {REF_HEADER} header is not JSON", REF_HEADER) from None
        return cls.from_dict(data, REF_HEADER)


def _whole(value: Any) -> Any:
    """JSON does not tell 3 from 3.0 (nor does JSON Schema's "integer")."""
    return int(value) if type(value) is float and value.is_integer() else value


# -- stores ------------------------------------------------------------------------------------
class PayloadStore(ABC):
    """Where offloaded payloads and results live. ``bucket`` is what references name."""

    bucket: str

    @abstractmethod
    def write(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is no such object."""

    @abstractmethod
    def size_of(self, key: str) -> int | None:
        """The object's size, or None when there is no such object."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None: ...

    def mark_finished(self, key: str) -> None:
        """Tell the retention rule the object's task finished (S3: a tag; elsewhere nothing)."""
        return None

    def clear_pending(self, key: str) -> None:
        """A task now names the uploaded object: it must not expire as a pending upload (S3: the
        tag goes; elsewhere nothing)."""
        return None

    @abstractmethod
    def upload_target(self, key: str, size: int, sha256: str) -> dict[str, Any]:
        """Where a caller puts an object of ``size`` bytes hashing to ``sha256`` (hex):
        ``{"url", "method", "headers"}``; the caller sends exactly those headers."""

    @abstractmethod
    def download_url(self, key: str) -> str: ...

    def put(self, key: str, data: bytes) -> PayloadRef:
        self.write(key, data)
        return PayloadRef(self.bucket, key, len(data), hashlib.sha256(data).hexdigest())


class S3PayloadStore(PayloadStore):
    """A bucket the stack owns (SSE-KMS and the lifecycle rule are the bucket's own settings)."""

    def __init__(self, bucket: str, client: Any = None) -> None:
        if not bucket:
            raise ConfigurationError("RDQ_PAYLOAD_BUCKET is empty")
        self.bucket = bucket
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from ..aws.clients import aws_client  # boto3 only where a bucket is configured

                # Objects are at most a few MB: a longer read than rdq's other calls, still one attempt.
                self._client = aws_client("s3", read_timeout=20.0, signature_version="s3v4")
            return self._client

    def _call(self, operation: str, **params: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **params)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code in ("AccessDenied", "403", "NoSuchBucket", "InvalidAccessKeyId", "KMS.DisabledException"):
                raise ConfigurationError(f"payload bucket {self.bucket!r}: {operation} refused ({code})") from None
            raise StorageUnavailable(f"payload bucket {self.bucket!r}: {operation} failed ({code})") from None
        except BotoCoreError as exc:
            raise StorageUnavailable(f"payload bucket {self.bucket!r}: {operation} failed ({exc})") from None

    def write(self, key: str, data: bytes) -> None:
        self._call("put_object", Key=key, Body=data, ContentType="application/json")

    def read(self, key: str) -> bytes | None:
        answer = self._call("get_object", Key=key)
        return None if answer is None else bytes(answer["Body"].read())

    def size_of(self, key: str) -> int | None:
        answer = self._call("head_object", Key=key)
        return None if answer is None else int(answer["ContentLength"])

    def delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            chunk = keys[start:start + 1000]
            answer = self._call("delete_objects", Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
            errors = (answer or {}).get("Errors") or []
            if errors:
                raise StorageUnavailable(f"payload bucket {self.bucket!r}: {len(errors)} object(s) not deleted "
                                         f"(first: {errors[0].get('Code')})")

    def mark_finished(self, key: str) -> None:
        self._call("put_object_tagging", Key=key,
                   Tagging={"TagSet": [{"Key": FINISHED_TAG[0], "Value": FINISHED_TAG[1]}]})

    def clear_pending(self, key: str) -> None:
        # The only tag an object has when its task is enqueued is the pending one (the worker
        # tags it finished later), so all of them go.
        self._call("delete_object_tagging", Key=key)

    def upload_target(self, key: str, size: int, sha256: str) -> dict[str, Any]:
        # Length, checksum and the pending tag are signed headers of the URL: S3 refuses a PUT of
        # another length or without the tag (SignatureDoesNotMatch), and one whose body does not
        # hash to the checksum (BadDigest). So the URL uploads this object and nothing larger.
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()
        tagging = f"{PENDING_TAG[0]}={PENDING_TAG[1]}"
        url = self.client.generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket, "Key": key, "ContentType": "application/json",
                                  "ContentLength": size, "ChecksumSHA256": checksum, "Tagging": tagging},
            ExpiresIn=PRESIGN_SECONDS)
        headers = {"Content-Type": "application/json", "Content-Length": str(size),
                   "x-amz-checksum-sha256": checksum, "x-amz-tagging": tagging}
        return {"url": url, "method": "PUT", "headers": headers}

    def download_url(self, key: str) -> str:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS)
        return url


class LocalPayloadStore(PayloadStore):
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
    return store.put(new_key("payloads", queue, validation.task_id(task_id)), encoded(payload))


def owned_by(task: Task, ref: PayloadRef) -> bool:
    """Whether ``ref`` names an object issued for ``task`` itself (its queue and id are in the
    key), the only objects a purge deletes or a success tags for expiry."""
    return ref.key.startswith((f"payloads/{task.queue}/{task.id}/", f"results/{task.queue}/{task.id}/"))


def with_ref(new_task: NewTask, ref: PayloadRef) -> NewTask:
    """``new_task`` carrying ``ref`` instead of its payload."""
    return replace(new_task, payload=None, headers={**new_task.headers, REF_HEADER: ref.to_header()})


def checked_upload(store: PayloadStore | None, queue: str, data: Any, task_id: str) -> PayloadRef:
    """A reference an HTTP caller enqueues task ``task_id`` with: issued by this store for this
    queue and this very task id, and the object is there with the size it names (the worker
    checks the hash). A malformed reference is ``InvalidInput``; one that does not match what the
    store holds is ``TaskConflict`` (409): the request is well formed, the bucket's state does not
    allow it (yet). Another task's object is refused (409): two tasks never share one."""
    ref = PayloadRef.from_dict(data)
    if store is None:
        raise TaskConflict("this deployment has no payload bucket; send the payload inline")
    if ref.bucket != store.bucket or not ref.key.startswith(f"payloads/{queue}/"):
        raise TaskConflict(f"payload_ref must name an object issued for queue {queue!r} in this deployment's bucket")
    if not ref.key.startswith(f"payloads/{queue}/{task_id}/"):
        raise TaskConflict(f"payload_ref must name an object issued for task {task_id!r}: ask for an upload with "
                           "this task_id (each task has its own object)")
    if ref.size > max_bytes():
        raise InvalidInput(f"payload_ref.size exceeds the {max_bytes()}-byte maximum", "payload_ref")
    size = store.size_of(ref.key)
    if size is None:
        raise TaskConflict(f"no object at payload_ref.key {ref.key!r}: upload it first")
    if size != ref.size:
        raise TaskConflict(f"the object at payload_ref.key holds {size} bytes, not {ref.size}")
    return ref


def enqueued(store: PayloadStore | None, ref: PayloadRef, task: Task) -> None:
    """An enqueue with the uploaded ``ref`` answered ``task``: when the task names that very
    object (created, or a deduplicated replace), the object stops being a pending upload and
    lives as long as its task. An idempotent repeat whose task names another object leaves this
    upload pending: the lifecycle rule removes it. A tag that cannot be cleared raises
    (``StorageUnavailable``, 503): the caller's retry is a repeat that clears it, before the
    lifecycle rule would take the payload of a pending task.

    Cleared after the task is written, never before: an enqueue that then fails (a conflict, the
    store down) leaves nothing that escapes expiry. A worker that ran and tagged the task
    finished in between loses that tag; retention (``RetentionHours``) still deletes the object
    with its task."""
    if store is None or ref.bucket != store.bucket or task.headers.get(REF_HEADER) != ref.to_header():
        return
    store.clear_pending(ref.key)


def upload_offer(store: PayloadStore | None, queue: str, size: Any, sha256: Any, task_id: Any) -> dict[str, Any]:
    """What ``POST /v1/queues/{queue}/payloads`` answers: where to PUT, and the reference, for
    the payload of task ``task_id`` (the only task that may then be enqueued with it)."""
    queue = validation.queue_name(queue)
    if store is None:
        raise InvalidInput("this deployment has no payload bucket; send the payload inline", "size")
    if task_id is None:
        raise InvalidInput("task_id is required: the id of the task this payload is for", "task_id")
    task_id = validation.task_id(task_id, "task_id")
    size = _whole(size)
    if type(size) is not int or not 0 < size <= max_bytes():
        raise InvalidInput(f"size must be an integer in 1..{max_bytes()}", "size")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise InvalidInput("sha256 must be 64 lowercase hexadecimal digits", "sha256")
    key = new_key("payloads", queue, task_id)
    target = store.upload_target(key, size, sha256)
    ref = PayloadRef(store.bucket, key, size, sha256)
    return {"upload": {**target, "expires_in_seconds": PRESIGN_SECONDS}, "payload_ref": ref.to_dict()}


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
    ref = store.put(new_key("results", task.queue, task.id), encoded(result))
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


def object_refs(tasks: Iterable[Task]) -> list[PayloadRef]:
    """Every object ``tasks`` own (payloads and results named under their own ids): what a purge
    deletes. A reference to anything else is left alone -- whoever wrote it, it is not theirs."""
    refs: list[PayloadRef] = []
    for task in tasks:
        for ref in (_ref_or_none(payload_ref, task), _ref_or_none(result_ref, task.result)):
            if ref is not None and owned_by(task, ref):
                refs.append(ref)
    return refs


def _ref_or_none(read: Callable[[Any], PayloadRef | None], source: Any) -> PayloadRef | None:
    """The reference ``read`` finds in ``source``; None when there is none or it is malformed."""
    try:
        return read(source)
    except InvalidInput:
        return None


def delete_objects(store: PayloadStore | None, refs: Sequence[PayloadRef]) -> int:
    """Delete the objects of ``refs`` that live in ``store``; how many were asked for."""
    keys = [ref.key for ref in refs if store is not None and ref.bucket == store.bucket]
    if keys and store is not None:
        store.delete(keys)
    return len(keys)


def purge_finished_tasks(storage: Storage, older_than_seconds: float, limit: int, store: PayloadStore | None = None,
                         idle_lanes: set[tuple[str, str]] | None = None) -> int:
    """One retention chunk: ``purge_succeeded(older_than_seconds, limit)``, and the payload and
    result objects of the purged tasks deleted with them. The count the store purged.

    The store purges the oldest finished tasks first, so the ones it deletes are among the oldest
    ``limit`` of each queue and status, read just before. Rows go first and an object is deleted
    only once its task is gone: a row never outlives its object; an object outlives its row only
    if its delete fails or its task was not in the read (then the bucket's lifecycle rule takes
    it). ``idle_lanes`` (queue, status) had nothing that old when last read: a pass skips them."""
    store = store if store is not None else default_store()
    if store is None:
        return storage.purge_succeeded(older_than_seconds, limit)
    cutoff = storage.now() - timedelta(seconds=older_than_seconds)
    candidates: list[Task] = []
    for queue in storage.list_queues():
        for status in (TaskStatus.SUCCEEDED, TaskStatus.CANCELLED):
            lane = (queue, status.value)
            if idle_lanes is not None and lane in idle_lanes:
                continue
            old = [t for t in storage.list_tasks(queue, status=status, limit=limit).tasks
                   if t.updated_at is not None and t.updated_at < cutoff]
            if not old and idle_lanes is not None:
                idle_lanes.add(lane)
            candidates.extend(t for t in old if object_refs([t]))
    count = storage.purge_succeeded(older_than_seconds, limit)
    if count and candidates:
        # Only the oldest ``count`` can have gone; each is checked, so a task the purge left keeps its objects.
        candidates.sort(key=lambda t: (t.updated_at, t.id))
        gone = [t for t in candidates[:count] if storage.get(t.id) is None]
        delete_objects(store, object_refs(gone))
    return count


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


def purge_dead_tasks(storage: Storage, queue: str, tasks: Sequence[Task], store: PayloadStore | None = None) -> int:
    """Purge exactly ``tasks`` (those still DEAD; ``tasks`` as read just before, e.g. one page of
    ``list_dead`` or ``list_tasks``) and delete the payload and result objects of the ones that are
    gone. A task redriven in between keeps its objects. The count the store purged."""
    if not tasks:
        return 0
    store = store if store is not None else default_store()
    count = storage.purge_dead(queue, TaskFilter(ids=tuple(t.id for t in tasks)))
    with_objects = [t for t in tasks if object_refs([t])]
    if with_objects and count < len(tasks):  # some left the DLQ meanwhile: keep their objects
        with_objects = [t for t in with_objects if storage.get(t.id) is None]
    delete_objects(store, object_refs(with_objects))
    return count
