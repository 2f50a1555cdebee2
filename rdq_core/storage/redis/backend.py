"""Redis backend: every state change is one Lua script (``scripts/``) run atomically by the server.

Key layout (``P`` = the key prefix, default ``rdq``; ``{q}`` = the queue name as a hash tag, so
all keys of one queue live in one Redis Cluster slot and one script may touch them all):

=============================  ====================================================================
``P:{q}:due``                  zset of PENDING ids scored by ``next_attempt_at`` (µs since epoch)
``P:{q}:inflight``             zset of IN_FLIGHT ids scored by ``lease_expires_at`` (µs)
``P:{q}:dead``                 zset of DEAD ids scored by ``dead_at`` (µs); ties ordered by id
``P:{q}:succeeded``            zset of SUCCEEDED ids scored by ``updated_at`` (retention)
``P:{q}:cancelled``            zset of CANCELLED ids scored by ``updated_at`` (retention)
``P:{q}:task:<id>``            hash: the task's fields
``P:{q}:attempts:<id>``        hash: ``attempt_no`` -> attempt JSON (a field per number: unique)
``P:{q}:paused``               string, present while the queue is paused (read by ``claim.lua``)
``P:{q}:outbox``               zset of lifecycle-event ids scored by write order (``:outbox:seq``);
                               ``:outbox:events`` their JSON, ``:outbox:leases`` their leases (µs)
``P:{q}:lane:<p>:<g>``         zset of the PENDING ids of priority ``p`` and group ``g`` (``''`` for
                               none), scored like ``due``: the claim lanes (docs/flow-control.md)
``P:{q}:lanes``                zset of the lanes that hold tasks (all at score 0)
``P:{q}:conc:<key>``           zset of the IN_FLIGHT ids of a concurrency key (counted by claims)
``P:{q}:rate:<key>``           zset of a rate key's recent claims (token -> claim time, µs),
                               trimmed to the period by each claim, expiring when idle
``P:{q}:fair_last``            string: the group the last fair claim served last
``P:{q}:wake``                 pub/sub channel (not a key): ``enqueue.lua`` publishes the queue's
                               name there when it creates a due task; idle workers subscribe
``P:{P:global}:ids``           hash: task id -> queue (the global id index)
``P:{P:global}:queues``        set: queues that hold tasks (the reaper's registry)
``P:{P:global}:paused``        set: queues that may be paused (the listing of ``P:{q}:paused``)
``P:{P:audit}:all``            zset of every audit entry's id scored by its ``at`` (µs)
``P:{P:audit}:queue:<q>``      zset of the audit entries of queue ``q``, scored the same way
``P:{P:audit}:entry:<id>``     hash: the audit entry's fields
``P:{P:docs}:kind:<k>``        hash: the engine documents of kind ``k``, key -> ``<version>:<body>``
``P:{P:docs}:keys:<k>``        zset of kind ``k``'s document keys, all at score 0 (lex order)
=============================  ====================================================================

Every status has its own zset, so a task's status field and zset membership are changed together
by the same script, and each zset is the index listings, counts and bulk actions walk: ordered by
the status's instant, then by id in byte order, entered at a keyset position in O(log n)
(``_keyset.lua``). The id index and the queue registry live outside the queues' slots; they are
maintained by separate scripts in an order that tolerates races (see ``_forget_ids``), and
``docs/redis-backend.md`` explains the trade-off. The paused flag lives in the queue's slot, so
the claim script reads it in its own atomic step; the set that lists paused queues lives in
another slot and is kept in step by ordering (see ``_set_paused``). The audit trail has a slot
of its own: one script writes an entry and both of its index zsets. Engine documents have a slot
of their own too: one script per compare-and-set put or delete checks the stored version and
writes the hash and the lex index together; a page is one script over the index and the hash.

There is no schema to migrate: every key is created by the first write that needs it, and an
absent key reads as empty (not paused, no audit entries); ``migrate`` checks the server, loads
the scripts and puts PENDING tasks written by an rdq from before the claim lanes into theirs.

Round trips (``round_trips`` counts one per command or per pipeline sent, however many commands
the pipeline holds): claim 1 (the paused check is one EXISTS inside the claim script),
settle/extend/release 1 per batch (a pipeline of one script per queue when a batch spans
queues), enqueue 2 per batch, get 2, a page or count 1 per 1,000 entries examined, paused queues
1 (2 when any is listed), stats 2 (3 when any queue is listed as paused: stats asks for them),
a document's get, put or delete 1, a page of documents 1.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from ...errors import StorageUnavailable, TaskConflict
from ...flow import FlowPolicy
from ...model import ClaimRef, NewTask, Settlement, TaskStatus
from ..codec import Record
from ..core import DeadSelection, InsertedRecord, QueueCounts, Selection, dedupe_states_of
from .connection import _MIN_SERVER_VERSION, RedisConnection
from .encoding import (_after, _document, _enqueue_args, _group_by_token_queue, _json, _micros, _record,
                       _selection_args, _settle_args)
from .lua import SCRIPTS, Call

log = logging.getLogger(__name__)

# How many entries of a status zset one script call may examine, so a filtered scan (or a bulk
# action) over a huge queue never blocks the server for long; the client loops over bounded calls
# instead, each atomic on its own.
_SCAN_BUDGET = 1000


class RedisStorage(RedisConnection):
    """``redis://host:port/db?prefix=rdq`` (``rediss://`` for TLS; ``&cluster=true`` for Redis
    Cluster). Other query parameters go to redis-py (e.g. ``socket_timeout``). Every primitive is
    a script call here (the client and the sending are ``connection.py``'s, the arguments and
    replies ``encoding.py``'s)."""

    # -- lifecycle -----------------------------------------------------------------------------
    def migrate(self) -> None:
        """Redis has no schema: check the server and load the scripts (idempotent)."""
        with self.translated_errors():
            version = str(self._send(self._client.info, "server").get("redis_version", "0"))
            if tuple(int(p) for p in version.split(".")[:2]) < _MIN_SERVER_VERSION:
                raise StorageUnavailable(f"Redis {version} is too old; rdq needs 5.0 or later")
            try:
                policy = self._send(self._client.config_get, "maxmemory-policy").get("maxmemory-policy")
            except ResponseError:  # CONFIG is often disabled on managed Redis
                policy = None
            if policy not in (None, "noeviction"):
                log.warning("maxmemory-policy is %r: Redis may evict task keys; use noeviction", policy)
            self._load_scripts(list(SCRIPTS.values()))
            for queue in sorted(self._queues()):
                self._index_lanes(queue)

    def _index_lanes(self, queue: str) -> int:
        """Put the queue's PENDING tasks that have no claim lane (made PENDING by an rdq from
        before lanes) into theirs, in bounded script calls; how many were indexed."""
        start, indexed = 0, 0
        while True:
            start, exhausted, count = self._run(self._queue_call("index_lanes", queue, start, _SCAN_BUDGET))
            indexed += int(count)
            if exhausted:
                return indexed


    # -- producer side -------------------------------------------------------------------------
    def _insert(self, tasks: Sequence[NewTask], connection: Any) -> list[InsertedRecord]:
        """Two round trips per batch: reserve the ids in the global index, then one pipeline of
        an enqueue script per queue (plus reads of conflicting tasks on their own queues)."""
        # Encode and validate everything before reserving ids, so a bad item cannot leave
        # reservations without tasks behind.
        encoded = [_enqueue_args(t) for t in tasks]
        for task in tasks:
            self._queue_base_checked(task.queue)
        owners = self._run(self._global_call("reserve_ids", *[v for t in tasks for v in (t.id, t.queue)]))
        results: list[InsertedRecord | None] = [None] * len(tasks)
        accepted: dict[str, list[int]] = {}
        conflicting: dict[str, list[int]] = {}
        for i, (task, owner) in enumerate(zip(tasks, owners, strict=True)):
            if owner == task.queue:
                accepted.setdefault(task.queue, []).append(i)
            else:
                conflicting.setdefault(owner, []).append(i)

        calls: list[Call] = []
        for queue, indexes in accepted.items():
            calls.append(self._queue_call("enqueue", queue, queue, *[a for i in indexes for a in encoded[i]]))
            # Re-assert the index and registry after creating: this ordering is what lets a
            # concurrent purge repair them (see _forget_ids).
            calls.append(self._global_call("reserve_ids", *[v for i in indexes for v in (tasks[i].id, queue)]))
        for owner, indexes in conflicting.items():
            calls.append(self._queue_call("read_tasks", owner, *[tasks[i].id for i in indexes]))
        replies = iter(self._run_pipeline(calls))

        for indexes in accepted.values():
            created = next(replies)
            next(replies)
            for i, (flag, reply) in zip(indexes, created, strict=True):
                results[i] = InsertedRecord(_record(reply), inserted=flag == 1)
        dangling: list[tuple[int, str]] = []
        for owner, indexes in conflicting.items():
            for i, reply in zip(indexes, next(replies), strict=True):
                if reply:
                    results[i] = InsertedRecord(_record(reply), inserted=False)
                else:
                    dangling.append((i, owner))
        if dangling:
            self._take_over(tasks, dangling, results)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _insert_deduplicated(self, task: NewTask, connection: Any) -> InsertedRecord:
        """As ``_insert`` (the id reserved first, re-asserted after creating), with the match and
        the insert in one script, ``enqueue_dedupe.lua``: two round trips, three when the request
        is deduplicated (its id reservation is dropped again)."""
        args = _enqueue_args(task)
        owner = self._run(self._global_call("reserve_ids", task.id, task.queue))[0]
        if owner != task.queue:  # the id is another queue's: the ordinary conflict path
            return self._insert([task], connection)[0]
        window, max_wait = task.dedupe_for_seconds, task.dedupe_max_wait_seconds
        created, reply, deduplicated = self._run_pipeline([
            self._queue_call("enqueue_dedupe", task.queue, task.queue, task.dedupe_key,
                             _json(list(dedupe_states_of(task))), "" if window is None else _micros(window),
                             task.dedupe_mode.value, "" if max_wait is None else _micros(max_wait), *args),
            self._global_call("reserve_ids", task.id, task.queue),
        ])[0]
        if deduplicated:
            self._run(self._global_call("unindex", task.queue, "0", task.id))
        return InsertedRecord(_record(reply), inserted=created == 1, deduplicated=deduplicated == 1)

    def _take_over(self, tasks: Sequence[NewTask], dangling: list[tuple[int, str]], results: list[Any]) -> None:
        """An index entry names a queue that has no such task (an enqueue died between its two
        steps, or a purge between its steps): move the entry to the new queue if it is still
        the same, then enqueue again. Costs two more round trips, only in that case."""
        args = [v for i, owner in dangling for v in (tasks[i].id, owner, tasks[i].queue)]
        owners = self._run(self._global_call("take_over_ids", *args))
        retry = [i for (i, _), owner in zip(dangling, owners, strict=True) if owner == tasks[i].queue]
        lost = [tasks[i].id for (i, _), owner in zip(dangling, owners, strict=True) if owner != tasks[i].queue]
        if lost:
            raise TaskConflict(f"task id(s) {', '.join(lost)} are being enqueued on another queue concurrently")
        for i, result in zip(retry, self._insert([tasks[i] for i in retry], None), strict=True):
            results[i] = result

    # -- worker side ---------------------------------------------------------------------------
    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy, worker: str) -> list[Record]:
        # The token carries its queue so later fenced writes find the task's keys without a
        # lookup; the random part makes it unique even if Redis loses recent writes on restart.
        token_prefix = f"{queue}|{secrets.token_urlsafe(12)}."
        replies = self._run(self._queue_call("claim", queue, limit, _micros(lease_seconds), token_prefix,
                                             *_flow_args(flow), worker))
        return [_record(reply) for reply in replies]

    def _extend(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, str]:
        calls = [
            self._queue_call("extend", queue, _micros(lease_seconds), *[v for r in group for v in (r.task_id, r.claim_token)])
            for queue, group in _group_by_token_queue(refs).items()
        ]
        extended: dict[str, str] = {}
        for expiries, _refused in self._run_batch(calls):
            # The script reports each task's expiry as stored: never earlier than it was.
            extended.update(zip(expiries[::2], expiries[1::2], strict=True))
        return extended

    def _settle(self, settlements: Sequence[Settlement]) -> set[str]:
        # The lifecycle events of the settle are written by the same script (none when off).
        events = (",".join(self.events.settled_statuses), "1" if self.events.include_payload else "0")
        return self._fenced("settle", settlements, _settle_args, events)

    def _release(self, refs: Sequence[ClaimRef]) -> set[str]:
        return self._fenced("release", refs, lambda r: (r.task_id, r.claim_token))

    def _fenced(self, script: str, items: Sequence[Any], args: Callable[[Any], tuple[Any, ...]],
                lead: tuple[Any, ...] = ()) -> set[str]:
        """Run a fenced write script per queue in one round trip; the ids it did not refuse."""
        by_queue = _group_by_token_queue(items)
        calls = [self._queue_call(script, queue, *lead, *[a for item in group for a in args(item)])
                 for queue, group in by_queue.items()]
        applied: set[str] = set()
        for group, refused in zip(by_queue.values(), self._run_batch(calls), strict=True):
            applied |= {item.task_id for item in group} - set(refused)
        return applied

    # -- reaper side ---------------------------------------------------------------------------
    def _expired(self, limit: int, queue: str | None) -> list[Record]:
        queues = [queue] if queue is not None else self._queues()
        replies = self._run_batch([self._queue_call("expired_leases", q, limit) for q in queues])
        expired = [_record(r) for per_queue in replies for r in per_queue]
        expired.sort(key=lambda r: (int(r["lease_expires_at"]), r["id"]))
        return expired[:limit]

    # -- operator side -------------------------------------------------------------------------
    def _load(self, task_id: str) -> Record | None:
        queue = self._queue_of(task_id)
        if queue is None:
            return None
        reply = self._run(self._queue_call("read_tasks", queue, task_id))[0]
        return _record(reply) if reply else None

    def _cancel(self, task_id: str) -> tuple[Record | None, bool]:
        queue = self._queue_of(task_id)
        if queue is None:
            return None, False
        outcome = self._run(self._queue_call("cancel", queue, task_id))
        if outcome[0] == "missing":
            return None, False
        return _record(outcome[1]), outcome[0] == "cancelled"

    def _page(self, selection: Selection, limit: int, history: bool) -> list[Record]:
        """The status zset from the keyset position on, in bounded script calls: one call when the
        page fills within the scan budget (always for a page of up to 1,000 when no error-type or
        handler filter skips entries)."""
        after_score, after_id = _after(selection)
        found: list[Record] = []
        while True:
            exhausted, after_score, after_id, replies = self._run(self._queue_call(
                "page", selection.queue, selection.status.value, after_score, after_id, limit - len(found),
                _SCAN_BUDGET, *_selection_args(selection), "1" if history else "0"))
            found.extend(_record(reply) for reply in replies)
            if exhausted or len(found) >= limit:
                return found

    def _count(self, selection: Selection) -> int:
        """The zset's size (one call) without a filter; else the matches of a bounded walk."""
        after_score, after_id, total = "", "", 0
        while True:
            exhausted, after_score, after_id, counted = self._run(self._queue_call(
                "count", selection.queue, selection.status.value, after_score, after_id, _SCAN_BUDGET,
                *_selection_args(selection)))
            total += int(counted)
            if exhausted:
                return total

    def _cancel_selected(self, selection: Selection) -> int:
        """Each script call cancels the matches among up to ``_SCAN_BUDGET`` due entries
        atomically, re-reading each task's status in the same step; the selection as a whole is
        walked in such steps, not in one: a single script over a large queue would block the
        server for its duration. A task claimed between steps has left the due zset and is not
        cancelled; one enqueued meanwhile is cancelled if the walk has not yet passed its place."""
        return len(self._apply_selected(selection, "cancel"))

    def _redrive(self, selection: DeadSelection) -> int:
        return len(self._apply_selected(selection, "redrive"))

    def _purge_dead(self, selection: DeadSelection) -> int:
        return len(self._apply_selected(selection, "purge"))

    def _apply_selected(self, selection: Selection, action: str) -> list[str]:
        """Redrive, purge or cancel in bounded script calls, walking the status zset in
        (instant, id) order."""
        after_score, after_id, affected, queue_emptied = "", "", [], False
        # A redrive writes rdq.task.redriven per task in the same script: '1', '2' with payloads.
        events = "0" if not self.events.redriven else "2" if self.events.include_payload else "1"
        while True:
            exhausted, after_score, after_id, ids, empty = self._run(self._queue_call(
                "apply", selection.queue, action, after_score, after_id, _SCAN_BUDGET,
                *_selection_args(selection), events))
            affected.extend(ids)
            queue_emptied = empty == 1
            if exhausted:
                break
        if action == "purge" and affected:
            self._forget_ids(selection.queue, affected, queue_emptied)
        return affected

    def _stats(self, queue: str) -> QueueCounts:
        now, pending, in_flight, dead, succeeded, cancelled, oldest = self._run(self._queue_call("stats", queue))
        age = None
        if oldest is not None and oldest is not False and int(float(oldest)) <= int(now):
            age = (int(now) - int(float(oldest))) / 1_000_000
        counts = {TaskStatus.PENDING.value: pending, TaskStatus.IN_FLIGHT.value: in_flight, TaskStatus.DEAD.value: dead,
                  TaskStatus.SUCCEEDED.value: succeeded, TaskStatus.CANCELLED.value: cancelled}
        return QueueCounts(counts, age)

    # -- the outbox (per queue, in the queue's slot: see _queue_prelude.lua) ----------------------
    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        by_queue: dict[str, list[Mapping[str, Any]]] = {}
        for event in events:
            by_queue.setdefault(event["queue"], []).append(event)
        self._run_batch([
            self._queue_call("outbox_put", queue, queue, *[v for e in group for v in (e["id"], e["type"], e["detail"])])
            for queue, group in by_queue.items()])
        # Registered like a queue holding tasks, so take_events finds its outbox.
        self._send(self._client.sadd, self._global_keys[1], *by_queue)

    def _outbox_take(self, limit: int, lease_seconds: float) -> list[dict[str, Any]]:
        """Queues with events first (one pipeline of ZCARDs), then one take script per such queue
        until ``limit`` events are leased: a script never leases more than the caller gets."""
        queues = sorted(self._queues())
        if not queues:
            return []
        pipe = self._client.pipeline(transaction=False)
        for queue in queues:
            pipe.zcard(self._queue_base_checked(queue) + "outbox")
        counts = self._send(pipe.execute)
        taken: list[dict[str, Any]] = []
        for queue, count in zip(queues, counts, strict=True):
            if count and len(taken) < limit:
                replies = self._run(self._queue_call("outbox_take", queue, limit - len(taken), _micros(lease_seconds)))
                taken += [json.loads(reply) for reply in replies]
        return taken

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        # An id does not name its queue: every queue's outbox is asked, in one pipeline.
        queues = sorted(self._queues())
        return sum(int(n) for n in self._run_batch([self._queue_call("outbox_ack", queue, *ids) for queue in queues]))

    def _queues(self) -> list[str]:
        return list(self._send(self._client.smembers, self._global_keys[1]))

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        deleted_total = 0
        for queue in sorted(self._queues()):
            if deleted_total >= limit:
                break
            deleted, empty = self._run(
                self._queue_call("purge_finished", queue, _micros(older_than_seconds), limit - deleted_total)
            )
            if deleted:
                self._forget_ids(queue, deleted, empty == 1)
            deleted_total += len(deleted)
        return deleted_total

    # -- pausing ---------------------------------------------------------------------------------
    def _set_paused(self, queue: str, paused: bool) -> None:
        """The flag in the queue's slot is what claims obey; the registry (another slot, so not in
        the same atomic step) lists it. Pause sets the flag, then registers; resume deletes the
        flag, unregisters, then registers again if a concurrent pause set the flag meanwhile.
        Whatever the interleaving, a flag that stays set stays registered; a registry entry
        whose flag is gone (a pause that failed half way) is filtered out by ``_paused``."""
        flag = self._queue_base_checked(queue) + "paused"
        if paused:
            self._send(self._client.set, flag, "1")
            self._send(self._client.sadd, self._paused_registry, queue)
            return
        self._send(self._client.delete, flag)
        self._send(self._client.srem, self._paused_registry, queue)
        if self._send(self._client.exists, flag):
            self._send(self._client.sadd, self._paused_registry, queue)

    def _paused(self) -> list[str]:
        """The registered queues whose flag is set: one round trip, two when any is registered."""
        registered = sorted(self._send(self._client.smembers, self._paused_registry))
        if not registered:
            return []
        pipe = self._client.pipeline(transaction=False)
        for queue in registered:
            pipe.exists(self._queue_base_checked(queue) + "paused")
        flags = self._send(pipe.execute)
        return [queue for queue, flag in zip(registered, flags, strict=True) if flag]

    # -- the audit trail ---------------------------------------------------------------------------
    def _audit_keys(self, queue: str | None) -> tuple[str, ...]:
        everything = self._audit_base + "all"
        return (everything,) if queue is None else (everything, f"{self._audit_base}queue:{queue}")

    def _audit_append(self, entry: Mapping[str, Any]) -> str:
        """One script: the entry's hash and both index zsets, stamped by the server's TIME."""
        at: str = self._run(self._audit_call(
            "audit_append", self._audit_keys(str(entry["queue"])), entry["id"], entry["actor"], entry["action"],
            entry["queue"], entry["selection"], int(entry["count"])))
        return at

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> list[Record]:
        keys = self._audit_keys(queue)
        score, entry_id = ("", "") if before is None else (str(before[0]), before[1])
        replies = self._run(self._audit_call("audit_page", keys[-1:], score, entry_id, limit))
        return [dict(zip(fields[::2], fields[1::2], strict=True)) for fields in replies]

    # -- engine documents -----------------------------------------------------------------------
    def _doc_keys(self, kind: str) -> tuple[str, str]:
        """The kind's hash (key -> ``<version>:<body>``) and its lex index. The core checks kinds
        against ``[A-Za-z0-9._:~-]``: no brace can move them out of the documents' slot."""
        return f"{self._docs_base}kind:{kind}", f"{self._docs_base}keys:{kind}"

    def _doc_call(self, name: str, kind: str, *args: Any) -> Call:
        return Call(SCRIPTS[name], self._doc_keys(kind), args)

    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        """One HGET: the version and body are one value, so they are read together."""
        stored = self._send(self._client.hget, self._doc_keys(kind)[0], key)
        return None if stored is None else _document(stored)

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        version = self._run(self._doc_call("doc_put", kind, key, body, "" if expected is None else str(expected)))
        return None if version is None else int(version)

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        return bool(self._run(self._doc_call("doc_delete", kind, key, str(expected))) == 1)

    def _doc_page(self, kind: str, after: str | None, limit: int) -> list[tuple[str, int, str]]:
        flat = self._run(self._doc_call("doc_page", kind, after or "", limit))
        return [(key, *_document(stored)) for key, stored in zip(flat[::2], flat[1::2], strict=True)]

    # -- the global index and registry ---------------------------------------------------------
    def _queue_of(self, task_id: str) -> str | None:
        queue: str | None = self._send(self._client.hget, self._global_keys[0], task_id)
        return queue

    def _forget_ids(self, queue: str, deleted_ids: list[str], queue_emptied: bool) -> None:
        """Drop the index entries of deleted tasks (and the registry entry of an emptied queue).

        The index lives in another slot, so this cannot be atomic with the deletion. An enqueue
        of the same id (or into the same queue) may run in between; enqueue re-asserts its entries
        *after* creating, and this re-checks *after* removing, so whichever runs last restores
        what is still needed.
        """
        self._run(self._global_call("unindex", queue, "1" if queue_emptied else "0", *deleted_ids))
        existing, empty = self._run(self._queue_call("existing", queue, *deleted_ids))
        if existing:
            self._run(self._global_call("reserve_ids", *[v for task_id in existing for v in (task_id, queue)]))
        elif queue_emptied and empty != 1:
            self._send(self._client.sadd, self._global_keys[1], queue)


# -- encoding ----------------------------------------------------------------------------------


def _flow_args(flow: FlowPolicy) -> tuple[Any, ...]:
    """The queue's flow policy as ``claim.lua`` takes it ('' for each limit not set)."""
    rate = flow.rate_limit
    return (
        "" if flow.priority_aging_seconds is None else _micros(flow.priority_aging_seconds),
        "" if flow.max_in_flight is None else flow.max_in_flight,
        "1" if flow.fair_groups else "0",
        "" if flow.concurrency_limit is None else flow.concurrency_limit,
        _json(dict(flow.concurrency_overrides)) if flow.concurrency_overrides else "",
        "" if rate is None else rate.count,
        "" if rate is None else _micros(rate.window_seconds),
    )


