"""The history checker every chaos run ends with.

``audit`` holds the whole history -- every claim, execution and storage call of every
process, and every kill -- against what the store recorded:

* every task SUCCEEDED with exactly one SUCCESS attempt; nothing lost; attempt numbers are
  1..n, unique and gap-free; every other attempt is a LEASE_EXPIRED;
* each claim is matched to the attempt it caused by the store's own stamps (a LEASE_EXPIRED
  attempt's ``started_at`` is its claim's ``claimed_at``; a run's is its handler's start, after
  its claim and before the task's next claim), and must have caused exactly what the journal
  says happened to it: a settle the store confirmed -> that outcome; a release -> nothing; a
  claim its process still held when killed -> one LEASE_EXPIRED; a settle or release *in flight*
  at the kill (the store may or may not have committed it) -> exactly one of the two, never
  both and never neither. So the LEASE_EXPIRED count is exact: one per lost lease;
* a LEASE_EXPIRED was recorded only after its holder died (a live worker is never overtaken by
  its own lease), and a live worker's settle is never refused;
* a claim call in flight at a kill may have claimed tasks nobody heard of: such a task shows an
  attempt matching no journaled claim, which must be a LEASE_EXPIRED stamped inside that call's
  window, at most ``limit`` per call;
* every SUCCESS comes from a claim whose handler ran to its end; no claim ran twice;
* a Lambda invocation that returned left none of its claims unsettled and unreleased;
* no two executions of one task overlapped in time (a killed execution ends at its kill).

A process the test *froze* (SIGSTOP, ``ChaosProcess.frozen``) cannot renew its leases: frozen
longer than a lease, it may be overtaken by it while it lives. So a LEASE_EXPIRED recorded while
its holder was frozen is no violation, nor is a write refused to a holder that was frozen after
its claim; and an execution whose claim was lost so (no write of it applied) counts as ended at
the freeze -- whatever it did after thawing was fenced out.

Violations come back as a report: each with its category, the claim's story (process, claim
and write times, last lease extensions, how its process died) and the task's full history.
"""


from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from rdq_core.model import Attempt, Outcome, Task, TaskStatus
from rdq_core.storage.spi import Storage, to_micros

from ..conditions import present
from .journal import Call, ChaosProcess, Claim, Clock

LE = Outcome.LEASE_EXPIRED.value
SUCCESS = Outcome.SUCCESS.value


@dataclass
class Audit:
    figures: dict[str, object]
    violations: list[str]
    report: str


def claim_stamp(attempt: Attempt, claimed_ats: Sequence[int]) -> int:
    """The ``claimed_at`` of the claim that caused ``attempt``: its own ``started_at`` for a lease
    that expired (stamped with the claim's time), else the last journaled claim of the task at or
    before it (a run starts after its claim and settles before the task is claimed again)."""
    started = to_micros(present(attempt.started_at, "an attempt's start"))
    if attempt.outcome.value == LE or started in claimed_ats:
        return started
    at = bisect.bisect_right(claimed_ats, started)
    return claimed_ats[at - 1] if at else started


