"""Reading chaos journals: what each chaos process did, followed while it runs and read in full
once it is dead.

A ``ProcessJournal`` follows one process's journal (``chaos.worker`` has the grammar):
incrementally while it runs, so the killer can wait for a marker, and completely once it is
dead. A ``ChaosProcess`` is a started process with its journal and how it ended (killed when,
aimed at what, frozen when); a ``Clock`` maps the store's time stamps onto this host's.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rdq_core.storage.spi import Storage, to_micros

from ..conditions import present

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

