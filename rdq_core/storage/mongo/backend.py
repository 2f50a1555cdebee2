"""MongoDB primitives for the storage core (pymongo 4.x). The layout, the clock and the crash-safe
settlement are described in the package doc and in docs/mongo-backend.md."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from ...errors import StorageUnavailable, TaskConflict
from ...flow import FlowPolicy
from ...model import ClaimRef, NewTask, Outcome, Settlement, TaskStatus
from ..core import InsertedRecord, dedupe_states_of
from ..spi import storable_json
from .flow_claim import FlowClaim
from .operator import MongoOperator
from .selections import MongoSelections
from .shapes import (_EVENT_FIELDS, _carried_rows, _dedupe_change, _duplicate_positions, _duration_ms, _epoch_ms,
                     _held_by, _holds, _new_task_doc)

#: How long an enqueue may hold a dedupe key's lock document before another may take it over.
DEDUPE_LOCK_MS = 5_000

_CLAIM_FIELDS = {"claim_token": "", "claimed_at_ms": "", "claimed_by": "", "lease_expires_at_ms": ""}

# Tests set this to simulate a process dying between two writes: it is called with the name of
# each crash point (e.g. "settle:committed") and may raise. Never set in production.
_crash_hook: Callable[[str], None] | None = None


def _crash_point(name: str) -> None:
    if _crash_hook is not None:
        _crash_hook(name)


class MongoStorage(MongoSelections, MongoOperator):
    """The MongoDB store: the task lifecycle here (enqueue, claim, extend, settle, release, the
    expired-lease scan, get, cancel), every other resource in its own part (``connection.py``,
    ``history.py``, ``outbox.py``, ``selections.py``, ``operator.py``)."""

    def _at_crash_point(self, name: str) -> None:
        _crash_point(name)

    # -- the task lifecycle's primitives ----------------------------------------------------
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

    def _claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy,
               worker: str) -> list[Mapping[str, Any]]:
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
            return self._claim_in_order(queue, limit, now_ms, _duration_ms(lease_seconds), worker)
        claim = FlowClaim(self._tasks, self._flow_slots, queue, limit, now_ms, _duration_ms(lease_seconds), flow,
                          None if flags is None else flags.get("fair_last"), worker)
        try:
            claimed = claim.run()
        except BaseException:
            self._hand_back_on_error(claim.claimed)
            raise
        if claim.served_group is not None:
            self._queue_flags.update_one({"_id": queue}, {"$set": {"fair_last": claim.served_group}}, upsert=True)
        return claimed

    def _claim_in_order(self, queue: str, limit: int, now_ms: int, lease_ms: int,
                        worker: str) -> list[Mapping[str, Any]]:
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
                            "claimed_by": worker,  # '' when the claimer gave no name
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


    # -- engine documents: each call is one single-document command, atomic on its own --------


    # -- history and purges ----------------------------------------------------------------


# -- documents ---------------------------------------------------------------------------------


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


# Instants are stored as int64 epoch milliseconds rather than BSON dates: nx-27017 turns a
# datetime written by $set into a string (range queries then miss it). Milliseconds is also
# the resolution of the server clock and of BSON dates, so nothing is lost.


