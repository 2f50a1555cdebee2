"""Same scenario, same records on every backend.

One fixed, seeded scenario of about 200 operations is replayed on SQLite, PostgreSQL, Redis and
MongoDB, and what each store reports -- every call's answer, and the normalised records at
checkpoints (status, attempt numbers, outcomes and error types, results, counts, DLQ contents;
not timestamps or tokens) -- must be identical.

The scenario is generated with the compliance kit's reference model, so every operation means
something (settles target held tasks, the reaper runs after leases have lapsed). Only what the
SPI leaves open is kept out of it: claims take every due task of the queue (which of several
tasks due at the same instant a backend picks first is unspecified), delays are 0 or an hour,
and the reaper waits until the store's own clock is past every short lease.

Each backend gets a fresh store from the suite-wide ``fresh_store_url`` (``tests/conftest.py``); an
unreachable server fails under CI and skips elsewhere, as everywhere.
"""

from __future__ import annotations

import itertools
import random
import time
from functools import partial
from collections import Counter
from datetime import timedelta
from typing import Any


from rdq_core.compliance.stateful_model import (
    ERROR_TYPES,
    FAR,
    FAR_BACKOFF,
    HANDLERS,
    LONG_LEASE,
    NEVER_ISSUED,
    ZERO_BACKOFF,
    Lease,
    ReferenceModel,
)
from rdq_core.compliance.support import wait_until
from rdq_core.errors import StaleClaim, TaskConflict, TaskNotFound
from rdq_core.model import ClaimRef, DeadFilter, ErrorInfo, NewTask, Outcome, Settlement, TaskStatus
from rdq_core.engine.reaper import reap_expired_leases
from rdq_core.engine.retry import PolicyBook, RetryPolicy
from rdq_core.engine.outcomes import LEASE_EXPIRED, failed_attempt
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage

SEED = 20261203
OPERATIONS = 200
CHECK_EVERY = 25
QUEUES = ("diff-a", "diff-b")
SHORT_LEASE = 0.2
BACKOFFS = {None: None, "zero": ZERO_BACKOFF, "far": FAR_BACKOFF}
POLICY = (3, "zero")  # the engine's default policy in the scenario: max_attempts, backoff
SETTLE_KINDS = ("success", "retry-now", "retry-later", "retry-dead", "permanent", "policy-retryable",
                "policy-permanent")
DIRECT_FAILURES = {
    "retry-now": (Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, 0.0),
    "retry-later": (Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, FAR),
    "retry-dead": (Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD, 0.0),
    "permanent": (Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, 0.0),
}


# -- the scenario ----------------------------------------------------------------------------------

