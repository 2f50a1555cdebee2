"""The killer: works through a plan of kill aims against a ``Fleet``, arming processes to hold
at the aimed-at point (see ``chaos.worker``) and sending SIGKILL when one does."""

from __future__ import annotations

import os
import random
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

from .fleet import Fleet
from .journal import ChaosProcess

#: Kill aims for the long-running worker, and the family each lands in (a "-reply" kill hit a
#: call after the store answered, before the engine heard back).
RUNNER_INTENTS = ("claim", "claim-reply", "buffer", "settle", "settle-reply", "heartbeat", "handler", "random")
RUNNER_REQUIRED = ("claim", "buffer", "settle", "heartbeat", "handler")
LAMBDA_INTENTS = ("claim", "claim-reply", "buffer", "settle", "settle-reply", "handler", "random")
LAMBDA_REQUIRED = ("claim", "buffer", "settle", "handler")


#: Aims the victim cooperates with: armed, it holds at the point (see ``chaos.worker``).
ARMED_AIMS = ("claim", "claim-reply", "settle", "settle-reply", "heartbeat", "handler")


def family(kind: str) -> str:
    return kind.removesuffix("-reply")


def _arm(process: ChaosProcess, aim: str | None) -> None:
    path = Path(str(process.journal.path) + ".arm")
    if aim is None:
        path.unlink(missing_ok=True)
        return
    staged = Path(str(path) + "-new")
    staged.write_text(aim)
    os.replace(staged, path)  # a reader sees the old aim or the new one, never half of it


# -- the killer --------------------------------------------------------------------------------
class Killer:
    """Works through a plan of kill aims: waits (up to ``patience``) for any live process to
    reach the aimed-at point, SIGKILLs it, starts a replacement, pauses, aims again. When the
    plan is done it adds aims (up to ``extra``) for required families no kill has landed in yet."""

    def __init__(
        self, fleet: Fleet, plan: Sequence[str], rng: random.Random, *, required: Sequence[str] = (),
        extra: int = 0, patience: float = 3.0, pause: tuple[float, float] = (0.02, 0.1),
    ) -> None:
        self.fleet = fleet
        self.plan = list(plan)
        self.rng = rng
        self.required = tuple(required)
        self.extra = extra
        self.patience = patience
        self.pause = pause
        self.kills: list[ChaosProcess] = []
        self.missed: Counter[str] = Counter()
        self.waited: defaultdict[str, float] = defaultdict(float)  # seconds spent waiting, per aim
        self._aim: str | None = None
        self._aimed_at = 0.0
        self._next_at = time.monotonic() + rng.uniform(*pause)
        self._random_at = 0.0
        self._armed: list[ChaosProcess] = []
        self._began = time.monotonic()
        self.plan_done_after: float | None = None

    @property
    def done(self) -> bool:
        return self._aim is None and not self.plan

    @property
    def hunting(self) -> bool:
        """Waiting for a marker: poll the journals often, the windows are milliseconds wide."""
        return self._aim is not None and self._aim != "random"

    def landed_families(self) -> set[str]:
        return {family(kind) for p in self.kills for kind in p.landed}

    def _arm_all(self) -> None:
        # Every process that is up (has journaled something), also replacements started since:
        # the first to reach the point is the victim.
        for process in self.fleet.live:
            if process.journal.lines and process not in self._armed:
                _arm(process, self._aim)
                self._armed.append(process)
                with open(self.fleet.workdir / "kills.log", "a") as log:
                    log.write(f"{time.time():.6f} armed {process.name} for {self._aim}\n")

    def _disarm(self) -> None:
        for process in self._armed:
            if process in self.fleet.live:
                _arm(process, None)
        self._armed = []

    def tick(self) -> None:
        now = time.monotonic()
        if self._aim is None:
            if not self.plan and self.extra > 0:
                missing = [f for f in self.required if f not in self.landed_families()]
                if missing:
                    self.extra -= 1
                    self.plan.append(self.rng.choice(missing))
            if not self.plan or now < self._next_at or not self.fleet.live:
                return
            if not self.fleet.ready_for_a_kill():
                return  # replacements are still starting
            self._aim, self._aimed_at = self.plan.pop(0), now
            self._random_at = now + self.rng.uniform(0.0, 0.4)
        aim = self._aim
        victim = None
        if aim == "random":
            if now >= self._random_at and self.fleet.live:
                victim = self.rng.choice(self.fleet.live)
        elif aim in ARMED_AIMS:
            self._arm_all()
            holding = [p for p in self._armed if p in self.fleet.live and p.journal.holding(aim)]
            victim = self.rng.choice(holding) if holding else None
        else:
            wall = time.time()
            candidates = list(self.fleet.live)
            self.rng.shuffle(candidates)
            victim = next((p for p in candidates if p.journal.ready(aim, wall)), None)
        if victim is not None:
            self.fleet.kill(victim, aim)
            self._disarm()
            self.kills.append(victim)
            self.waited[aim] += now - self._aimed_at
            self.fleet.spawn()
        elif now - self._aimed_at > self.patience:
            self.missed[aim] += 1
            self._disarm()
            if self.missed[aim] <= 3:  # a quiet spell, not a missing window: aim again later
                self.plan.append(aim)
        else:
            return
        self._aim = None
        self._next_at = now + self.rng.uniform(*self.pause)
        if self.done:
            self.plan_done_after = now - self._began

    def figures(self) -> dict[str, object]:
        landed: Counter[str] = Counter()
        for p in self.kills:
            for kind in p.landed:
                landed[kind] += 1
        return {
            "kills": len(self.kills),
            "kills_by_aim": dict(Counter(p.intent for p in self.kills)),
            "kills_landed_in": dict(sorted(landed.items())),
            "aims_missed": dict(self.missed),
            "aim_wait_s": {aim: round(t, 2) for aim, t in self.waited.items()},
            "kill_plan_done_after_s": round(self.plan_done_after, 2) if self.plan_done_after is not None else None,
        }

