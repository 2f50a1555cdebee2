"""MongoDB primitives for the storage core (pymongo 4.x). The layout, the clock and the crash-safe
settlement are described in the package doc and in docs/mongo-backend.md."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence, TypeGuard
from urllib.parse import parse_qsl, urlsplit

import pymongo
from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne, monitoring
from pymongo.errors import (
    AutoReconnect,
    BulkWriteError,
    CollectionInvalid,
    ConnectionFailure,
    DuplicateKeyError,
    InvalidURI,
    NetworkTimeout,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
)

from ...errors import ConfigurationError, StorageUnavailable, TaskConflict
from ...events import task_event_id
from ...flow import FlowPolicy
from ...model import ClaimRef, DedupeMode, NewTask, Outcome, Settlement, TaskStatus
from ..codec import RecordCodec, epoch_millis
from ..core import (LIVE_STATUSES, ORDER_FIELD, DeadSelection, InsertedRecord, QueueCounts, Selection, StorageCore,
                    dedupe_states_of)
from ..querytext import migrations
from ..spi import from_micros, storable_json, to_micros
from .flow_claim import FlowClaim

log = logging.getLogger(__name__)

DEFAULT_DATABASE = "rdq"
DUPLICATE_KEY = 11000
NAMESPACE_EXISTS = 48
# How long to look for a server before giving up. pymongo's 30 s default would eat a Lambda
# invocation; a URL that sets serverSelectionTimeoutMS wins (as for the two below).
DEFAULT_SERVER_SELECTION_MS = 10_000
# Opening a connection (TCP + TLS + handshake); pymongo's default is 20 s.
DEFAULT_CONNECT_TIMEOUT_MS = 10_000
# Waiting for any reply. pymongo waits forever by default, so a half-open connection would hang
# a claim loop; every rdq command answers in milliseconds.
DEFAULT_SOCKET_TIMEOUT_MS = 30_000
# purge_dead works through large selections in chunks so one delete never carries a huge $in.
PURGE_CHUNK = 500
#: How long an enqueue may hold a dedupe key's lock document before another may take it over.
DEDUPE_LOCK_MS = 5_000

_RETAINED_STATUSES = [TaskStatus.SUCCEEDED.value, TaskStatus.CANCELLED.value]
# A listing without history leaves out the attempt rows a task carries (codec reads none).
_WITHOUT_HISTORY = {"pending_attempts": 0, "last_attempt": 0, "pending_events": 0}
#: What a task event is built from (``_events_on_task``).
_EVENT_FIELDS = {"queue": 1, "handler": 1, "redrive_count": 1, "payload_json": 1, "last_error": 1,
                 "pending_events": 1, "event_no": 1, "incarnation": 1, "created_at_ms": 1}
_CLAIM_FIELDS = {"claim_token": "", "claimed_at_ms": "", "lease_expires_at_ms": ""}

# Tests set this to simulate a process dying between two writes: it is called with the name of
# each crash point (e.g. "settle:committed") and may raise. Never set in production.
_crash_hook: Callable[[str], None] | None = None


def _crash_point(name: str) -> None:
    if _crash_hook is not None:
        _crash_hook(name)


class _CommandCounter(monitoring.CommandListener):
    """Counts every command pymongo sends on behalf of this storage (find, getMore, hello…)."""

    def __init__(self, on_command: Callable[[], None]):
        self._on_command = on_command

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self._on_command()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


class MongoStorage(StorageCore):
    schemes = ("mongodb", "mongodb+srv")
    store_name = "MongoDB"
    # Network errors, timeouts and server selection failures; a server's refusal is a bug.
    transient_errors = (ConnectionFailure,)
    codec = RecordCodec(
        time=epoch_millis,
        keys={
            "id": "_id", "payload": "payload_json", "headers": "headers_json", "result": "result_json",
            "next_attempt_at": "next_attempt_at_ms", "lease_expires_at": "lease_expires_at_ms",
            "claimed_at": "claimed_at_ms", "created_at": "created_at_ms", "updated_at": "updated_at_ms",
            "dead_at": "dead_at_ms", "started_at": "started_at_ms", "finished_at": "finished_at_ms",
        },
    )

    def __init__(self, url: str):
        self.url = url
        self.round_trips = 0
        self._round_trip_lock = threading.Lock()
        options: dict[str, Any] = {
            "tz_aware": True,
            "tzinfo": timezone.utc,
            "event_listeners": [_CommandCounter(self._count_round_trip)],
            "appname": "rdq",
        }
        in_url = {name.lower() for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
        for name, value in (("serverSelectionTimeoutMS", DEFAULT_SERVER_SELECTION_MS),
                            ("connectTimeoutMS", DEFAULT_CONNECT_TIMEOUT_MS),
                            ("socketTimeoutMS", DEFAULT_SOCKET_TIMEOUT_MS)):
            if name.lower() not in in_url:  # keyword arguments would override the URL
                options[name] = value
        try:
            self._client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(url, **options)
        except (InvalidURI, ValueError) as exc:
            raise ConfigurationError(f"malformed MongoDB URL: {exc}") from exc
        except ConnectionFailure as exc:  # mongodb+srv may resolve DNS while constructing
            raise StorageUnavailable(f"MongoDB unavailable: {exc}") from exc
        self._db = self._client.get_default_database(default=DEFAULT_DATABASE)
        self._tasks = self._db["tasks"]
        self._attempts = self._db["attempts"]
        self._schema = self._db["schema"]
        self._queue_flags = self._db["queues"]
        self._audit = self._db["audit"]
        self._documents = self._db["documents"]
        self._outbox = self._db["outbox"]
        self._flow_slots = self._db["flow_slots"]
        self._dedupe_locks = self._db["dedupe_locks"]

    def _count_round_trip(self) -> None:
        with self._round_trip_lock:
            self.round_trips += 1

    # -- lifecycle -------------------------------------------------------------------------
    def migrate(self) -> None:
        """Every migration file, in order (each is idempotent), then the version is raised."""
        with self.translated_errors():
            steps = [(m.version, json.loads(m.text)) for m in migrations(__package__)]
            existing = set(self._db.list_collection_names())
            for _, step in steps:
                for name in step.get("collections", ()):
                    if name not in existing:
                        self._create_collection(name)
                        existing.add(name)
                for index in step.get("indexes", ()):
                    self._create_index(index)
            self._schema.update_one(
                {"_id": "schema"},
                {"$max": {"version": steps[-1][0]}, "$set": {"migrated_at_ms": _epoch_ms(self._server_now())}},
                upsert=True,
            )

    def _create_collection(self, name: str) -> None:
        try:
            self._db.create_collection(name)
        except CollectionInvalid:
            pass  # a concurrent migrate created it first
        except OperationFailure as exc:
            if exc.code != NAMESPACE_EXISTS:
                raise

    def _create_index(self, index: Mapping[str, Any]) -> None:
        options: dict[str, Any] = {"name": index["name"]}
        if "partial" in index:
            options["partialFilterExpression"] = index["partial"]
        if index.get("unique"):
            options["unique"] = True
        self._db[index["collection"]].create_index([(field, order) for field, order in index["keys"]], **options)

    def close(self) -> None:
        self._client.close()

    # -- primitives ------------------------------------------------------------------------
    def _now(self) -> datetime:
        return self._server_now()

    def _server_now(self) -> datetime:
        """The server clock, read with ``hello`` (one round trip), as aware UTC at ms precision.
        ``$$NOW`` would need update pipelines, which the nx-27017 test server does not implement."""
        try:
            reply = self._client.admin.command("hello")
        except (NetworkTimeout, ServerSelectionTimeoutError):
            raise  # a half-open connection or no server: fail now, do not wait a second timeout
        except AutoReconnect:
            # A pooled connection the server closed (a restart): hello is read-only, so it is
            # sent once more on a fresh connection, like pymongo's own retryable reads (which do
            # not cover commands).
            reply = self._client.admin.command("hello")
        local_time = reply.get("localTime")
        if not isinstance(local_time, datetime):
            raise StorageUnavailable("MongoDB server did not report localTime in its hello reply")
        if local_time.tzinfo is None:  # admin.command decodes with default (naive UTC) options
            local_time = local_time.replace(tzinfo=timezone.utc)
        return from_micros(_epoch_ms(local_time) * 1000)

    def _insert(self, tasks: Sequence[NewTask], connection: Any) -> list[InsertedRecord]:
        now_ms = _epoch_ms(self._server_now())
        docs = [_new_task_doc(new, now_ms) for new in tasks]
        # One unordered insert: every new id lands, each existing id fails alone with a
        # duplicate-key error. (An upserting find_one_and_update per task would cost a round
        # trip each, and nx-27017 drops $setOnInsert on that path.)
        duplicate_positions: set[int] = set()
        try:
            self._tasks.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            duplicate_positions = _duplicate_positions(exc)
        existing: dict[str, Mapping[str, Any]] = {}
        if duplicate_positions:
            existing_ids = sorted({docs[p]["_id"] for p in duplicate_positions})
            found = list(self._tasks.find({"_id": {"$in": existing_ids}}))
            existing = {d["_id"]: d for d in self._with_histories(found)}
        results: list[InsertedRecord] = []
        for position, doc in enumerate(docs):
            if position not in duplicate_positions:
                results.append(InsertedRecord(doc, inserted=True))
                continue
            record = existing.get(doc["_id"])
            if record is None:  # purged between the insert and the read: report the conflict
                raise TaskConflict(f"task {doc['_id']!r} changed while being enqueued; retry")
            results.append(InsertedRecord(record, inserted=False))
        return results

    def _insert_deduplicated(self, task: NewTask, connection: Any) -> InsertedRecord:
        # No multi-document transactions here (nx-27017 has none): the match and the insert are
        # made one step by a lock document per queue and key, taken by insert_one on its unique
        # _id. Its lease (DEDUPE_LOCK_MS) outlives any enqueue; a holder that died is taken over
        # once the lease is past, by a conditional update only one waiter can win.
        lock_id, token = f"{task.queue} {task.dedupe_key}", uuid.uuid4().hex
        now_ms = self._take_dedupe_lock(lock_id, token)
        try:
            holder = self._tasks.find_one({"_id": task.id})
            if holder is not None:
                return InsertedRecord(self._with_histories([holder])[0], False)
            # The key's tasks newest first, the first that matches wins. Filtering here rather than
            # with an $or in the query: nx-27017 scans the collection for an $or (27 ms at 300
            # tasks, against 1.4 ms for this walk of rdq_dedupe_match).
            states = set(dedupe_states_of(task))
            since = None if task.dedupe_for_seconds is None else now_ms - _duration_ms(task.dedupe_for_seconds)
            with self._tasks.find({"queue": task.queue, "dedupe_key": task.dedupe_key},
                                  sort=[("created_at_ms", DESCENDING), ("task_id", DESCENDING)], batch_size=16) as walk:
                match = next((doc for doc in walk
                              if doc["status"] in states or (since is not None and doc["created_at_ms"] >= since)), None)
            if match is None:
                return self._insert([task], connection)[0]
            change = _dedupe_change(task, match, now_ms)
            if change:
                changed = self._tasks.find_one_and_update({"_id": match["_id"], "status": TaskStatus.PENDING.value},
                                                          {"$set": change}, return_document=ReturnDocument.AFTER)
                match = changed or match
            return InsertedRecord(self._with_histories([match])[0], False, deduplicated=True)
        finally:
            self._dedupe_locks.delete_one({"_id": lock_id, "token": token})

    def _take_dedupe_lock(self, lock_id: str, token: str) -> int:
        """Hold the queue and key's lock; the server's now (ms) when it was taken."""
        give_up = time.monotonic() + DEDUPE_LOCK_MS / 1000
        pause = 0.002
        while True:
            now_ms = _epoch_ms(self._server_now())
            try:
                self._dedupe_locks.insert_one({"_id": lock_id, "token": token, "until_ms": now_ms + DEDUPE_LOCK_MS})
                return now_ms
            except DuplicateKeyError:
                taken = self._dedupe_locks.find_one_and_update(
                    {"_id": lock_id, "until_ms": {"$lt": now_ms}},
                    {"$set": {"token": token, "until_ms": now_ms + DEDUPE_LOCK_MS}})
                if taken is not None:
                    return now_ms
            if time.monotonic() > give_up:
                raise StorageUnavailable(f"dedupe key {lock_id!r} stayed locked for {DEDUPE_LOCK_MS} ms; retry")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy) -> list[Mapping[str, Any]]:
        # A paused queue claims nothing. findAndModify cannot read another collection, so the
        # flag is read before the first task is taken (one _id probe, nothing per task). Not
        # atomic with the claim: a claim that starts after set_paused returned sees the flag; a
        # claim already past the read when the queue is paused finishes its batch, like a claim
        # that returned just before. (Reading it on a second thread while the clock is read
        # measured no faster on the test server, so it stays sequential.)
        # One probe reads the flag and the fair claim's cursor. Truthiness, not `is True`:
        # nx-27017 stores a boolean set again as 1.
        flags = self._queue_flags.find_one({"_id": queue}, {"paused": 1, "fair_last": 1})
        if flags is not None and flags.get("paused"):
            return []
        now_ms = _epoch_ms(self._server_now())
        if flow.plain:
            return self._claim_in_order(queue, limit, now_ms, _duration_ms(lease_seconds))
        claim = FlowClaim(self._tasks, self._flow_slots, queue, limit, now_ms, _duration_ms(lease_seconds), flow,
                          None if flags is None else flags.get("fair_last"))
        try:
            claimed = claim.run()
        except BaseException:
            self._hand_back_on_error(claim.claimed)
            raise
        if claim.served_group is not None:
            self._queue_flags.update_one({"_id": queue}, {"$set": {"fair_last": claim.served_group}}, upsert=True)
        return claimed

    def _claim_in_order(self, queue: str, limit: int, now_ms: int, lease_ms: int) -> list[Mapping[str, Any]]:
        """The plain claim: due tasks by priority, due time and id, one findAndModify each."""
        lease_expires_at_ms = now_ms + lease_ms
        due = {"queue": queue, "status": TaskStatus.PENDING.value, "next_attempt_at_ms": {"$lte": now_ms}}
        claimed_docs: list[Mapping[str, Any]] = []
        try:
            # findAndModify is atomic per document: a task matched here is flipped to IN_FLIGHT
            # before any other claimer can match it, so concurrent loops get disjoint tasks.
            for _ in range(limit):
                doc = self._tasks.find_one_and_update(
                    due,
                    {
                        "$set": {
                            "status": TaskStatus.IN_FLIGHT.value,
                            "claim_token": uuid.uuid4().hex,
                            "claimed_at_ms": now_ms,
                            "lease_expires_at_ms": lease_expires_at_ms,
                            "updated_at_ms": now_ms,
                        }
                    },
                    sort=[("priority", ASCENDING), ("next_attempt_at_ms", ASCENDING), ("task_id", ASCENDING)],
                    return_document=ReturnDocument.AFTER,
                )
                if doc is None:
                    break
                claimed_docs.append(doc)
        except BaseException:
            self._hand_back_on_error(claimed_docs)
            raise
        return claimed_docs

    def _hand_back_on_error(self, claimed_docs: Sequence[Mapping[str, Any]]) -> None:
        """Hand back what a failing claim already took rather than let it wait out a lease it
        never used (which would cost the tasks a LEASE_EXPIRED attempt). Best effort."""
        if claimed_docs:
            try:
                self._release([ClaimRef(d["_id"], d["claim_token"]) for d in claimed_docs])
            except Exception:  # noqa: BLE001 - best effort; the claim's own error is re-raised by the caller
                pass

    def _extend(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, int]:
        now_ms = _epoch_ms(self._server_now())
        lease_expires_at_ms = now_ms + _duration_ms(lease_seconds)
        # $max, atomically per document: an extension never moves an expiry earlier (a short
        # heartbeat must not hand a long-leased task to the reaper). updated_at is left alone so
        # that "modified" means "the lease moved to ours".
        operations = [UpdateOne(_held_by(ref), {"$max": {"lease_expires_at_ms": lease_expires_at_ms}}) for ref in refs]
        result = self._tasks.bulk_write(operations, ordered=False)
        if result.matched_count == len(refs) and result.modified_count == len(refs):
            return {r.task_id: lease_expires_at_ms for r in refs}
        # Some lease was already later than ours, or some ref was refused: read the leases back.
        # A claim token is set once and cleared once, so a task that still carries the token
        # now carried it at the update too: those were extended, the rest were refused.
        current = {
            d["_id"]: d
            for d in self._tasks.find(
                {"_id": {"$in": [r.task_id for r in refs]}}, {"claim_token": 1, "status": 1, "lease_expires_at_ms": 1}
            )
        }
        return {
            r.task_id: current[r.task_id]["lease_expires_at_ms"]
            for r in refs if _holds(current.get(r.task_id), r.claim_token)
        }

    def _settle(self, settlements: Sequence[Settlement]) -> set[str]:
        task_ids = sorted({s.task_id for s in settlements})
        now_ms = _epoch_ms(self._server_now())
        current = {
            d["_id"]: d
            for d in self._tasks.find(
                {"_id": {"$in": task_ids}},
                {"status": 1, "claim_token": 1, "claimed_at_ms": 1, "lease_expires_at_ms": 1,
                 "attempt_seq": 1, "pending_attempts": 1, "last_attempt": 1, "incarnation": 1, **_EVENT_FIELDS},
            )
        }

        def fenced_off(settlement: Settlement) -> bool:
            doc = current.get(settlement.task_id)
            return not _holds(doc, settlement.claim_token) or (
                settlement.outcome is Outcome.LEASE_EXPIRED and doc["lease_expires_at_ms"] > now_ms
            )

        # Rows the tasks committed earlier but had not seen in the attempts collection. Those
        # found there now can leave the task. Any other (a settle died before its insert) is
        # inserted now, before the commit, so the commit can drop it too; one the insert could
        # not record stays on the task. Only this recovery costs an extra round trip.
        carried = {task_id: _carried_rows(doc) for task_id, doc in current.items()}
        held = [s for s in settlements if not fenced_off(s)]
        carried_rows = [row for s in held for row in carried[s.task_id]]
        recorded = self._recorded(carried_rows)
        missing = [row for row in carried_rows if row["write_id"] not in recorded]
        if missing:
            recorded |= self._record_attempts_or_keep(missing)

        planned: list[tuple[Settlement, dict[str, Any], list[dict[str, Any]]]] = []
        operations: list[UpdateOne] = []
        events_write = uuid.uuid4().hex
        event_statuses = self.events.settled_statuses
        for settlement in held:
            doc = current[settlement.task_id]
            recorded_seq = doc.get("attempt_seq")
            unrecorded = [row for row in carried[settlement.task_id] if row["write_id"] not in recorded]
            # The next number after everything the task ever committed, never from attempt_count.
            attempt_no = max([recorded_seq or 0] + [row["attempt_no"] for row in carried[settlement.task_id]]) + 1
            attempt_row = {
                "task_id": settlement.task_id,
                "attempt_no": attempt_no,
                "outcome": settlement.outcome.value,
                "started_at_ms": _started_at_ms(doc.get("claimed_at_ms"), settlement, now_ms),
                "finished_at_ms": now_ms,
                "error": settlement.error.to_dict() if settlement.error else None,
                "claim_token": settlement.claim_token,
                "incarnation": doc.get("incarnation"),
                # Identifies this write, to tell who won if two settlers race on one claim.
                "write_id": uuid.uuid4().hex,
            }
            filter_ = _held_by(ClaimRef(settlement.task_id, settlement.claim_token))
            filter_["attempt_seq"] = recorded_seq  # compare-and-set: one winner per number
            if settlement.outcome is Outcome.LEASE_EXPIRED:
                filter_["lease_expires_at_ms"] = {"$lte": now_ms}
            update = _settle_update(settlement, attempt_row, unrecorded, now_ms)
            if settlement.status.value in event_statuses:
                # The event rides on the task document, written by this same update.
                error = settlement.error.to_dict() if settlement.error else doc.get("last_error")
                update["$set"].update(self._events_on_task(
                    doc, settlement.status.value.lower(), attempt_no, error, now_ms, events_write))
            operations.append(UpdateOne(filter_, update))
            planned.append((settlement, attempt_row, unrecorded))

        applied = planned
        if operations:
            matched = self._tasks.bulk_write(operations, ordered=False).matched_count
            if matched < len(operations):
                # Someone (a reaper) changed a task between our read and the write. Find out
                # which of our writes won.
                lost = self._lost_settlements([row for _, row, _ in planned])
                applied = [item for item in planned if item[1]["write_id"] not in lost]

        _crash_point("settle:committed")
        # The committed rows (and any older one still unrecorded). Whatever this insert does not
        # finish stays on the tasks for the next settle.
        rows: dict[str, dict[str, Any]] = {}
        for _, attempt_row, unrecorded in applied:
            for row in [*unrecorded, attempt_row]:
                rows[row["write_id"]] = row
        self._record_attempts_or_keep(list(rows.values()))
        if event_statuses:
            self._move_events([settlement.task_id for settlement, _, _ in applied
                               if settlement.status.value in event_statuses], events_write)
        return {settlement.task_id for settlement, _, _ in applied}

    # -- lifecycle events: on the task document first, then in the outbox collection ---------------
    def _events_on_task(self, doc: Mapping[str, Any], kind: str, attempt_no: int, error: Any, now_ms: int,
                        events_write: str) -> dict[str, Any]:
        """The ``$set`` fields that put one task event on the task document (after any its last
        write left there unmoved). ``events_write`` names the write, so only the mover of this
        write's events clears them; ``event_no`` orders one task's events within a millisecond."""
        event_no = int(doc.get("event_no") or 0) + 1
        number = doc.get("redrive_count", 0) + 1 if kind == "redriven" else attempt_no
        detail = {"handler": doc.get("handler"), "attempt": attempt_no,
                  "redrive_count": int(doc.get("redrive_count") or 0) + (1 if kind == "redriven" else 0),
                  "error": None if kind == "succeeded" else error,
                  "payload": json.loads(doc["payload_json"]) if self.events.include_payload and doc.get("payload_json") else None}
        # Named by the document's incarnation too, so a task id reused after a purge names new
        # events (created_at is only milliseconds here; a document older than the incarnation
        # field falls back to it).
        incarnation = doc.get("incarnation") or int(doc.get("created_at_ms") or 0) * 1000
        event_id = task_event_id(doc["_id"], kind, number, incarnation)
        event = {"_id": event_id, "type": f"rdq.task.{kind}", "queue": doc.get("queue"),
                 "task_id": doc["_id"], "at_ms": now_ms, "event_no": event_no, "detail_json": storable_json(detail),
                 "leased_until_ms": 0}
        return {"pending_events": [*(doc.get("pending_events") or []), event], "events_write": events_write,
                "event_no": event_no}

    def _move_events(self, task_ids: Sequence[str], events_write: str | None) -> None:
        """Copy the events waiting on these tasks into the outbox (an id already there is kept),
        then clear them from each task whose events are still the ones copied. A crash between
        the two steps copies them again on the next take: nothing is lost, nothing doubled."""
        if not task_ids:
            return
        query: dict[str, Any] = {"_id": {"$in": list(task_ids)}}
        query["events_write"] = events_write if events_write is not None else {"$exists": True}
        docs = list(self._tasks.find(query, {"pending_events": 1, "events_write": 1}))
        events = [event for d in docs for event in (d.get("pending_events") or [])]
        if events:
            try:
                self._outbox.insert_many(events, ordered=False)
            except BulkWriteError as exc:
                _duplicate_positions(exc)  # already moved: kept as it is
        _crash_point("events:moved")
        if docs:
            self._tasks.bulk_write([UpdateOne({"_id": d["_id"], "events_write": d["events_write"]},
                                              {"$unset": {"pending_events": "", "events_write": ""}}) for d in docs],
                                   ordered=False)

    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        now_ms = _epoch_ms(self._server_now())
        docs = [{"_id": e["id"], "type": e["type"], "queue": e["queue"], "task_id": e["task_id"], "at_ms": now_ms,
                 "event_no": 0, "detail_json": e["detail"], "leased_until_ms": 0} for e in events]
        try:
            self._outbox.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            _duplicate_positions(exc)

    def _outbox_take(self, limit: int, lease_seconds: float) -> list[dict[str, Any]]:
        # Events a crashed settle or redrive left on their tasks first (an index probe when none).
        stranded = [d["_id"] for d in self._tasks.find({"events_write": {"$exists": True}}, {"_id": 1}, limit=200)]
        self._move_events(stranded, None)
        now_ms = _epoch_ms(self._server_now())
        order = [("at_ms", ASCENDING), ("event_no", ASCENDING), ("_id", ASCENDING)]
        ids = [d["_id"] for d in self._outbox.find({"leased_until_ms": {"$lte": now_ms}}, {"_id": 1}, sort=order,
                                                    limit=limit, batch_size=limit)]
        if not ids:
            return []
        # Leased under a fresh token, each only if no one leased it meanwhile; what carries the
        # token is what this call took.
        lease = uuid.uuid4().hex
        self._outbox.update_many({"_id": {"$in": ids}, "leased_until_ms": {"$lte": now_ms}},
                                 {"$set": {"leased_until_ms": now_ms + _duration_ms(lease_seconds), "lease": lease}})
        taken = self._outbox.find({"_id": {"$in": ids}, "lease": lease}, sort=order)
        return [{"id": d["_id"], "type": d["type"], "queue": d["queue"], "task_id": d.get("task_id"),
                 "at": d["at_ms"], "detail": d["detail_json"]} for d in taken]

    def _outbox_ack(self, ids: Sequence[str]) -> int:
        return int(self._outbox.delete_many({"_id": {"$in": list(ids)}}).deleted_count)

    def _release(self, refs: Sequence[ClaimRef]) -> set[str]:
        now_ms = _epoch_ms(self._server_now())
        # One id per item write: a read-back can then tell this release from an earlier
        # release of the same (now spent) token.
        write_ids = [uuid.uuid4().hex for _ in refs]
        operations = [
            UpdateOne(
                _held_by(ref),
                {
                    "$set": {
                        "status": TaskStatus.PENDING.value,
                        "updated_at_ms": now_ms,
                        "release_write_id": write_id,
                        # A rate slot this claim took is free again: it never started.
                        "released_claim": ref.claim_token,
                    },
                    "$unset": _CLAIM_FIELDS,
                },
            )
            for ref, write_id in zip(refs, write_ids, strict=True)
        ]
        matched = self._tasks.bulk_write(operations, ordered=False).matched_count
        if matched == len(refs):
            return {r.task_id for r in refs}
        released = {
            d.get("release_write_id")
            for d in self._tasks.find({"_id": {"$in": [r.task_id for r in refs]}}, {"release_write_id": 1})
        }
        return {r.task_id for r, write_id in zip(refs, write_ids, strict=True) if write_id in released}

    def _expired(self, limit: int, queue: str | None) -> list[Mapping[str, Any]]:
        now_ms = _epoch_ms(self._server_now())
        query: dict[str, Any] = {"status": TaskStatus.IN_FLIGHT.value, "lease_expires_at_ms": {"$lte": now_ms}}
        if queue is not None:
            query["queue"] = queue
        return list(
            self._tasks.find(query, sort=[("lease_expires_at_ms", ASCENDING), ("task_id", ASCENDING)],
                             limit=limit, batch_size=limit)
        )

    def _load(self, task_id: str) -> Mapping[str, Any] | None:
        doc = self._tasks.find_one({"_id": task_id})
        return None if doc is None else self._with_histories([doc])[0]

    def _cancel(self, task_id: str) -> tuple[Mapping[str, Any] | None, bool]:
        now_ms = _epoch_ms(self._server_now())
        doc = self._tasks.find_one_and_update(
            {"_id": task_id, "status": TaskStatus.PENDING.value},
            {"$set": {"status": TaskStatus.CANCELLED.value, "updated_at_ms": now_ms}},
            return_document=ReturnDocument.AFTER,
        )
        if doc is None:
            return self._tasks.find_one({"_id": task_id}), False
        return self._with_histories([doc])[0], True

    def _page(self, selection: Selection, limit: int, history: bool) -> Sequence[Mapping[str, Any]]:
        order = _ORDER_KEY[selection.status]
        query = _selection_query(selection)
        if selection.after is not None:
            query.update(_keyset_after(order, "task_id", selection.after))
        # The filter's equality on queue and status plus the sort walk the status's keyset index
        # (see the migrations) from the cursor on: the work follows the page size (plus what an
        # error-type or handler filter skips).
        docs = list(self._tasks.find(query, None if history else _WITHOUT_HISTORY,
                                     sort=[(order, ASCENDING), ("task_id", ASCENDING)],
                                     limit=limit, batch_size=limit))
        return self._with_histories(docs) if history else docs

    def _count(self, selection: Selection) -> int:
        return self._tasks.count_documents(_selection_query(selection))

    def _cancel_selected(self, selection: Selection) -> int:
        # One update_many: every document is matched and changed atomically on its own, its
        # filter (status PENDING) re-checked as it is written, so a task claimed meanwhile is
        # never cancelled. MongoDB has no atomic multi-document update without a transaction:
        # the selection is not cancelled as one step (a reader may see part of it cancelled, and
        # a task that becomes PENDING while the update runs may or may not be included).
        now_ms = _epoch_ms(self._server_now())
        query = {**_selection_query(selection), "status": TaskStatus.PENDING.value}
        result = self._tasks.update_many(
            query, {"$set": {"status": TaskStatus.CANCELLED.value, "updated_at_ms": now_ms}})
        return result.modified_count

    def _redrive(self, selection: DeadSelection) -> int:
        query = _selection_query(selection)
        now_ms = _epoch_ms(self._server_now())
        if self.events.redriven:
            return self._redrive_with_events(query, now_ms)
        result = self._tasks.update_many(
            query,
            {
                "$set": {
                    "status": TaskStatus.PENDING.value,
                    "attempt_count": 0,
                    "next_attempt_at_ms": now_ms,
                    "updated_at_ms": now_ms,
                },
                "$inc": {"redrive_count": 1},
                "$unset": {"dead_at_ms": ""},
            },
        )
        return result.modified_count

    def _redrive_with_events(self, query: Mapping[str, Any], now_ms: int) -> int:
        """Redrive with one rdq.task.redriven event per task on its document: each task is read
        and then written under a compare-and-set on its redrive count (an event names the count),
        in chunks; then the chunk's events are moved to the outbox."""
        redriven = 0
        while True:
            docs = list(self._tasks.find(query, {"_id": 1, "redrive_count": 1, "attempt_seq": 1, **_EVENT_FIELDS},
                                         limit=PURGE_CHUNK, batch_size=PURGE_CHUNK))
            if not docs:
                return redriven
            events_write = uuid.uuid4().hex
            operations = []
            for doc in docs:
                fields = self._events_on_task(doc, "redriven", int(doc.get("attempt_seq") or 0), doc.get("last_error"),
                                              now_ms, events_write)
                operations.append(UpdateOne(
                    {"_id": doc["_id"], "status": TaskStatus.DEAD.value, "redrive_count": doc.get("redrive_count", 0)},
                    {"$set": {"status": TaskStatus.PENDING.value, "attempt_count": 0, "next_attempt_at_ms": now_ms,
                              "updated_at_ms": now_ms, **fields},
                     "$inc": {"redrive_count": 1}, "$unset": {"dead_at_ms": ""}}))
            redriven += self._tasks.bulk_write(operations, ordered=False).modified_count
            _crash_point("redrive:committed")
            self._move_events([d["_id"] for d in docs], events_write)
            if len(docs) < PURGE_CHUNK:
                return redriven

    def _purge_dead(self, selection: DeadSelection) -> int:
        query = _selection_query(selection)
        purged = 0
        while True:
            docs = list(self._tasks.find(query, {"_id": 1, "incarnation": 1}, limit=PURGE_CHUNK, batch_size=PURGE_CHUNK))
            if not docs:
                return purged
            purged += self._purge(docs, {"status": TaskStatus.DEAD.value}, "purge_dead")
            if len(docs) < PURGE_CHUNK:
                return purged

    def _stats(self, queue: str, statuses: Sequence[TaskStatus] = tuple(TaskStatus)) -> QueueCounts:
        now_ms = _epoch_ms(self._server_now())
        # Each count is a range of the (queue, status) index: only the statuses asked for are read.
        counts = {
            status.value: self._tasks.count_documents({"queue": queue, "status": status.value})
            for status in statuses
        }
        oldest_due = self._tasks.find_one(
            {"queue": queue, "status": TaskStatus.PENDING.value, "next_attempt_at_ms": {"$lte": now_ms}},
            {"next_attempt_at_ms": 1},
            sort=[("next_attempt_at_ms", ASCENDING), ("task_id", ASCENDING)],
        )
        oldest_age = None if oldest_due is None else (now_ms - oldest_due["next_attempt_at_ms"]) / 1000
        return QueueCounts(counts, oldest_age)

    def _live_stats(self, queue: str) -> QueueCounts:
        return self._stats(queue, LIVE_STATUSES)

    def _queues(self) -> list[str]:
        return [q for q in self._tasks.distinct("queue") if isinstance(q, str)]

    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        cutoff_ms = _epoch_ms(self._server_now()) - _duration_ms(older_than_seconds)
        finished = {"status": {"$in": _RETAINED_STATUSES}, "updated_at_ms": {"$lt": cutoff_ms}}
        docs = list(self._tasks.find(finished, {"_id": 1, "incarnation": 1}, limit=limit, batch_size=limit))
        if not docs:
            return 0
        return self._purge(docs, {"status": {"$in": _RETAINED_STATUSES}}, "purge_succeeded")

    def _set_paused(self, queue: str, paused: bool) -> None:
        # One document per queue ever flagged; resuming keeps it with paused false.
        self._queue_flags.update_one({"_id": queue}, {"$set": {"paused": paused}}, upsert=True)

    def _paused(self) -> list[str]:
        return [d["_id"] for d in self._queue_flags.find({"paused": True}, {"_id": 1}) if isinstance(d["_id"], str)]

    def _audit_append(self, entry: Mapping[str, Any]) -> int:
        # An insert cannot stamp the server's clock itself without an update pipeline (which
        # nx-27017 rejects), so the time is read with hello first, as every other write does.
        at_ms = _epoch_ms(self._server_now())
        self._audit.insert_one({
            "_id": entry["id"],
            "entry_id": entry["id"],  # a copy of _id for the compound indexes (see _new_task_doc)
            "at_ms": at_ms,
            "actor": entry["actor"],
            "action": entry["action"],
            "queue": entry["queue"],
            "selection": entry["selection"],
            "count": int(entry["count"]),
        })
        return at_ms

    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> list[Mapping[str, Any]]:
        query: dict[str, Any] = {} if queue is None else {"queue": queue}
        if before is not None:
            query.update(_keyset_before("at_ms", "entry_id", before))
        docs = self._audit.find(query, sort=[("at_ms", DESCENDING), ("entry_id", DESCENDING)],
                                limit=limit, batch_size=limit)
        return [{"id": d["_id"], "at": d["at_ms"], "actor": d["actor"], "action": d["action"], "queue": d["queue"],
                 "selection": d["selection"], "count": d["count"]} for d in docs]

    # -- engine documents: each call is one single-document command, atomic on its own --------
    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        doc = self._documents.find_one({"_id": _document_id(kind, key)}, {"version": 1, "body": 1})
        return None if doc is None else (int(doc["version"]), str(doc["body"]))

    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        if expected is None:
            # Insert if absent: the unique _id (and the unique (kind, key) index) refuses a second.
            try:
                self._documents.insert_one(
                    {"_id": _document_id(kind, key), "kind": kind, "key": key, "version": 1, "body": body})
            except DuplicateKeyError:
                return None
            return 1
        # Replace at a version: the filter is re-checked as the document is written, so of two
        # writers at the same version exactly one matches.
        result = self._documents.update_one(
            {"_id": _document_id(kind, key), "version": expected},
            {"$set": {"version": expected + 1, "body": body}},
        )
        return expected + 1 if result.matched_count == 1 else None

    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        return self._documents.delete_one({"_id": _document_id(kind, key), "version": expected}).deleted_count == 1

    def _doc_page(self, kind: str, after: str | None, limit: int) -> Sequence[tuple[str, int, str]]:
        # Strings compare by their UTF-8 bytes (no collation), walking rdq_document_key.
        docs = self._documents.find({"kind": kind, "key": {"$gt": after or ""}}, {"key": 1, "version": 1, "body": 1},
                                    sort=[("key", ASCENDING)], limit=limit, batch_size=limit)
        return [(str(d["key"]), int(d["version"]), str(d["body"])) for d in docs]

    # -- history and purges ----------------------------------------------------------------
    def _purge(self, docs: Sequence[Mapping[str, Any]], still: dict[str, Any], name: str) -> int:
        """Delete the tasks ``docs`` (those still matching ``still``), then the attempt rows of
        the ones really gone.

        Tasks go first: a task that is still visible always has its whole history. A purge that
        dies in between leaves orphan rows; they carry the purged task's incarnation, so a new
        task with the same id never shows them and a settle replaces one that blocks its number
        (see ``_record_attempts``). Rows are deleted by (id, incarnation) for the same reason: a
        task re-enqueued under the same id meanwhile keeps its own history.
        """
        ids = [d["_id"] for d in docs]
        incarnations = sorted({d.get("incarnation") for d in docs}, key=lambda v: (v is not None, v or ""))
        selection = {"_id": {"$in": ids}, "incarnation": {"$in": incarnations}, **still}
        deleted = self._tasks.delete_many(selection).deleted_count
        _crash_point(f"{name}:tasks_deleted")
        gone = set(ids)
        if deleted < len(ids):  # one was redriven (or re-enqueued) meanwhile: it keeps its rows
            gone -= {d["_id"] for d in self._tasks.find({"_id": {"$in": ids}, "incarnation": {"$in": incarnations}}, {"_id": 1})}
        if gone:
            self._attempts.delete_many({"task_id": {"$in": sorted(gone)}, "incarnation": {"$in": incarnations}})
        return deleted

    def _with_histories(self, docs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``docs`` as records carrying their ``attempts``: the attempts collection merged with
        the rows each task still carries, in at most one find. Tasks whose every attempt is on
        the task (never had one, or only unrecorded ones) cost no query."""
        with_history = [d for d in docs if d.get("attempt_seq") or _carried_rows(d)]
        to_read = [d for d in with_history
                   if set(range(1, (d.get("attempt_seq") or 0) + 1)) - {r["attempt_no"] for r in _carried_rows(d)}]
        rows_by_task: dict[str, list[dict[str, Any]]] = {}
        if to_read:
            for row in self._attempts.find(
                {"task_id": {"$in": [d["_id"] for d in to_read]}},
                sort=[("task_id", ASCENDING), ("attempt_no", ASCENDING)],
                batch_size=1000,
            ):
                rows_by_task.setdefault(row["task_id"], []).append(row)
        return [{**d, "attempts": _merged_history(d, rows_by_task.get(d["_id"], []))} for d in docs]

    def _recorded(self, rows: Sequence[Mapping[str, Any]]) -> set[str]:
        """write_ids of ``rows`` that are in the attempts collection (one find, by the unique
        index; none when there is nothing to look for)."""
        if not rows:
            return set()
        found = self._attempts.find(
            {"task_id": {"$in": sorted({r["task_id"] for r in rows})},
             "attempt_no": {"$in": sorted({r["attempt_no"] for r in rows})}},
            {"task_id": 1, "attempt_no": 1, "write_id": 1},
        )
        present = {(f["task_id"], f["attempt_no"], f.get("write_id")) for f in found}
        return {r["write_id"] for r in rows if (r["task_id"], r["attempt_no"], r["write_id"]) in present}

    def _lost_settlements(self, rows: list[dict[str, Any]]) -> set[str]:
        """write_ids among ``rows`` whose fenced task update did not win.

        A row that won is on its task (pending) until a later settle saw it recorded, so: on
        the task, or in the attempts collection. The task is read first: a row that leaves it
        is already in the collection by then.
        """
        task_ids = sorted({row["task_id"] for row in rows})
        docs = {
            d["_id"]: d
            for d in self._tasks.find(
                {"_id": {"$in": task_ids}}, {"attempt_seq": 1, "pending_attempts": 1, "last_attempt": 1}
            )
        }
        lost: set[str] = set()
        to_check: list[dict[str, Any]] = []
        for row in rows:
            doc = docs.get(row["task_id"])
            if doc is not None and row["write_id"] in {r["write_id"] for r in _carried_rows(doc)}:
                continue
            if doc is None or (doc.get("attempt_seq") or 0) < row["attempt_no"]:
                lost.add(row["write_id"])  # never committed (or the task is gone)
            else:
                to_check.append(row)
        if to_check:
            recorded = self._recorded(to_check)
            lost.update(row["write_id"] for row in to_check if row["write_id"] not in recorded)
        return lost

    def _record_attempts_or_keep(self, rows: list[dict[str, Any]]) -> set[str]:
        """``_record_attempts``, but a failure is not the settle's failure: the rows are safe on
        their tasks (committed, or about to be carried by the commit) and a later settle
        records them. Raising here would report a committed settle as failed."""
        try:
            return self._record_attempts(rows)
        except PyMongoError as exc:
            log.warning("could not record %d attempt row(s) yet; kept on their tasks: %s", len(rows), exc)
            return set()

    def _record_attempts(self, rows: list[dict[str, Any]]) -> set[str]:
        """Insert committed rows; returns the write_ids now known to be recorded. A row already
        there (recorded by an earlier settle) is fine.

        A duplicate that is *another* row holding the number can only be an orphan of an earlier
        task with this id (another incarnation, left by a purge that died half way): it is
        deleted and ours inserted. Anything else stays on the task for a later settle.
        """
        if not rows:
            return set()
        try:
            self._attempts.insert_many([dict(row) for row in rows], ordered=False)
            return {row["write_id"] for row in rows}
        except BulkWriteError as exc:
            clashing = [rows[position] for position in sorted(_duplicate_positions(exc))]
        done = {row["write_id"] for row in rows} - {row["write_id"] for row in clashing}
        mine = {(r["task_id"], r["attempt_no"]): r for r in clashing}
        existing = self._attempts.find(
            {"task_id": {"$in": sorted({r["task_id"] for r in clashing})},
             "attempt_no": {"$in": sorted({r["attempt_no"] for r in clashing})}},
            {"task_id": 1, "attempt_no": 1, "write_id": 1, "incarnation": 1},
        )
        orphans: list[Any] = []
        replace: list[dict[str, Any]] = []
        for found in existing:
            row = mine.get((found["task_id"], found["attempt_no"]))
            if row is None:
                continue
            if found.get("write_id") == row["write_id"]:
                done.add(row["write_id"])
            elif found.get("incarnation") != row.get("incarnation"):
                orphans.append(found["_id"])
                replace.append(row)
            else:
                log.warning("attempt %s of task %s is recorded by another write; kept on the task",
                            row["attempt_no"], row["task_id"])
        if orphans:
            self._attempts.delete_many({"_id": {"$in": orphans}})
            try:
                self._attempts.insert_many([dict(row) for row in replace], ordered=False)
                done.update(row["write_id"] for row in replace)
            except BulkWriteError as exc:
                _duplicate_positions(exc)  # a concurrent settle recorded it first: checked next time
        return done


#: The stored key each status's tasks are listed by (the core's ORDER_FIELD, in this store's names).
_ORDER_KEY = {status: MongoStorage.codec.keys.get(field, field) for status, field in ORDER_FIELD.items()}


# -- documents ---------------------------------------------------------------------------------

def _new_task_doc(new: NewTask, now_ms: int) -> dict[str, Any]:
    if new.run_at is not None:  # the one instant a client may set with its own clock
        next_attempt_ms = _epoch_ms(new.run_at)
    else:
        next_attempt_ms = now_ms + _duration_ms(new.delay_seconds or 0.0)
    return {
        "_id": new.id,
        # A copy of _id for compound indexes and sorts: nx-27017 cannot index _id inside a
        # compound key (inserts then fail with "JSON path error near '_id'").
        "task_id": new.id,
        "queue": new.queue,
        "handler": new.handler,
        # JSON text, not BSON sub-documents: arbitrary keys ("$where", "a.b") survive untouched
        # and can never be read as query or update operators.
        "payload_json": storable_json(new.payload),
        "headers_json": storable_json(dict(new.headers or {})),
        "status": TaskStatus.PENDING.value,
        "attempt_count": 0,
        "redrive_count": 0,
        "attempt_seq": 0,
        # Random per task document: attempt rows carry it, so rows an interrupted purge left
        # behind never count as the history of a later task with the same id.
        "incarnation": uuid.uuid4().hex,
        "max_attempts": new.max_attempts,
        # Flow control: always present, so the claim's sort and the fair claim's groups see every
        # task ('' = no group: the server's distinct leaves nulls out).
        "priority": int(new.priority or 0),
        "concurrency_key": new.concurrency_key,
        "rate_key": new.rate_key,
        "group": new.group or "",
        "dedupe_key": new.dedupe_key,
        "backoff": new.backoff.to_dict() if new.backoff else None,
        "next_attempt_at_ms": next_attempt_ms,
        "created_at_ms": now_ms,
        "updated_at_ms": now_ms,
    }


def _dedupe_change(task: NewTask, match: Mapping[str, Any], now_ms: int) -> dict[str, Any]:
    """The fields a dedupe mode sets on a PENDING match (none for skip)."""
    if task.dedupe_mode is DedupeMode.REPLACE:
        return {"payload_json": storable_json(task.payload), "headers_json": storable_json(dict(task.headers or {})),
                "updated_at_ms": now_ms}
    if task.dedupe_mode is DedupeMode.DEBOUNCE:
        due = _new_task_doc(task, now_ms)["next_attempt_at_ms"]
        if task.dedupe_max_wait_seconds is not None:
            due = min(due, int(match["created_at_ms"]) + _duration_ms(task.dedupe_max_wait_seconds))
        return {"next_attempt_at_ms": due, "updated_at_ms": now_ms}
    return {}


def _document_id(kind: str, key: str) -> str:
    """An engine document's _id: kind and key cannot contain a space, so the join is unambiguous
    (nx-27017 cannot index _id inside a compound key, hence one string rather than a sub-document)."""
    return f"{kind} {key}"


def _settle_update(
    settlement: Settlement, attempt_row: dict[str, Any], unrecorded: list[dict[str, Any]], now_ms: int,
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "status": settlement.status.value,
        "attempt_seq": attempt_row["attempt_no"],
        # The whole list is set (not $push): nx-27017 stores $push-ed sub-documents as strings.
        # The compare-and-set on attempt_seq makes the read-modify-write safe.
        "pending_attempts": [*unrecorded, attempt_row],
        "updated_at_ms": now_ms,
    }
    if settlement.status is TaskStatus.PENDING:
        fields["next_attempt_at_ms"] = now_ms + _duration_ms(settlement.retry_delay_seconds)
    elif settlement.status is TaskStatus.DEAD:
        fields["dead_at_ms"] = now_ms
    if settlement.status is TaskStatus.SUCCEEDED:
        fields["result_json"] = storable_json(settlement.result)
    if settlement.error is not None:
        fields["last_error"] = settlement.error.to_dict()
    return {
        "$set": fields,
        "$inc": {"attempt_count": 0 if settlement.outcome is Outcome.SNOOZED else 1},  # a snooze spends no budget
        # last_attempt: the single recovery copy of schema 1 documents, now in pending_attempts.
        "$unset": {**_CLAIM_FIELDS, "last_attempt": ""},
    }


def _started_at_ms(claimed_at_ms: int | None, settlement: Settlement, now_ms: int) -> int | None:
    """The attempt's start: the claim's time plus how long after it the handler started."""
    if claimed_at_ms is None or settlement.started_after_seconds is None:
        return claimed_at_ms
    return min(claimed_at_ms + round(settlement.started_after_seconds * 1000), now_ms)


def _held_by(ref: ClaimRef) -> dict[str, Any]:
    """The fencing filter: the task is IN_FLIGHT under exactly this claim token."""
    return {"_id": ref.task_id, "status": TaskStatus.IN_FLIGHT.value, "claim_token": ref.claim_token}


def _holds(doc: Mapping[str, Any] | None, claim_token: str) -> TypeGuard[Mapping[str, Any]]:
    return (
        doc is not None
        and doc.get("status") == TaskStatus.IN_FLIGHT.value
        and doc.get("claim_token") == claim_token
    )


def _selection_query(selection: Selection) -> dict[str, Any]:
    query: dict[str, Any] = {"queue": selection.queue, "status": selection.status.value}
    if selection.ids is not None:
        query["_id"] = {"$in": list(selection.ids)}
    if selection.error_type is not None:
        query["last_error.type"] = selection.error_type
    if selection.handler is not None:
        query["handler"] = selection.handler
    return query


def _keyset_after(order: str, tie: str, after: tuple[int, str]) -> dict[str, Any]:
    """The filter for positions strictly after ``after`` = (epoch micros, id) in the order
    ``(order, tie)`` ascending, where ``order`` holds epoch milliseconds. The range on ``order``
    bounds the index scan; the ``$or`` only skips the ties at its start."""
    micros, after_id = after
    if micros % 1000:  # between two milliseconds: no stored instant ties with it
        return {order: {"$gt": micros // 1000}}
    ms = micros // 1000
    return {order: {"$gte": ms}, "$or": [{order: {"$gt": ms}}, {tie: {"$gt": after_id}}]}


def _keyset_before(order: str, tie: str, before: tuple[int, str]) -> dict[str, Any]:
    """The filter for positions strictly before ``before`` = (epoch micros, id) (see
    ``_keyset_after``)."""
    micros, before_id = before
    if micros % 1000:
        return {order: {"$lte": micros // 1000}}
    ms = micros // 1000
    return {order: {"$lte": ms}, "$or": [{order: {"$lt": ms}}, {tie: {"$lt": before_id}}]}


def _carried_rows(doc: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The attempt rows a task document carries: committed, not yet seen recorded. Includes a
    schema 1 ``last_attempt`` (which lacks the incarnation of a task created since)."""
    if not doc:
        return []
    rows = [dict(row) for row in doc.get("pending_attempts") or ()]
    last = doc.get("last_attempt")
    if last and last.get("write_id") not in {row.get("write_id") for row in rows}:
        rows.insert(0, {**last, "incarnation": doc.get("incarnation")})
    return rows


def _merged_history(doc: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The task's rows from the attempts collection -- only its own incarnation's, never an
    earlier task's with the same id -- plus the rows the task still carries."""
    incarnation = doc.get("incarnation")
    by_number = {row["attempt_no"]: row for row in rows if row.get("incarnation") == incarnation}
    for row in _carried_rows(doc):
        by_number[row["attempt_no"]] = row
    return list(by_number.values())


def _duplicate_positions(exc: BulkWriteError) -> set[int]:
    """Positions that failed only as duplicate keys; anything else is re-raised."""
    errors = exc.details.get("writeErrors", [])
    if exc.details.get("writeConcernErrors") or any(e.get("code") != DUPLICATE_KEY for e in errors):
        raise exc
    return {e["index"] for e in errors}


# Instants are stored as int64 epoch milliseconds rather than BSON dates: nx-27017 turns a
# datetime written by $set into a string (range queries then miss it). Milliseconds is also
# the resolution of the server clock and of BSON dates, so nothing is lost.

def _epoch_ms(value: datetime) -> int:
    return to_micros(value) // 1000


def _duration_ms(seconds: float) -> int:
    return max(0, round(float(seconds) * 1000))