def build_scenario(seed: int = SEED, operations: int = OPERATIONS) -> list[tuple]:
    """Operations on logical task ids; fenced writes name claims symbolically (``id#n`` is the
    n-th claim of that task, ``never`` a token no store issued)."""
    rng = random.Random(seed)
    model = ReferenceModel(POLICY[0], BACKOFFS[POLICY[1]])
    claims: Counter = Counter()
    ops: list[tuple] = []
    serial = 0

    def stale_candidates(exclude=()) -> list[tuple[str, str]]:
        everything = {**model.purged, **model.tasks}
        pairs = [(i, tok) for i, t in sorted(everything.items()) for tok in t.spent_tokens]
        pairs += [(i, "never") for i in sorted(everything)][:3]
        held = sorted(model.held(), key=lambda t: t.id)
        pairs += [(a.id, b.token) for a, b in itertools.pairwise(held) if a.id != b.id]
        return [p for p in pairs if p[0] not in exclude]

    def dead_filter() -> tuple:
        dead = sorted(t.id for t in model.tasks.values() if t.status is TaskStatus.DEAD)
        kind = rng.choice(("ids", "ids", "error_type", "handler", "all"))
        if kind == "ids":
            known = sorted(model.tasks)
            return ("ids", tuple(sorted(set(rng.sample(dead, 1) + rng.sample(known, min(2, len(known)))))))
        if kind == "error_type":
            return ("error_type", rng.choice(ERROR_TYPES + (LEASE_EXPIRED,)))
        if kind == "handler":
            return ("handler", rng.choice(HANDLERS))
        return ("all",)

    while len(ops) < operations:
        if ops and len(ops) % CHECK_EVERY == 0 and ops[-1][0] != "check":
            ops.append(("check",))
            continue
        held = sorted(t.id for t in model.held())
        due_queues = [q for q in QUEUES if model.due(q)]
        dead = [t for t in model.tasks.values() if t.status is TaskStatus.DEAD]
        weights = {
            "enqueue": 4 if len(model.tasks) < 30 else 0,
            "claim": 5 if due_queues else 0,
            "settle": 6 if held else 0,
            "extend": 2 if held else 0,
            "release": 1 if held else 0,
            "stale": 1 if stale_candidates() else 0,
            "lapse": 3 if model.held(Lease.SHORT) else 0,
            "reap": 3 if model.held(Lease.LAPSED) and not model.held(Lease.SHORT) else 0,
            "redrive": 2 if dead else 0,
            "purge_dead": 1 if dead else 0,
            "cancel": 1 if model.tasks else 0,
            "purge_succeeded": 1 if model.finished() else 0,
        }
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]

        if kind == "enqueue":
            queue, items = rng.choice(QUEUES), []
            for _ in range(rng.randint(1, 4)):
                known = sorted(set(model.tasks) | set(model.purged))
                if known and rng.random() < 0.2:
                    task_id = rng.choice(known)
                else:
                    serial += 1
                    task_id = f"d{serial:03d}"
                if any(item[0] == task_id for item in items):
                    continue
                serial += 1
                items.append((task_id, rng.choice(HANDLERS), {"n": serial}, rng.choice([None, 1, 2, 3]),
                              rng.choice([None, "zero", "far"]), rng.choice([0.0, 0.0, 0.0, FAR])))
            model.enqueue([_new_task(queue, item) for item in items])
            ops.append(("enqueue", queue, items))
        elif kind == "claim":
            queue = rng.choice(due_queues)
            due = sorted(t.id for t in model.due(queue))
            lease = rng.choice(("short", "long"))
            for task_id in due:  # claims take every due task: see the module docstring
                model.claimed(task_id, f"{task_id}#{claims[task_id]}", Lease.SHORT if lease == "short" else Lease.LONG)
                claims[task_id] += 1
            ops.append(("claim", queue, len(due) + rng.choice((0, 0, 2)), lease))
        elif kind == "settle":
            chosen = rng.sample(held, min(len(held), rng.randint(1, 3)))
            items = []
            for task_id in chosen:
                serial += 1
                settle_kind, error_type = rng.choice(SETTLE_KINDS), rng.choice(ERROR_TYPES)
                token = model.tasks[task_id].token
                if settle_kind == "success":
                    model.settled(task_id, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"r": serial})
                elif settle_kind.startswith("policy-"):
                    outcome = Outcome.RETRYABLE_FAILURE if settle_kind == "policy-retryable" else Outcome.PERMANENT_FAILURE
                    status, delay = model.failure_decision(task_id, outcome)
                    model.settled(task_id, outcome, status, delay, error_type)
                else:
                    outcome, status, delay = DIRECT_FAILURES[settle_kind]
                    model.settled(task_id, outcome, status, delay, error_type)
                items.append((task_id, token, settle_kind, error_type, {"r": serial}))
            candidates = stale_candidates(exclude=chosen)
            stale = rng.choice(candidates) if candidates and rng.random() < 0.3 else None
            ops.append(("settle", items, stale, rng.randint(0, len(items))))
        elif kind == "stale":
            task_id, token = rng.choice(stale_candidates())
            ops.append(("stale", task_id, token, rng.choice(("success", "retry", "dead", "extend", "release"))))
        elif kind == "extend":
            chosen = rng.sample(held, min(len(held), rng.randint(1, 3)))
            lease = rng.choice(("short", "long"))
            refs = [(task_id, model.tasks[task_id].token) for task_id in chosen]
            for task_id in chosen:
                model.extended(task_id, Lease.SHORT if lease == "short" else Lease.LONG)
            ops.append(("extend", refs, lease))
        elif kind == "release":
            chosen = rng.sample(held, min(len(held), rng.randint(1, 2)))
            refs = [(task_id, model.tasks[task_id].token) for task_id in chosen]
            for task_id in chosen:
                model.released(task_id)
            ops.append(("release", refs))
        elif kind == "lapse":
            model.clock_passed_short_leases()
            ops.append(("lapse",))
        elif kind == "reap":
            queue = rng.choice(sorted({t.queue for t in model.held(Lease.LAPSED)}))
            model.reap(queue)
            ops.append(("reap", queue, rng.choice((1, 2, 100))))
        elif kind in ("redrive", "purge_dead"):
            queue = rng.choice(sorted({t.queue for t in dead}))
            selection = dead_filter()
            (model.redrive if kind == "redrive" else model.purge)(queue, _dead_filter(selection))
            ops.append((kind, queue, selection))
        elif kind == "cancel":
            pending = sorted(t.id for t in model.tasks.values() if t.status is TaskStatus.PENDING)
            task_id = rng.choice(pending if pending and rng.random() < 0.6 else sorted(model.tasks))
            model.cancel(task_id)
            ops.append(("cancel", task_id))
        elif kind == "purge_succeeded":
            model.retention([t.id for t in model.finished()])
            ops.append(("purge_succeeded",))
    ops.append(("check",))
    return ops


