"""The MongoDB claim under a flow policy with limits or fairness (docs/flow-control.md).

MongoDB changes one document atomically and the test server has no multi-document transactions,
so every limit is a set of **slot documents** in the ``flow_slots`` collection, each taken by a
single-document compare-and-set:

* a concurrency key with limit N has slots ``"<queue> c <key> 0".."N-1"``; the queue's
  ``max_in_flight`` M has ``"<queue> m 0".."M-1"``. A slot names its holder (claim token and
  task id) and is free when that task no longer holds that claim -- settled, released, or
  reaped (a killed holder keeps its slot until the reaper settles its expired lease). Settles,
  releases and extensions never touch slots: a holder's claim is read from its task.
* a rate key with limit R per P has slots ``"<queue> r <key> 0".."R-1"``, each holding the time
  of the claim that last used it; a slot is free once that time is P or more in the past. Two
  claims on one slot are at least P apart, so any window of length P holds at most R claims.

A task is claimed first (``findAndModify``, as the plain claim), then its slots are taken; a
task whose slot cannot be taken is handed back to PENDING in one update, no attempt spent. An
over-limit task is therefore never run. Its key is then left out of the rest of the claim's
reads, so a hot key costs one hand-back per claim, not one per task behind it.

Progress (docs/flow-control.md#progress): before its first read the claim counts the queue's
IN_FLIGHT tasks per concurrency key (one aggregation over the in-flight tasks, which workers x
batch bound) and leaves the keys already at their limit out of every read, so busy keys at the
head cost nothing per task; and it reads on until it has its batch or no candidate is left, so
a claim that comes back short has left no due task every limit allows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from pymongo import ASCENDING, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError

from ...flow import Candidate, FlowPolicy, rank
from ...model import TaskStatus

#: Candidates read per query beyond the claim's limit (tasks another claimer takes first, or
#: over a limit, are passed over).
CANDIDATE_MARGIN = 16
_CANDIDATE_FIELDS = {"_id": 1, "priority": 1, "next_attempt_at_ms": 1, "concurrency_key": 1, "rate_key": 1, "group": 1}
_CLAIM_FIELDS = {"claim_token": "", "claimed_at_ms": "", "claimed_by": "", "lease_expires_at_ms": ""}


@dataclass
class FlowClaim:
    """One claim call of one queue under ``flow``: build, then ``run()``."""

    tasks: Collection[dict[str, Any]]
    slots: Collection[dict[str, Any]]
    queue: str
    limit: int
    now_ms: int
    lease_ms: int
    flow: FlowPolicy
    fair_last: str | None
    #: The claimer's name, stored as each task's ``claimed_by`` ('' = none).
    worker: str = ""
    claimed: list[Mapping[str, Any]] = field(default_factory=list)
    served_group: str | None = None
    _tried: set[str] = field(default_factory=set)
    _full_keys: set[str] = field(default_factory=set)
    _spent_rates: set[str] = field(default_factory=set)
    _stopped: bool = False

    def run(self) -> list[Mapping[str, Any]]:
        if self.flow.limits_concurrency:
            self._full_keys |= self._keys_at_limit()
        if not self.flow.fair_groups:
            self._take_from(self._candidates(None), self.limit)
            return self.claimed
        # Round robin over the groups with due tasks ('' = no group), byte order, starting after
        # the group the previous claim served last; one task per group per turn.
        # '' always takes a turn: it also reads tasks stored before groups existed (no field).
        groups = sorted({g for g in self.tasks.distinct("group", self._due()) if isinstance(g, str)} | {""})
        turn = [g for g in groups if self.fair_last is None or g > self.fair_last]
        turn += [g for g in groups if g not in turn]
        sources = {g: self._candidates(g) for g in turn}
        while turn and len(self.claimed) < self.limit and not self._stopped:
            still = []
            for group in turn:
                if len(self.claimed) >= self.limit:
                    break
                if self._take_from(sources[group], 1):
                    still.append(group)
                    self.served_group = group
            turn = still
        return self.claimed

    def _keys_at_limit(self) -> set[str]:
        """Concurrency keys with as many IN_FLIGHT tasks as their limit (a task of a killed holder
        counts until the reaper settles it, as its slot does). Read without a lock: a key that
        frees up meanwhile waits for the next claim; one that fills is still caught by its slot."""
        running = self.tasks.aggregate([
            {"$match": {"queue": self.queue, "status": TaskStatus.IN_FLIGHT.value, "concurrency_key": {"$type": "string"}}},
            {"$group": {"_id": "$concurrency_key", "n": {"$sum": 1}}},
        ])
        return {row["_id"] for row in running
                if (limit := self.flow.limit_for(row["_id"])) is not None and row["n"] >= limit}

    # -- candidates, in claim order --------------------------------------------------------
    def _due(self) -> dict[str, Any]:
        return {"queue": self.queue, "status": TaskStatus.PENDING.value, "next_attempt_at_ms": {"$lte": self.now_ms}}

    def _candidates(self, group: str | None) -> Iterator[Mapping[str, Any]]:
        """Due tasks (of ``group`` when given) in claim order, re-read until none is left,
        leaving out what this claim tried and the keys it found full (each read after the first
        follows a hand-back, which adds a key, or a read that was all taken)."""
        while True:
            query = self._due()
            if group is not None:
                query["group"] = group if group else {"$in": ["", None]}
            if self._tried:
                query["_id"] = {"$nin": sorted(self._tried)}
            if self._full_keys:
                query["concurrency_key"] = {"$nin": sorted(self._full_keys)}
            if self._spent_rates:
                query["rate_key"] = {"$nin": sorted(self._spent_rates)}
            batch = self.limit + CANDIDATE_MARGIN
            found = self._ordered(query, batch)
            if not found:
                return
            for candidate in found:
                yield candidate
            if len(found) < batch:
                return

    def _ordered(self, query: dict[str, Any], batch: int) -> list[Mapping[str, Any]]:
        if self.flow.priority_aging_seconds is None:
            return list(self.tasks.find(query, _CANDIDATE_FIELDS, limit=batch, batch_size=batch,
                                        sort=[("priority", ASCENDING), ("next_attempt_at_ms", ASCENDING),
                                              ("task_id", ASCENDING)]))
        # Aged order (next_attempt_at + priority x aging) is not an index order: the first
        # `batch` of each priority present hold the first `batch` of the aged order.
        # Priority 0 also reads tasks stored before schema 5 (no field; the server's distinct
        # leaves them out).
        merged: list[Mapping[str, Any]] = []
        for priority in sorted({p for p in self.tasks.distinct("priority", query) if isinstance(p, int)} | {0}):
            matching = priority if priority else {"$in": [0, None]}
            merged += self.tasks.find({**query, "priority": matching}, _CANDIDATE_FIELDS, limit=batch,
                                      batch_size=batch, sort=[("next_attempt_at_ms", ASCENDING), ("task_id", ASCENDING)])
        merged.sort(key=lambda d: rank(self.flow, Candidate(d["_id"], int(d.get("priority") or 0),
                                                            d["next_attempt_at_ms"] * 1000)))
        return merged[:batch]

    # -- taking ------------------------------------------------------------------------------
    def _take_from(self, candidates: Iterator[Mapping[str, Any]], wanted: int) -> int:
        """Claim up to ``wanted`` of ``candidates`` within the limits; how many were claimed."""
        taken = 0
        while taken < wanted and not self._stopped:
            candidate = next(candidates, None)  # pulled only when wanted: a group keeps the rest
            if candidate is None:
                break
            task_id = candidate["_id"]
            concurrency_key, rate_key = candidate.get("concurrency_key"), candidate.get("rate_key")
            if task_id in self._tried or concurrency_key in self._full_keys or rate_key in self._spent_rates:
                continue
            self._tried.add(task_id)
            doc = self._claim_one(task_id)
            if doc is None:  # another claimer took it first
                continue
            if self._admit(doc):
                self.claimed.append(doc)
                taken += 1
            else:
                self._hand_back(doc)
        return taken

    def _claim_one(self, task_id: str) -> dict[str, Any] | None:
        return self.tasks.find_one_and_update(
            {"_id": task_id, "queue": self.queue, "status": TaskStatus.PENDING.value,
             "next_attempt_at_ms": {"$lte": self.now_ms}},
            {"$set": {"status": TaskStatus.IN_FLIGHT.value, "claim_token": uuid.uuid4().hex,
                      "claimed_at_ms": self.now_ms, "claimed_by": self.worker,
                      "lease_expires_at_ms": self.now_ms + self.lease_ms,
                      "updated_at_ms": self.now_ms}},
            return_document=ReturnDocument.AFTER,
        )

    def _admit(self, doc: dict[str, Any]) -> bool:
        """Take the slots ``doc`` needs (its key's, the queue's, its rate key's), in that order."""
        concurrency_key, rate_key = doc.get("concurrency_key"), doc.get("rate_key")
        freed_at = 0
        limit = None if concurrency_key is None else self.flow.limit_for(concurrency_key)
        if concurrency_key is not None and limit is not None:
            key_freed_at = self._take_holder_slot(f"{self.queue} c {concurrency_key}", limit, doc)
            if key_freed_at is None:
                self._full_keys.add(concurrency_key)
                return False
            freed_at = key_freed_at
        if self.flow.max_in_flight is not None:
            queue_freed_at = self._take_holder_slot(f"{self.queue} m", self.flow.max_in_flight, doc)
            if queue_freed_at is None:
                self._stopped = True
                return False
            freed_at = max(freed_at, queue_freed_at)
        start_ms = max(doc["claimed_at_ms"], freed_at + 1)
        rate = self.flow.rate_limit
        if rate_key is not None and rate is not None:
            period_ms = round(rate.window_seconds * 1000)
            if not self._take_rate_slot(f"{self.queue} r {rate_key}", rate.count, period_ms, start_ms, doc):
                self._spent_rates.add(rate_key)
                return False
        if start_ms > doc["claimed_at_ms"]:
            self._start_at(doc, start_ms)
        return True

    def _take_holder_slot(self, family: str, limit: int, doc: Mapping[str, Any]) -> int | None:
        """Take a free slot of ``family`` for ``doc``'s claim; None when ``limit`` are held. On
        success, the time the slot was freed (when the previous holder let go: its task's update),
        so this claim never starts before its predecessor ended."""
        slots = {s["_id"]: s for s in self.slots.find({"family": family}, {"holder": 1, "task_id": 1})}
        holder_ids = sorted({s["task_id"] for s in slots.values() if s.get("task_id")})
        holders = {t["_id"]: t for t in self.tasks.find(
            {"_id": {"$in": holder_ids}}, {"status": 1, "claim_token": 1, "updated_at_ms": 1})
        } if holder_ids else {}

        def freed(slot: Mapping[str, Any]) -> int | None:
            """When the slot's holder let go (0 for never held), or None while it holds it."""
            holder = holders.get(slot.get("task_id"))
            if not slot.get("holder") or holder is None:
                return 0
            if holder.get("status") == TaskStatus.IN_FLIGHT.value and holder.get("claim_token") == slot["holder"]:
                return None
            return int(holder.get("updated_at_ms") or 0)

        held = sum(1 for s in slots.values() if freed(s) is None)
        if held >= limit:
            return None
        for index in range(limit):
            slot_id = f"{family} {index}"
            mine = {"holder": doc["claim_token"], "task_id": doc["_id"]}
            slot = slots.get(slot_id)
            if slot is None:
                try:
                    self.slots.insert_one({"_id": slot_id, "family": family, **mine})
                    return 0
                except DuplicateKeyError:
                    continue  # another claimer created it first
            released_at = freed(slot)
            if released_at is None:
                continue
            # Compare-and-set on the holder seen: of two claimers taking this slot, one wins.
            if self.slots.update_one({"_id": slot_id, "holder": slot.get("holder")}, {"$set": mine}).modified_count:
                return released_at
        return None

    def _take_rate_slot(self, family: str, count: int, period_ms: int, at_ms: int, doc: Mapping[str, Any]) -> bool:
        """Stamp a rate slot of ``family`` with ``at_ms`` (the claim's recorded start) and ``doc``'s
        claim: a slot last used at least ``period_ms`` before ``at_ms``, or one whose claim was
        released unstarted (its task names that claim as released: a rate limit counts starts,
        and a released task never started)."""
        slots = {s["_id"]: s for s in self.slots.find({"family": family}, {"at_ms": 1, "holder": 1, "task_id": 1})}
        mine = {"at_ms": at_ms, "holder": doc["claim_token"], "task_id": doc["_id"]}

        def take(slot_id: str, seen: Mapping[str, Any]) -> bool:
            # Compare-and-set on what was read: of two claimers taking this slot, one wins.
            return bool(self.slots.update_one({"_id": slot_id, "at_ms": seen.get("at_ms"), "holder": seen.get("holder")},
                                              {"$set": mine}).modified_count)

        for index in range(count):
            slot_id = f"{family} {index}"
            slot = slots.get(slot_id)
            if slot is None:
                try:
                    self.slots.insert_one({"_id": slot_id, "family": family, **mine})
                    return True
                except DuplicateKeyError:
                    continue
            if slot.get("at_ms", 0) <= at_ms - period_ms and take(slot_id, slot):
                return True
        holder_ids = sorted({s["task_id"] for s in slots.values() if s.get("task_id")})
        released = {t["_id"]: t.get("released_claim") for t in self.tasks.find(
            {"_id": {"$in": holder_ids}}, {"released_claim": 1})} if holder_ids else {}
        for slot_id, slot in sorted(slots.items()):
            if slot.get("holder") and released.get(slot.get("task_id")) == slot["holder"] and take(slot_id, slot):
                return True
        return False

    def _start_at(self, doc: dict[str, Any], at_ms: int) -> None:
        """Move the claim's start to ``at_ms``, just after the slot it took was freed (later than
        this claim read the clock): every execution of a limited key then starts after the one
        before it ended, as the store records them."""
        lease_until = max(doc["lease_expires_at_ms"], at_ms + self.lease_ms)
        self.tasks.update_one({"_id": doc["_id"], "claim_token": doc["claim_token"]},
                              {"$set": {"claimed_at_ms": at_ms, "lease_expires_at_ms": lease_until}})
        doc["claimed_at_ms"], doc["lease_expires_at_ms"] = at_ms, lease_until

    def _hand_back(self, doc: Mapping[str, Any]) -> None:
        """Back to PENDING as it was, no attempt spent (the task never reached a worker)."""
        self.tasks.update_one(
            {"_id": doc["_id"], "status": TaskStatus.IN_FLIGHT.value, "claim_token": doc["claim_token"]},
            {"$set": {"status": TaskStatus.PENDING.value, "updated_at_ms": self.now_ms}, "$unset": _CLAIM_FIELDS},
        )
