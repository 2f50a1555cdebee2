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
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError, SlotNotCoveredError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...errors import ConfigurationError, InvalidInput, RdqError, StorageUnavailable, TaskConflict
from ...flow import FlowPolicy
from ...model import ClaimRef, NewTask, Settlement, TaskStatus
from ..codec import Record, RecordCodec, epoch_micros
from ..core import DeadSelection, InsertedRecord, QueueCounts, Selection, StorageCore, dedupe_states_of
from ..spi import from_micros, storable_error, storable_json, to_micros
from .client import open_client, send_pipeline
from .lua import QUEUE_ZSETS, SCRIPTS, Call, Script

log = logging.getLogger(__name__)

_QUEUE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,119}$")
# How many entries of a status zset one script call may examine, so a filtered scan (or a bulk
# action) over a huge queue never blocks the server for long; the client loops over bounded calls
# instead, each atomic on its own.
_SCAN_BUDGET = 1000
_MIN_SERVER_VERSION = (5, 0)
#: Error replies of server states that pass (out of memory, failover, loading, a busy script).
_TRANSIENT_REPLIES = ("OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "BUSY")
#: Scripts that write nothing: ``wait_replicas`` has nothing to confirm for them.
_READ_ONLY_SCRIPTS = frozenset({"expired_leases", "read_tasks", "stats", "page", "count", "existing", "audit_page",
                                "doc_page"})
#: The error prefix of a script that refused its arguments before writing anything.
_INVALID_ARGUMENTS = "RDQ_INVALID"


class RedisStorage(StorageCore):
    """``redis://host:port/db?prefix=rdq`` (``rediss://`` for TLS; ``&cluster=true`` for Redis
    Cluster). Other query parameters go to redis-py (e.g. ``socket_timeout``)."""

    schemes = ("redis", "rediss")
    store_name = "Redis"
    codec = RecordCodec(time=epoch_micros)
    # NOSCRIPT twice in a row means the script cache was flushed again meanwhile: it passes.
    # SlotNotCoveredError: a Cluster whose slot map has a hole while a failover is under way.
    transient_errors = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, NoScriptError, SlotNotCoveredError)
    joins_transactions = False

    def __init__(self, url: str) -> None:
        self._client, self.prefix, self._durability = open_client(url)
        self._global_keys = (f"{self.prefix}:{{{self.prefix}:global}}:ids", f"{self.prefix}:{{{self.prefix}:global}}:queues")
        self._paused_registry = f"{self.prefix}:{{{self.prefix}:global}}:paused"
        self._audit_base = f"{self.prefix}:{{{self.prefix}:audit}}:"
        self._docs_base = f"{self.prefix}:{{{self.prefix}:docs}}:"
        self._counter_lock = threading.Lock()
        self.round_trips = 0

    def enqueue_listener(self, queues: Sequence[str]) -> _PubSubListener:
        """A pub/sub connection subscribed to the wake channel of each of ``queues``, or of every
        queue (a pattern) when none is named; returned once the server confirmed it."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=False)
        try:
            if queues:
                pubsub.subscribe(*[self._queue_base_checked(queue) + "wake" for queue in queues])
            else:
                pubsub.psubscribe(f"{self.prefix}:{{*}}:wake")
            confirmed = 0
            while confirmed < max(len(queues), 1):
                message = pubsub.get_message(timeout=DEFAULT_SUBSCRIBE_TIMEOUT)
                if message is None:
                    raise StorageUnavailable("Redis did not confirm the wake-up subscription")
                confirmed += message["type"] in ("subscribe", "psubscribe")
        except BaseException:
            pubsub.close()
            raise
        return _PubSubListener(pubsub)

    def is_transient(self, exc: BaseException) -> bool:
        return super().is_transient(exc) or (isinstance(exc, ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES))

    # -- sending -------------------------------------------------------------------------------
    def _send(self, command: Callable[..., Any], *args: Any) -> Any:
        """Send one command or pipeline: one round trip. A reply that refuses the request itself
        (not the server's state) becomes the SPI error it means."""
        with self._counter_lock:
            self.round_trips += 1
        try:
            return command(*args)
        except ResponseError as exc:
            refusal = _refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc

    def _queue_base_checked(self, queue: str) -> str:
        # The name becomes the hash tag: anything outside the queue charset could change the slot.
        if not isinstance(queue, str) or not _QUEUE_NAME.match(queue):
            raise InvalidInput(f"invalid queue name {queue!r}", field="queue")
        return f"{self.prefix}:{{{queue}}}:"

    def _queue_call(self, name: str, queue: str, *args: Any) -> Call:
        base = self._queue_base_checked(queue)
        return Call(SCRIPTS[name], tuple(base + z for z in QUEUE_ZSETS), (base, *args))

    def _global_call(self, name: str, *args: Any) -> Call:
        return Call(SCRIPTS[name], self._global_keys, args)

    def _audit_call(self, name: str, keys: tuple[str, ...], *args: Any) -> Call:
        return Call(SCRIPTS[name], keys, (self._audit_base + "entry:", *args))

    def _load_scripts(self, scripts: Sequence[Script]) -> None:
        for script in {s.name: s for s in scripts}.values():
            self._send(self._client.script_load, script.source)

    def _run(self, call: Call) -> Any:
        """Send one script by SHA; on NOSCRIPT (server restarted, failed over or flushed its
        script cache) load it and send it again -- a NOSCRIPT reply means nothing ran."""
        if self._durability.replicas and call.script.name not in _READ_ONLY_SCRIPTS:
            return self._run_pipeline([call])[0]  # the script and its WAIT: one round trip
        try:
            return self._send(self._client.evalsha, call.script.sha, len(call.keys), *call.keys, *call.args)
        except NoScriptError:
            self._load_scripts([call.script])
        return self._send(self._client.evalsha, call.script.sha, len(call.keys), *call.keys, *call.args)

    def _run_pipeline(self, calls: Sequence[Call]) -> list[Any]:
        """Send many scripts in one round trip (not a transaction: each script is atomic on its
        own). Calls refused with NOSCRIPT are resent, in order, after loading their scripts."""
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for attempt in range(2):
            if not pending:
                break
            commands = [("EVALSHA", calls[i].script.sha, len(calls[i].keys), *calls[i].keys, *calls[i].args)
                        for i in pending]
            # Errors come back in place (NOSCRIPT among them), on a single Redis and a Cluster alike.
            reads = [calls[i].script.name in _READ_ONLY_SCRIPTS for i in pending]
            replies = self._send(send_pipeline, self._client, commands, self._durability, reads)
            missing = []
            for i, reply in zip(pending, replies, strict=True):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(reply, Exception):
                    refusal = _refusal(reply) if isinstance(reply, ResponseError) else None
                    raise reply if refusal is None else refusal from reply
                else:
                    results[i] = reply
            if missing:
                self._load_scripts([calls[i].script for i in missing])
            pending = missing
        return results

    def _run_batch(self, calls: list[Call]) -> list[Any]:
        """One script alone, or one pipeline of scripts (one per queue): a single round trip."""
        if not calls:
            return []
        if len(calls) == 1:
            return [self._run(calls[0])]
        return self._run_pipeline(calls)

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

    def close(self) -> None:
        self._client.close()

    def close_idle_connections(self) -> int:
        # A cluster client keeps a pool per node; commands in flight keep their connections.
        pool = getattr(self._client, "connection_pool", None)
        if pool is None:
            return 0
        idle = len(getattr(pool, "_available_connections", ()))
        pool.disconnect(inuse_connections=False)
        return idle

    def _now(self) -> datetime:
        seconds, micros = self._send(self._client.time)
        return from_micros(int(seconds) * 1_000_000 + int(micros))

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
    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> list[Record]:
        # The token carries its queue so later fenced writes find the task's keys without a
        # lookup; the random part makes it unique even if Redis loses recent writes on restart.
        token_prefix = f"{queue}|{secrets.token_urlsafe(12)}."
        replies = self._run(self._queue_call("claim", queue, limit, _micros(lease_seconds), token_prefix, *_flow_args(flow)))
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


def _refusal(exc: ResponseError) -> RdqError | None:
    """The SPI error for a reply that refuses the request itself, or None."""
    text = str(exc)
    if text.startswith(_INVALID_ARGUMENTS):  # a script refused its arguments and wrote nothing
        return InvalidInput(text.split(" script: ", 1)[0][len(_INVALID_ARGUMENTS):].strip())
    if "DB index is out of range" in text:  # redis://host/99 on a 16-database server
        return ConfigurationError(f"the Redis URL names a database this server does not have ({text}); "
                                  f"use one in 0..(databases-1), usually 0..15")
    return None


# -- encoding ----------------------------------------------------------------------------------

def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _json(value: Any) -> str:
    # UTF-8 JSON with lone surrogates repaired: the same text every backend stores, and JSON
    # that Redis' cjson can decode (it rejects a lone "\ud800" escape).
    return storable_json(value)


#: Seconds to wait for the server to confirm a wake-up subscription.
DEFAULT_SUBSCRIBE_TIMEOUT = 5.0


class _PubSubListener:
    """The wake-up subscription of one worker (``enqueue_listener``)."""

    def __init__(self, pubsub: Any) -> None:
        self.pubsub = pubsub

    def receive(self, timeout: float) -> list[str]:
        message = self.pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        if message is None or message["type"] not in ("message", "pmessage"):
            return []
        return [str(message["data"])]

    def close(self) -> None:
        self.pubsub.close()


def _enqueue_args(task: NewTask) -> tuple[Any, ...]:
    return (
        task.id,
        task.handler,
        _json(task.payload),
        _json(dict(task.headers)),
        "" if task.max_attempts is None else int(task.max_attempts),
        "" if task.backoff is None else _json(task.backoff.to_dict()),
        _micros(task.delay_seconds or 0.0),
        "" if task.run_at is None else to_micros(task.run_at),
        int(task.priority or 0),
        task.concurrency_key or "",
        task.rate_key or "",
        task.group or "",
    )


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


def _settle_args(s: Settlement) -> tuple[Any, ...]:
    error = storable_error(s.error)
    return (
        s.task_id,
        s.claim_token,
        s.outcome.value,
        s.status.value,
        _micros(s.retry_delay_seconds),
        _json(error.to_dict()) if error else "",
        error.type if error else "",
        _json(s.result) if s.status is TaskStatus.SUCCEEDED else "",
        "" if s.started_after_seconds is None else _micros(s.started_after_seconds),
    )


def _after(selection: Selection) -> tuple[str, str]:
    """The keyset position as the scripts take it: ``("", "")`` for the start."""
    return ("", "") if selection.after is None else (str(selection.after[0]), selection.after[1])


def _selection_args(selection: Selection) -> tuple[str, str, str]:
    return (
        _json(list(selection.ids)) if selection.ids is not None else "",
        selection.error_type or "",
        selection.handler or "",
    )


def _group_by_token_queue(refs: Sequence[Any]) -> dict[str, list[Any]]:
    """Group fenced writes by the queue named in their claim token; a token that names no
    valid queue was not minted here and is left out: refused without a round trip."""
    by_queue: dict[str, list[Any]] = {}
    for ref in refs:
        queue, sep, _ = str(ref.claim_token).partition("|")
        if sep and _QUEUE_NAME.match(queue):
            by_queue.setdefault(queue, []).append(ref)
    return by_queue


def _document(stored: str) -> tuple[int, str]:
    """A document as the kind's hash holds it, ``<version>:<body>``, as ``(version, body)``."""
    version, _, body = stored.partition(":")
    return int(version), body


def _record(reply: Sequence[Any]) -> Mapping[str, Any]:
    """A script's task reply ``{task hash, attempts hash}`` (both flat) as a codec record."""
    fields, history = reply
    record: dict[str, Any] = dict(zip(fields[::2], fields[1::2], strict=True))
    record["attempts"] = [{"attempt_no": no, **json.loads(raw)} for no, raw in zip(history[::2], history[1::2], strict=True)]
    return record