def _new_task(queue: str, item: tuple) -> NewTask:
    task_id, handler, payload, max_attempts, backoff, delay = item
    return NewTask(id=task_id, queue=queue, handler=handler, payload=payload, max_attempts=max_attempts,
                   backoff=BACKOFFS[backoff], delay_seconds=delay)


def _dead_filter(selection: tuple) -> DeadFilter:
    kind, *value = selection
    if kind == "ids":
        return DeadFilter(ids=tuple(value[0]))
    if kind == "error_type":
        return DeadFilter(error_type=value[0])
    if kind == "handler":
        return DeadFilter(handler=value[0])
    return DeadFilter()


# -- replaying it on one store ---------------------------------------------------------------------

def replay(store: Storage, ops: list[tuple]) -> list[tuple]:
    """Runs the scenario; returns what the store answered, op by op, plus checkpoint records."""
    policies = PolicyBook(RetryPolicy(POLICY[0], BACKOFFS[POLICY[1]]))
    tokens: dict[str, str] = {}          # symbolic claim -> the store's token
    claimed: dict[str, Any] = {}         # symbolic claim -> ClaimedTask (the engine's policy needs it)
    claim_counts: Counter = Counter()
    expiries: list = []                  # every lease expiry the store reported
    names: set[str] = set()
    transcript: list[tuple] = []

    def token(sym: str) -> str:
        return tokens.get(sym, NEVER_ISSUED)  # "never", or a claim this store did not make

    def lapse() -> None:
        # Short leases end by the store's clock: wait until it is past every one it reported.
        now = store.now()
        short = [e for e in expiries if e < now + timedelta(seconds=LONG_LEASE / 2)]
        if short:
            until = max(short)
            wait_until(lambda: store.now() > until, timeout=2.0, interval=0.01, what="short leases to lapse")

    def fenced(write) -> tuple:
        try:
            write()
            return ()
        except StaleClaim as exc:
            return tuple(sorted(exc.task_ids))

    for number, op in enumerate(ops):
        kind = op[0]
        if kind == "enqueue":
            _, queue, items = op
            names.update(item[0] for item in items)
            answer: Any = [(r.created, r.conflict) for r in store.enqueue([_new_task(queue, item) for item in items])]
        elif kind == "claim":
            _, queue, limit, lease = op
            got = store.claim(queue, limit, SHORT_LEASE if lease == "short" else LONG_LEASE)
            for c in sorted(got, key=lambda c: c.task.id):
                sym = f"{c.task.id}#{claim_counts[c.task.id]}"
                claim_counts[c.task.id] += 1
                tokens[sym], claimed[sym] = c.claim_token, c
                expiries.append(c.lease_expires_at)
            answer = sorted(c.task.id for c in got)
        elif kind == "settle":
            _, items, stale, position = op
            batch = []
            for task_id, sym, settle_kind, error_type, result in items:
                error = ErrorInfo(error_type, "failed on purpose")
                if settle_kind == "success":
                    batch.append(Settlement(task_id, token(sym), Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result))
                elif settle_kind.startswith("policy-"):
                    outcome = Outcome.RETRYABLE_FAILURE if settle_kind == "policy-retryable" else Outcome.PERMANENT_FAILURE
                    task = claimed[sym].task if sym in claimed else None
                    if task is None:  # this store never made that claim: send something it must refuse
                        batch.append(Settlement(task_id, NEVER_ISSUED, outcome, TaskStatus.DEAD, error=error))
                    else:
                        batch.append(failed_attempt(policies, task, token(sym), outcome, error))
                else:
                    outcome, status, delay = DIRECT_FAILURES[settle_kind]
                    batch.append(Settlement(task_id, token(sym), outcome, status, retry_delay_seconds=delay, error=error))
            if stale:
                batch.insert(position, Settlement(stale[0], token(stale[1]), Outcome.SUCCESS, TaskStatus.SUCCEEDED))
            answer = fenced(partial(store.settle, batch))
        elif kind == "stale":
            _, task_id, sym, write = op
            ref, error = ClaimRef(task_id, token(sym)), ErrorInfo("e.Stale", "late")
            answer = fenced({
                "success": partial(store.settle, [Settlement(task_id, ref.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)]),
                "retry": partial(store.settle, [Settlement(task_id, ref.claim_token, Outcome.RETRYABLE_FAILURE,
                                                           TaskStatus.PENDING, error=error)]),
                "dead": partial(store.settle, [Settlement(task_id, ref.claim_token, Outcome.PERMANENT_FAILURE,
                                                          TaskStatus.DEAD, error=error)]),
                "extend": partial(store.extend_leases, [ref], LONG_LEASE),
                "release": partial(store.release, [ref]),
            }[write])
        elif kind == "extend":
            _, refs, lease = op
            seconds = SHORT_LEASE if lease == "short" else LONG_LEASE
            extended: dict = {}

            def extend() -> None:
                extended.update(store.extend_leases([ClaimRef(i, token(sym)) for i, sym in refs], seconds))  # noqa: B023 - run at once

            refused = fenced(extend)
            expiries.extend(extended.values())
            answer = (sorted(extended), refused)
        elif kind == "release":
            answer = fenced(partial(store.release, [ClaimRef(i, token(sym)) for i, sym in op[1]]))
        elif kind == "lapse":
            lapse()
            answer = None
        elif kind == "reap":
            lapse()  # a no-op unless a lease came out shorter than asked: then every store reaps it
            report = reap_expired_leases(store, policies, batch_size=op[2], queue=op[1])
            answer = (report.expired, report.rescheduled, report.dead_lettered, report.contended)
        elif kind in ("redrive", "purge_dead"):
            _, queue, selection = op
            answer = (store.redrive if kind == "redrive" else store.purge_dead)(queue, _dead_filter(selection))
        elif kind == "cancel":
            try:
                answer = store.cancel(op[1]).status.value
            except TaskConflict:
                answer = "conflict"
            except TaskNotFound:
                answer = "not-found"
        elif kind == "purge_succeeded":
            # "Older than 0 s" must cover the last update: let the store's clock move past it first.
            start = store.now()
            wait_until(lambda start=start: store.now() > start, timeout=2.0, interval=0.002, what="the clock to tick")
            answer = store.purge_succeeded(older_than_seconds=0, limit=1000)
        elif kind == "check":
            answer = _records(store, sorted(names))
        else:  # pragma: no cover - the generator makes only the kinds above
            raise AssertionError(kind)
        transcript.append((number, kind, answer))
    return transcript


