"""Direct uploads of large payloads over HTTP: ``POST /v1/queues/{queue}/payloads`` offers a
presigned PUT for one task's payload (``upload_offer``), an enqueue that names the uploaded object
is checked against what the store holds (``checked_upload``), and once the task is written the
object stops being a pending upload (``enqueued``). The format and the store are
``rdq_core/engine/payloads.py``'s.
"""

from __future__ import annotations

from typing import Any

from .. import validation
from ..aws.s3_payloads import PRESIGN_SECONDS
from ..errors import InvalidInput, TaskConflict
from ..model import Task
from .payloads import REF_HEADER, SHA256_HEX, PayloadRef, PayloadStore, max_bytes, new_key, whole


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
    size = whole(size)
    if type(size) is not int or not 0 < size <= max_bytes():
        raise InvalidInput(f"size must be an integer in 1..{max_bytes()}", "size")
    if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
        raise InvalidInput("sha256 must be 64 lowercase hexadecimal digits", "sha256")
    key = new_key("payloads", queue, task_id)
    target = store.upload_target(key, size, sha256)
    ref = PayloadRef(store.bucket, key, size, sha256)
    return {"upload": {**target, "expires_in_seconds": PRESIGN_SECONDS}, "payload_ref": ref.to_dict()}