def audit(
    storage: Storage,
    task_ids: Sequence[str],
    processes: Iterable[ChaosProcess],
    clock: Clock,
    *,
    t0: float,
) -> Audit:
    """Hold the journals of ``processes`` against the store for ``task_ids`` (times in the
    report are relative to ``t0``)."""
    processes = list(processes)
    by_name = {p.name: p for p in processes}

    def rel(ts: float | None) -> str:
        return f"{ts - t0:+.3f}s" if ts is not None else "-"

    violations: list[tuple[str, str, str]] = []  # (category, task_id, text)

    def flag(category: str, task_id: str, text: str) -> None:
        violations.append((category, task_id, text))

    claims_by_key: dict[tuple[str, int], list[Claim]] = defaultdict(list)
    claims_by_task: dict[str, list[Claim]] = defaultdict(list)
    for p in processes:
        for claim in p.journal.claims:
            claims_by_key[(claim.task_id, claim.claimed_at)].append(claim)
            claims_by_task[claim.task_id].append(claim)

    tasks: dict[str, Task | None] = {task_id: storage.get(task_id) for task_id in task_ids}

    # What each claim must have left in the store: a set of allowed outcomes, None = no attempt.
    def expected(claim: Claim) -> tuple[set[str | None], str]:
        p = by_name[claim.proc.name]
        settles = [(c, c.result_for(claim.task_id)) for c in claim.writes]
        applied = [c for c, r in settles if r == "applied"]
        unknown = [c for c, r in settles if r == "unknown"]
        outcome_of = {
            c: next(x for t, k, x in c.items if t == claim.task_id and k == claim.token) for c in claim.writes
        }
        if applied:
            call = applied[0]
            if len(applied) > 1:
                flag("double-write", claim.task_id, f"{claim_text(claim)}: {len(applied)} writes applied")
            return ({None} if call.op == "release" else {outcome_of[call]}), f"{call.op} applied"
        if unknown:
            allowed: set[str | None] = {LE}
            for call in unknown:
                allowed.add(None if call.op == "release" else outcome_of[call])
            return allowed, "write in flight at kill" if p.killed_at is not None else "write raised"
        if settles and p.froze_within(claim.call.begin, settles[0][0].begin) is not None:
            return {LE}, "write refused (frozen past the lease)"
        if settles:  # every write refused: the lease was lost while the holder was alive
            flag("lease-lost-while-alive", claim.task_id,
                 f"{claim_text(claim)}: the store refused its holder's {settles[0][0].op} (stale claim) "
                 f"at {rel(settles[0][0].returned)}; the holder was alive")
            return {LE}, "write refused"
        inv = p.journal.invocations[claim.invocation - 1] if claim.invocation else None
        if inv is not None and inv.returned is not None:
            flag("claim-left-by-invocation", claim.task_id,
                 f"{claim_text(claim)}: invocation {inv.number} returned at {rel(inv.returned)} "
                 "without settling or releasing it")
        if p.killed_at is None:
            flag("claim-held-by-live-process", claim.task_id, f"{claim_text(claim)}: never settled or released")
        return {LE}, "held at kill"

    def claim_text(claim: Claim) -> str:
        p = by_name[claim.proc.name]
        writes = ", ".join(
            f"{c.op}#{c.seq} B{rel(c.begin)} R{rel(c.returned)}:{c.status or 'none'}" for c in claim.writes
        ) or "none"
        extends = ", ".join(f"{rel(c.begin)}:{c.label}:{c.status or 'none'}" for c in claim.extends[-4:]) or "none"
        fate = (f"killed {rel(p.killed_at)} aiming at {p.intent}, landed in {'/'.join(sorted(p.landed))}"
                if p.killed_at is not None else "alive")
        if p.frozen:
            fate += ", frozen " + ", ".join(f"{rel(s)}..{rel(e)}" for s, e in p.frozen)
        return (
            f"claim {claim.token[:8]} of {claim.task_id} by {p.name} (claimed {rel(clock.wall(claim.claimed_at))}, "
            f"ran {rel(claim.started)}..{rel(claim.finished)}{' raised' if claim.raised else ''}, writes [{writes}], "
            f"last extends [{extends}]; {p.name} {fate})"
        )

    figures: Counter[str] = Counter()
    unmatched: list[tuple[str, Attempt]] = []  # (task_id, attempt)
    for task_id in task_ids:
        task = tasks[task_id]
        if task is None:
            flag("lost", task_id, "the task is gone from the store")
            continue
        if task.status is not TaskStatus.SUCCEEDED:
            flag("not-succeeded", task_id, f"ended {task.status.value}")
        outcomes = Counter(a.outcome.value for a in task.attempts)
        if outcomes[SUCCESS] != 1:
            flag("success-count", task_id, f"{outcomes[SUCCESS]} SUCCESS attempts")
        if set(outcomes) - {SUCCESS, LE}:
            flag("unexpected-outcome", task_id, f"outcomes {dict(outcomes)}")
        numbers = [a.attempt_no for a in task.attempts]
        if numbers != list(range(1, len(numbers) + 1)):
            flag("attempt-numbers", task_id, f"attempt numbers {numbers}")
        figures["attempts"] += len(task.attempts)
        figures["lease_expired_attempts"] += outcomes[LE]

        claimed_ats = sorted({claim.claimed_at for claim in claims_by_task[task_id]})
        attempts_by_key: dict[int, list[Attempt]] = defaultdict(list)
        for attempt in task.attempts:
            attempts_by_key[claim_stamp(attempt, claimed_ats)].append(attempt)
        keys = set(claimed_ats) | set(attempts_by_key)
        for key in sorted(keys):
            claims = claims_by_key.get((task_id, key), [])
            attempts = attempts_by_key.get(key, [])
            if not claims:
                unmatched += [(task_id, a) for a in attempts]
                continue
            if len(claims) > 1:  # two claims stamped alike (a millisecond store): judge them together
                allowed_sets = [expected(c)[0] for c in claims]
                low = sum(1 for s in allowed_sets if None not in s)
                if not low <= len(attempts) <= len(claims):
                    flag("claim-attempts", task_id, f"{len(claims)} claims stamped alike, {len(attempts)} attempts")
                figures["leases_lost"] += sum(1 for a in attempts if a.outcome.value == LE)
                continue
            claim = claims[0]
            allowed, why = expected(claim)
            got: list[str | None] = [a.outcome.value for a in attempts] or [None]
            if len(attempts) > 1:
                flag("claim-attempts", task_id, f"{claim_text(claim)}: {len(attempts)} attempts for one claim: {got}")
            elif got[0] not in allowed:
                flag("claim-attempts", task_id,
                     f"{claim_text(claim)}: expected {sorted(map(str, allowed))} ({why}), the store has {got[0]}")
            if len(allowed) > 1:
                figures["ambiguous_writes"] += 1
                figures["ambiguous_writes_committed" if got[0] != LE else "ambiguous_writes_not_committed"] += 1
            if LE in allowed and got[0] == LE:
                figures["leases_lost"] += 1
            for attempt in attempts:
                holder = by_name[claim.proc.name]
                if attempt.outcome.value == LE:
                    reaped = clock.wall(present(attempt.finished_at, "a reaped attempt's finish"))
                    # Frozen past its lease, a live holder may lose the claim to the reaper.
                    if not holder.frozen_at(reaped, clock.tolerance) and (
                            holder.killed_at is None or reaped < holder.killed_at - clock.tolerance):
                        flag("reaped-while-alive", task_id,
                             f"{claim_text(claim)}: LEASE_EXPIRED recorded at {rel(reaped)} while its holder was alive")
                if attempt.outcome.value == SUCCESS and (claim.finished is None or claim.raised):
                    flag("success-without-run", task_id, f"{claim_text(claim)}: SUCCESS but its handler never returned")

    # Attempts no journaled claim explains: only a claim call cut short by a kill can have made them.
    windows = [
        (call, p) for p in processes if p.killed_at is not None
        for call in p.journal.calls.values() if call.op == "claim" and call.returned is None
    ]
    explained: dict[Call, set[str]] = defaultdict(set)  # a call claims a task at most once, up to its limit
    for task_id, attempt in unmatched:
        stamped = clock.wall(present(attempt.started_at, "an attempt's start"))
        for call, p in windows:
            killed_at = present(p.killed_at, f"when {p.name} was killed")  # windows hold killed processes only
            limit = int(call.label.split("=")[1])
            if (call.begin - clock.tolerance <= stamped <= killed_at + clock.tolerance
                    and len(explained[call]) < limit and task_id not in explained[call]):
                break
        else:
            flag("unknown-claim", task_id, f"attempt {attempt.attempt_no} ({attempt.outcome.value}, started "
                                           f"{rel(stamped)}) matches no claim any process journaled or could have made")
            continue
        explained[call].add(task_id)
        figures["claims_lost_in_flight"] += 1
        figures["leases_lost"] += 1
        if attempt.outcome.value != LE:
            flag("unknown-claim", task_id,
                 f"attempt {attempt.attempt_no} of a claim lost in flight (a kill inside {p.name}'s claim#{call.seq}) "
                 f"is {attempt.outcome.value}, not LEASE_EXPIRED")
        elif (reaped := clock.wall(present(attempt.finished_at, "a reaped attempt's finish"))) < killed_at - clock.tolerance:
            flag("reaped-while-alive", task_id,
                 f"attempt {attempt.attempt_no}: a claim lost in {p.name}'s claim#{call.seq} was reaped at "
                 f"{rel(reaped)}, before {p.name} was killed at {rel(killed_at)}")

    # Executions: one per claim, and never two of one task at once.
    for task_id in task_ids:
        spans = []
        for claim in claims_by_task[task_id]:
            p = by_name[claim.proc.name]
            # A claim lost to a freeze (no write of it applied) ran, as far as the store goes, until then.
            applied = any(c.result_for(claim.task_id) == "applied" for c in claim.writes)
            ran_until = claim.finished if claim.finished is not None else p.killed_at
            lost_at = (None if applied or claim.started is None
                       else p.froze_within(claim.started, ran_until if ran_until is not None else math.inf))
            if claim.extra_starts:
                flag("claim-ran-twice", task_id, f"{claim_text(claim)}: handler started {1 + len(claim.extra_starts)} times")
            for start in [claim.started, *claim.extra_starts]:
                if start is None:
                    continue
                end = lost_at if lost_at is not None else ran_until
                spans.append((start, end if end is not None else float("inf"), claim))
        figures["executions"] += len(spans)
        figures["executions_cut_by_kill"] += sum(1 for _, _, c in spans if c.finished is None)
        if not spans and tasks.get(task_id) is not None:
            flag("never-ran", task_id, "no process ever ran it")
        spans.sort(key=lambda s: s[0])
        for (_, e1, c1), (s2, _, c2) in itertools.pairwise(spans):
            if s2 < e1:
                flag("overlap", task_id, f"two executions overlapped by {e1 - s2:.3f}s: {claim_text(c1)} and {claim_text(c2)}")

    figures["claims"] = sum(len(c) for c in claims_by_task.values())
    figures["tasks"] = len(task_ids)
    # Every LEASE_EXPIRED is accounted for by a lost lease above (or flagged): one per lost lease.
    if figures["leases_lost"] != figures["lease_expired_attempts"]:
        flag("lease-expired-count", "-", f"{figures['lease_expired_attempts']} LEASE_EXPIRED attempts for "
                                         f"{figures['leases_lost']} lost leases")
    lines = [f"{len(violations)} violation(s)"]
    by_category = Counter(category for category, _, _ in violations)
    if violations:
        lines.append("by kind: " + ", ".join(f"{k}={n}" for k, n in by_category.most_common()))
    for category, task_id, text in violations:
        lines.append(f"[{category}] {task_id}: {text}")
    for task_id in sorted({t for _, t, _ in violations})[:20]:
        lines.append(task_history(task_id, tasks.get(task_id), claims_by_task[task_id], by_name, clock, rel))
    return Audit(dict(figures), [f"[{c}] {t}: {x}" for c, t, x in violations], "\n".join(lines))


def task_history(
    task_id: str, task: Task | None, claims: list[Claim], by_name: dict[str, ChaosProcess], clock: Clock,
    rel: Callable[[float | None], str],
) -> str:
    out = [f"--- history of {task_id}: {task.status.value if task else 'MISSING'}"]
    for attempt in task.attempts if task else ():
        out.append(
            f"  attempt {attempt.attempt_no} {attempt.outcome.value}: "
            f"started {rel(clock.wall(present(attempt.started_at, 'started_at')))} "
            f"finished {rel(clock.wall(present(attempt.finished_at, 'finished_at')))}"
        )
    for claim in sorted(claims, key=lambda c: c.claimed_at):
        p = by_name[claim.proc.name]
        out.append(
            f"  claim {claim.token[:8]} by {p.name} at {rel(clock.wall(claim.claimed_at))}: ran {rel(claim.started)}.."
            f"{rel(claim.finished)} writes {[(c.op, rel(c.begin), c.status) for c in claim.writes]}"
            f" extends {[(rel(c.begin), c.label, c.status) for c in claim.extends]}"
            f"; {p.name} " + (f"killed {rel(p.killed_at)} ({'/'.join(sorted(p.landed))})" if p.killed_at else "alive")
        )
    return "\n".join(out)