def _normal_task(task) -> tuple | None:
    if task is None:
        return None
    return (
        task.queue, task.handler, task.payload, task.status.value, task.attempt_count, task.redrive_count,
        task.max_attempts, tuple((a.attempt_no, a.outcome.value, a.error.type if a.error else None) for a in task.attempts),
        task.result if task.status is TaskStatus.SUCCEEDED else None,
        task.last_error.type if task.last_error else None,
        task.lease_expires_at is not None, task.dead_at is not None,
    )


def _records(store: Storage, names: list[str]) -> dict:
    queues = {}
    for queue in QUEUES:
        stats = store.stats(queue)
        dead, cursor = [], None
        while True:
            page = store.list_dead(queue, limit=3, cursor=cursor)
            dead += [(t.id, _normal_task(t)) for t in page.tasks]
            cursor = page.next_cursor
            if cursor is None:
                break
        queues[queue] = {
            "counts": (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled),
            "dead": sorted(dead),  # the order among tasks dead at the same instant is the store's
        }
    return {"tasks": {name: _normal_task(store.get(name)) for name in names}, "queues": queues,
            "list_queues": store.list_queues()}


def test_scenario_covers_every_operation():
    kinds = Counter(op[0] for op in build_scenario())
    assert set(kinds) == {"enqueue", "claim", "settle", "stale", "extend", "release", "lapse", "reap", "redrive",
                          "purge_dead", "cancel", "purge_succeeded", "check"}, kinds
    assert sum(kinds.values()) >= OPERATIONS and build_scenario() == build_scenario()


def test_one_scenario_leaves_the_same_records_on_every_backend(fresh_store_url):
    ops = build_scenario()
    transcripts: dict[str, list[tuple]] = {}
    timings = {}
    for backend, kind in (("sqlite", "sqlite"), ("postgres", "postgresql"), ("redis", "redis"), ("mongo", "mongodb")):
        store = open_storage(fresh_store_url(kind))
        store.migrate()
        started = time.monotonic()
        try:
            transcripts[backend] = replay(store, ops)
        finally:
            store.close()
        timings[backend] = round(time.monotonic() - started, 1)
    print(f"\ndifferential: {len(ops)} operations (seed {SEED}) per backend, seconds {timings}")
    reference = transcripts["sqlite"]
    for backend, transcript in transcripts.items():
        assert len(transcript) == len(reference)
        for mine, theirs in zip(reference, transcript, strict=True):
            where = _first_difference(mine[2], theirs[2])
            assert where is None, (
                f"{backend} differs from sqlite at operation {mine[0]} {ops[mine[0]]}:\n"
                f"  at {where[0]}: sqlite {where[1]!r}, {backend} {where[2]!r}")


def _first_difference(a: Any, b: Any, path: str = "answer") -> tuple | None:
    """Where two answers first differ, as (path, a's value, b's value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = _first_difference(a.get(key), b.get(key), f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{path}[{index}]")
            if found:
                return found
        return None
    return None if a == b else (path, a, b)
