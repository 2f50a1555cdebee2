"""Reading chaos journals, and the history checker every chaos test ends with.

A ``ProcessJournal`` follows one chaos process's journal (see ``chaos_worker`` for the grammar):
incrementally while it runs, so the killer can wait for a marker, and completely once it is dead.

``audit`` then holds the whole history -- every claim, execution and storage call of every
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
import os
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..model import Attempt, Outcome, Task, TaskStatus
from ..storage.spi import Storage, to_micros
from .support import present

LE = Outcome.LEASE_EXPIRED.value
SUCCESS = Outcome.SUCCESS.value
#: Points a handler holds at (``H <task_id> <point> <ts>``): for a kill, or to be frozen.
HANDLER_HOLDS = ("handler", "freeze")


@dataclass(eq=False)
class Call:
    proc: "ProcessJournal"
    seq: int
    op: str
    begin: float
    label: str
    items: list[tuple[str, str, str]] = field(default_factory=list)
    returned: float | None = None
    status: str | None = None  # ok | stale | error
    detail: str = "-"
    ended: float | None = None
    claimed: list["Claim"] = field(default_factory=list)
    held: str | None = None  # the armed point this call is holding at

    def result_for(self, task_id: str) -> str:
        """applied | refused | unknown (in flight at a kill, or the call raised)."""
        if self.status == "ok":
            return "applied"
        if self.status == "stale":
            return "refused" if task_id in self.detail.split(",") else "applied"
        return "unknown"

    @property
    def kind(self) -> str:
        if self.op == "extend":
            return "heartbeat" if self.label.startswith("hb") else "ctx-extend"
        return self.op

    def __repr__(self) -> str:
        return f"{self.op}#{self.seq}"


@dataclass(eq=False)
class Claim:
    proc: "ProcessJournal"
    task_id: str
    token: str
    claimed_at: int  # backend clock, epoch microseconds
    call: Call
    invocation: int | None
    started: float | None = None
    attempt: int | None = None
    planned: float = 0.0  # seconds the handler means to run
    finished: float | None = None
    raised: bool = False
    held: str | None = None  # the point its handler is holding at (HANDLER_HOLDS), for the killer
    extra_starts: list[float] = field(default_factory=list)
    writes: list[Call] = field(default_factory=list)  # settle / release calls naming this claim
    extends: list[Call] = field(default_factory=list)

    @property
    def disposed(self) -> bool:
        return bool(self.writes)


@dataclass
class Invocation:
    number: int
    begin: float
    deadline: float
    budget_ms: int
    reserve: float
    returned: float | None = None
    result: str = ""


class ProcessJournal:
    """One chaos process's journal, parsed as it grows."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self._fd: int | None = None
        self._rest = b""
        self.calls: dict[int, Call] = {}
        self.open: dict[int, Call] = {}
        self.claims: list[Claim] = []
        self._latest: dict[str, Claim] = {}
        self._running: dict[str, Claim] = {}
        self._buffered: dict[str, Claim] = {}
        self.invocations: list[Invocation] = []
        self.lines = 0

    # -- reading ---------------------------------------------------------------------------
    def poll(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return
        while chunk := os.read(self._fd, 1 << 16):
            data = self._rest + chunk
            *lines, self._rest = data.split(b"\n")
            for line in lines:
                if line:
                    self._feed(line.decode().split(" "))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _feed(self, f: list[str]) -> None:
        self.lines += 1
        kind = f[0]
        if kind == "B":
            call = Call(self, int(f[1]), f[2], float(f[3]), f[4])
            self.calls[call.seq] = self.open[call.seq] = call
        elif kind == "i":
            call = self.calls[int(f[1])]
            call.items.append((f[2], f[3], f[4]))
            claim = self._latest.get(f[2])
            if claim is not None and claim.token == f[3]:
                if call.op in ("settle", "release"):
                    claim.writes.append(call)
                    self._buffered.pop(claim.task_id, None)
                elif call.op == "extend":
                    claim.extends.append(call)
        elif kind == "R":
            call = self.calls[int(f[1])]
            call.returned, call.status, call.detail = float(f[2]), f[3], f[4]
        elif kind == "c":
            call = self.calls[int(f[1])]
            current = self.invocations[-1].number if self.invocations else None
            claim = Claim(self, f[2], f[3], int(f[4]), call, current)
            call.claimed.append(claim)
            self.claims.append(claim)
            self._latest[claim.task_id] = claim
        elif kind == "H":
            if f[2] in HANDLER_HOLDS:
                self._running[f[1]].held = f[2]
            else:
                self.calls[int(f[1])].held = f[2]
        elif kind == "E":
            call = self.open.pop(int(f[1]))
            call.ended = float(f[2])
        elif kind == "S":
            claim = self._latest[f[1]]
            if claim.started is None:
                claim.started, claim.attempt, claim.planned = float(f[2]), int(f[3]), int(f[4]) / 1000
            else:
                claim.extra_starts.append(float(f[2]))
            self._running[claim.task_id] = claim
        elif kind == "F":
            claim = self._running.pop(f[1])
            claim.finished = float(f[2])
            claim.raised = len(f) > 3 and f[3] == "raised"
            if not claim.disposed:
                self._buffered[claim.task_id] = claim
        elif kind == "V":
            self.invocations.append(Invocation(int(f[1]), float(f[2]), float(f[3]), int(f[4]), float(f[5])))
        elif kind == "W":
            invocation = self.invocations[-1]
            invocation.returned, invocation.result = float(f[2]), " ".join(f[3:])
        else:
            raise ValueError(f"{self.path}: unknown journal line {' '.join(f)!r}")

    # -- what is happening right now (for the killer) ---------------------------------------
    def holding(self, point: str) -> bool:
        """Armed for ``point`` and holding there: a kill now lands exactly on it."""
        if point in HANDLER_HOLDS:
            return any(c.held == point for c in self._running.values())
        return any(c.held == point for c in self.open.values())

    def held_claims(self, point: str) -> list[Claim]:
        """The running claims whose handler holds at ``point`` (one of ``HANDLER_HOLDS``)."""
        return [c for c in self._running.values() if c.held == point]

    def ready(self, intent: str, now: float) -> bool:
        """Whether a kill now would land on ``intent``, as far as the journal shows."""
        if intent in ("claim", "settle", "release", "reap"):
            return any(c.op == intent and c.returned is None for c in self.open.values())
        if intent in ("claim-reply", "settle-reply"):
            op = intent.split("-")[0]
            return any(
                c.op == op and c.returned is not None and c.status == "ok" and (c.claimed or op != "claim")
                for c in self.open.values()
            )
        if intent in ("heartbeat", "ctx-extend"):
            return any(c.kind == intent for c in self.open.values())
        if intent == "buffer":
            return bool(self._buffered)
        if intent == "handler":
            # With 10 ms to spare: a kill sent now certainly lands inside the handler.
            return any(now < present(c.started, "a running handler's start") + c.planned - 0.01 for c in self._running.values())
        raise ValueError(intent)

    def current_invocation(self) -> Invocation | None:
        if self.invocations and self.invocations[-1].returned is None:
            return self.invocations[-1]
        return None

    def state(self) -> set[str]:
        """What the process was in the middle of (read once it is dead: what a kill hit)."""
        kinds = {c.kind + ("-reply" if c.returned is not None else "") for c in self.open.values()}
        if self._running:
            kinds.add("handler")
        if self._buffered:
            kinds.add("buffer")
        return kinds or {"idle"}


@dataclass(eq=False)
class ChaosProcess:
    """A spawned chaos process, its journal and how it ended."""

    name: str
    pid: int
    journal: ProcessJournal
    popen: subprocess.Popen[bytes]
    killed_at: float | None = None
    intent: str | None = None
    landed: set[str] = field(default_factory=set)
    #: When the test froze it (SIGSTOP) and thawed it (SIGCONT; None: still frozen at its kill).
    frozen: list[tuple[float, float | None]] = field(default_factory=list)

    def frozen_at(self, ts: float, tolerance: float = 0.0) -> bool:
        return any(start - tolerance <= ts <= (end if end is not None else math.inf) + tolerance
                   for start, end in self.frozen)

    def froze_within(self, start: float, end: float) -> float | None:
        """When it was first frozen between ``start`` and ``end``, if it was."""
        return min((s for s, _ in self.frozen if start <= s <= end), default=None)


# -- the clock ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Clock:
    """Backend clock vs ``time.time()`` on this host, measured, with its uncertainty."""

    offset: float  # backend - wall, seconds
    tolerance: float

    @classmethod
    def measure(cls, storage: Storage, samples: int = 5) -> "Clock":
        best: tuple[float, float] | None = None
        for _ in range(samples):
            before = time.time()
            backend = storage.now().timestamp()
            after = time.time()
            sample = (after - before, backend - (before + after) / 2)
            if best is None or sample[0] < best[0]:
                best = sample
        assert best is not None
        # Stores stamp at statement/transaction start and some keep milliseconds only.
        return cls(best[1], best[0] / 2 + 0.05)

    def wall(self, value: datetime | int) -> float:
        micros = value if isinstance(value, int) else to_micros(value)
        return micros / 1e6 - self.offset


# -- the audit ---------------------------------------------------------------------------------
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
