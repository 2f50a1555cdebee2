"""Payload and result objects deleted with their tasks: a retention chunk (``purge_finished_tasks``)
and a DLQ purge (``purge_dead_tasks``) delete the objects of exactly the tasks that are gone, and
only objects named under those tasks' own ids (``owned_by``). The bucket's lifecycle rule takes
anything a failed delete leaves (docs/serverless.md, "Large payloads").
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

from ..errors import InvalidInput
from ..model import Task, TaskFilter, TaskStatus
from ..storage.spi import Storage
from .payloads import PayloadRef, PayloadStore, default_store, owned_by, payload_ref, result_ref


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
