"""The multi-process chaos runs the kit's ``ChaosCompliance`` tests drive: real hosts, ``kill -9``
at chosen points, then a full audit.

Every chaos process journals what it does (``chaos.worker``: each storage call's begin, answer
and return, each handler's start and finish). The killer watches the journals and sends
SIGKILL when a process is at the point a test aims at; once the queue drains, the history
checker (``chaos.history.audit``) holds every claim, execution and kill against the store.

* ``run_chaos`` -- long-running ``Worker`` processes killed inside a handler (the original test).
* ``run_runner_chaos`` -- ``Worker`` processes killed on the runner's own paths: inside a claim
  call (before the store answered, or after it answered but before the engine heard),
  with a finished handler's outcome still in the settle buffer, inside a settle call (both
  sides of the commit), inside the heartbeat's ``extend_leases``, inside a handler, and at
  random. Handlers vary: short ones, ones longer than the lease (the heartbeat must renew
  them), ones that call ``ctx.extend_lease`` (with a short, a default and a long extension),
  and ones that finish close to their ``timeout_seconds``.
* ``run_lambda_chaos`` -- warm Lambda worker containers (``chaos.lambda_container``) running
  ``run_worker_invocation`` back to back, killed at journal markers or exactly at an
  invocation's deadline (Lambda's timeout), including invocations whose handler overruns.

Only processes this package started are killed, by PID; everything runs on loopback.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from rdq_core.model import NewTask
from rdq_core.storage.spi import Storage

from ..conditions import present
from ..slot_watch import SlotWatch
from .fleet import FAST_BACKOFF, LEASE_SECONDS, MAX_ATTEMPTS, QUEUE, ChaosFailure, Feed, Fleet, Reaper, Watcher, python_module
from .history import Audit, audit
from .journal import ChaosProcess, Clock, Invocation
from .killer import LAMBDA_INTENTS, LAMBDA_REQUIRED, RUNNER_INTENTS, RUNNER_REQUIRED, Killer
from .lambda_container import EXTEND_HANDLER, FLEET as LAMBDA_FLEET, HANDLER as LAMBDA_HANDLER, OVERRUN_HANDLER
from .worker import HANDLER, TIGHT_HANDLER


def _drive(
    url: str, fleet: Fleet, killer: Killer, feed: Feed, timeout: float,
    on_tick: Callable[[], float] = lambda: math.inf,
) -> None:
    """Poll journals and let the killer work until the queue has drained (topped up until the
    kill plan is done). ``on_tick`` returns how soon it next needs to run (seconds)."""
    began = time.monotonic()
    with Watcher(url, feed) as watcher:
        while not watcher.drained.is_set():
            fleet.poll()
            fleet.maintain()
            soon = on_tick()
            killer.tick()
            watcher.hungry = not killer.done
            if time.monotonic() - began > timeout:
                raise ChaosFailure(f"not done in {timeout}s: {watcher.last}, {killer.figures()}")
            # Polling is the parent's whole CPU cost, and the machine is shared with the processes
            # under test: poll fast only while hunting for a marker or near a deadline.
            time.sleep(max(0.0, min(0.001 if killer.hunting else 0.005, soon)))
    if watcher.errors:
        raise watcher.errors[0]


def _run_fleet(
    url: str, fleet: Fleet, killer: Killer, feed: Feed, processes: int, timeout: float, reaper_every: float,
    on_tick: Callable[[], float] = lambda: math.inf,
) -> tuple[float, Reaper]:
    """Start ``processes``, drive them until the kill plan is done and the queue drained, with a
    reaper beside them, and tear everything down. Returns (elapsed seconds, the reaper)."""
    began = time.monotonic()
    with Reaper(url, reaper_every) as reaper:
        try:
            for _ in range(processes):
                fleet.spawn()
            _drive(url, fleet, killer, feed, timeout, on_tick=on_tick)
            elapsed = time.monotonic() - began
        finally:
            fleet.teardown()
    return elapsed, reaper


def _finish(
    storage: Storage, items: Sequence[NewTask], fleet: Fleet, killer: Killer, clock: Clock, t0: float,
    workdir: Path, reaper: Reaper, figures: dict[str, object], harness_doubts: Sequence[str] = (),
) -> Audit:
    """The audit first (a violation says more than anything else), then the run's own adequacy.
    ``harness_doubts``: ways this run's harness fell short that could explain a violation."""
    assert not reaper.errors, reaper.errors
    result = audit(storage, [i.id for i in items], fleet.spawned, clock, t0=t0)
    (workdir / "history-report.txt").write_text(result.report)
    figures.update(result.figures)
    if result.violations:
        doubts = "".join(f"HARNESS DOUBT (weigh before blaming the engine): {d}\n" for d in harness_doubts)
        raise ChaosFailure(
            f"{len(result.violations)} history violation(s); full report in {workdir / 'history-report.txt'}\n"
            f"{doubts}figures: {figures}\n" + "\n".join(result.report.splitlines()[:60])
        )
    if harness_doubts:
        raise ChaosFailure("the harness fell short (the machine is too busy?): " + "; ".join(harness_doubts))
    if not killer.done:
        raise ChaosFailure(f"the queue drained before the kill plan was done; raise the task count: {figures}")
    return result


def _worker_command(url: str, plugin_modules: Sequence[str], *, dwell_ms: float, seed: int,
                    lease_seconds: float = LEASE_SECONDS) -> Callable[[Path, int], list[str]]:
    def command(journal: Path, number: int) -> list[str]:
        line = [*python_module("rdq_testing.chaos.worker"), url, QUEUE, str(journal),
                "--lease", str(lease_seconds), "--dwell-ms", str(dwell_ms), "--seed", str(seed + number)]
        for module in plugin_modules:
            line += ["--plugin", module]
        return line

    return command


def _task(n: int, handler: str, rng_ms: int, **payload: object) -> NewTask:
    return NewTask(id=f"chaos-{n:05d}", queue=QUEUE, handler=handler, payload={"ms": rng_ms, **payload},
                   max_attempts=MAX_ATTEMPTS, backoff=FAST_BACKOFF)


# -- the tests ---------------------------------------------------------------------------------
def run_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    workers: int = 4,
    tasks: int = 300,
    kills: int = 10,
    plugin_modules: Sequence[str] = (),
    timeout: float = 240.0,
    lease_seconds: float = LEASE_SECONDS,
) -> dict[str, object]:
    """Worker processes killed inside a handler, then the full audit. A store outage (a
    failover) longer than ``lease_seconds`` lets live holders' leases lapse: a run that causes
    one gives a lease longer than the outage."""
    assert workers >= 1 and kills >= 1
    rng = random.Random(20261202)
    # The product promise is >= 300 tasks and >= 10 kills: ``tasks`` first, topped up (to 3x at
    # most) until the last kill, so a fast store cannot drain before the kills are done.
    feed = Feed(storage, lambda start, n: [_task(start + i, HANDLER, rng.randint(40, 100)) for i in range(n)],
                tasks, 3 * tasks, 8 * workers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()
    fleet = Fleet(workdir, _worker_command(url, plugin_modules, dwell_ms=0.0, seed=1000, lease_seconds=lease_seconds),
                  "worker-")
    killer = Killer(fleet, ["handler"] * kills, rng, pause=(0.1, 0.3))
    elapsed, reaper = _run_fleet(url, fleet, killer, feed, workers, timeout, reaper_every=0.05)
    figures: dict[str, object] = {"workers": workers, "top_ups": feed.top_ups, **killer.figures(),
                                  "processes_spawned": len(fleet.spawned)}
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures)
    expired = figures["lease_expired_attempts"]
    assert isinstance(expired, int) and expired >= len(killer.kills), "each kill held at least the task it was running"
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


def runner_workload(tasks: int, rng: random.Random, start: int = 0) -> list[NewTask]:
    """Mostly short handlers, plus: longer than the lease (the heartbeat must renew them), close
    to their timeout, and calling ``ctx.extend_lease`` (short, default and long extensions).

    Each long task is enqueued right behind a close-to-timeout one, so they tend to share a
    batch; when the close-to-timeout task leads its batch, its outcome waits in the settle
    buffer while the long one runs, well past the handler's timeout -- a runner that renews a
    claim only while its handler may run loses that finished task to the reaper.
    """
    first = start == 0  # the first batch has each kind at least a few times; top-ups in proportion
    n_long = max(5 if first else 0, round(tasks / 24))
    n_tight = max(6 if first else 0, round(tasks / 20), n_long)
    n_extend = max(6 if first else 0, round(tasks / 20))
    kinds = ["tight+long"] * n_long + ["tight"] * (n_tight - n_long) + ["extend"] * n_extend
    kinds += ["short"] * (tasks - len(kinds) - n_long)
    rng.shuffle(kinds)
    # Shorter than the lease (twice), the default, and longer: every variant in every batch.
    extensions = ([[100, 0.2]], [[100, None], [500, 0.3]], [[150, 6.0]])
    lease_ms = int(LEASE_SECONDS * 1000)
    items: list[NewTask] = []
    extending = 0
    for kind in kinds:
        n = start + len(items)
        if kind == "short":
            items.append(_task(n, HANDLER, rng.randint(30, 90)))
        elif kind == "extend":
            items.append(_task(n, HANDLER, rng.randint(700, 1000), extend=extensions[extending % len(extensions)]))
            extending += 1
        else:
            items.append(_task(n, TIGHT_HANDLER, rng.randint(750, 900)))
            if kind == "tight+long":
                items.append(_task(n + 1, HANDLER, rng.randint(lease_ms + 300, lease_ms + 700)))
    return items


def run_runner_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    workers: int = 4,
    tasks: int = 120,
    kills: int = 12,
    plugin_modules: Sequence[str] = (),
    timeout: float = 120.0,
    seed: int = 20261203,
) -> dict[str, object]:
    """Worker processes killed on the runner's own paths (see the module doc), then the audit."""
    assert workers >= 1 and kills >= len(RUNNER_REQUIRED)
    rng = random.Random(seed)
    feed = Feed(storage, lambda start, n: runner_workload(n, rng, start), tasks, 3 * tasks, 8 * workers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()
    plan = [RUNNER_INTENTS[i % len(RUNNER_INTENTS)] for i in range(kills)]
    rng.shuffle(plan)
    fleet = Fleet(workdir, _worker_command(url, plugin_modules, dwell_ms=3.0, seed=seed), "worker-")
    killer = Killer(fleet, plan, rng, required=RUNNER_REQUIRED, extra=2 * len(RUNNER_REQUIRED), patience=3.0)
    # Slower than the workers' own reapers, so both take part.
    elapsed, reaper = _run_fleet(url, fleet, killer, feed, workers, timeout, reaper_every=0.25)
    figures: dict[str, object] = {"workers": workers, "top_ups": feed.top_ups, **killer.figures(),
                                  "processes_spawned": len(fleet.spawned)}
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures)
    missing = [f for f in RUNNER_REQUIRED if f not in killer.landed_families()]
    assert not missing, f"no kill landed in {missing} (the harness could not find that window): {figures}"
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


def lambda_workload(tasks: int, rng: random.Random, start: int = 0) -> list[NewTask]:
    """Short handlers, a few that call ``ctx.extend_lease`` (a short one included), and a few
    whose first attempt overruns any invocation (it ends only when the invocation is killed)."""
    first = start == 0
    n_overrun = max(2 if first else 0, round(tasks / 40))
    n_extend = max(3 if first else 0, round(tasks / 25))
    kinds = ["overrun"] * n_overrun + ["extend"] * n_extend + ["short"] * (tasks - n_overrun - n_extend)
    rng.shuffle(kinds)
    extensions = ([[100, 0.2]], [[100, None]], [[100, 0.3], [350, 8.0]])
    items: list[NewTask] = []
    extending = 0
    for n, kind in enumerate(kinds, start):
        if kind == "short":
            items.append(_task(n, LAMBDA_HANDLER, rng.randint(30, 90)))
        elif kind == "extend":
            items.append(_task(n, EXTEND_HANDLER, rng.randint(500, 750), extend=extensions[extending % len(extensions)]))
            extending += 1
        else:
            items.append(_task(n, OVERRUN_HANDLER, 40, overrun_attempts=1, overrun_ms=120_000))
    return items


def _most_at_once(invocations: Sequence[Invocation]) -> int:
    """The most invocations that returned having claimed work whose runs overlapped."""
    worked = [inv for inv in invocations
              if inv.returned is not None and inv.result.startswith("ok ") and "claimed=0" not in inv.result.split()]
    edges = sorted(edge for inv in worked for edge in ((inv.begin, 1), (inv.returned, -1)))
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def run_lambda_chaos(
    storage: Storage,
    url: str,
    workdir: Path,
    *,
    containers: int = 4,
    tasks: int = 100,
    kills: int = 10,
    plugin_modules: Sequence[str] = (),
    grace: float = 1.0,
    budget: tuple[float, float] = (3.0, 5.0),
    timeout: float = 120.0,
    seed: int = 20261204,
) -> dict[str, object]:
    """Warm Lambda containers killed at journal markers and at invocation deadlines, then the audit."""
    assert containers >= 1 and kills >= len(LAMBDA_REQUIRED)
    rng = random.Random(seed)
    feed = Feed(storage, lambda start, n: lambda_workload(n, rng, start), tasks, 3 * tasks, 8 * containers)
    items = feed.items
    clock = Clock.measure(storage)
    t0 = time.time()

    def command(journal: Path, number: int) -> list[str]:
        line = [*python_module("rdq_testing.chaos.lambda_container"), url, QUEUE, str(journal),
                "--seed", str(seed + number), "--grace", str(grace), "--budget-min", str(budget[0]),
                "--budget-max", str(budget[1]), "--dwell-ms", "3", "--fleet-cap", str(containers)]
        for module in plugin_modules:
            line += ["--plugin", module]
        return line

    fleet = Fleet(workdir, command, "lambda-")
    plan = [LAMBDA_INTENTS[i % len(LAMBDA_INTENTS)] for i in range(kills)]
    rng.shuffle(plan)
    killer = Killer(fleet, plan, rng, required=LAMBDA_REQUIRED, extra=2 * len(LAMBDA_REQUIRED), patience=4.0)
    deadline_kills: list[ChaosProcess] = []

    def enforce_deadlines() -> float:
        # Lambda's timeout: the container dies the moment its invocation's time is up.
        wall = time.time()
        soonest = math.inf
        for process in list(fleet.live):
            invocation = process.journal.current_invocation()
            if invocation is None:
                continue
            if wall >= invocation.deadline:
                process.journal.poll()
                if process.journal.current_invocation() is invocation:
                    fleet.kill(process, "deadline")
                    deadline_kills.append(process)
                    fleet.spawn()
            else:
                soonest = min(soonest, invocation.deadline - wall)
        return soonest

    with SlotWatch(url, LAMBDA_FLEET) as slots:
        elapsed, reaper = _run_fleet(url, fleet, killer, feed, containers, timeout, reaper_every=0.1,
                                     on_tick=enforce_deadlines)
    invocations = [inv for p in fleet.spawned for inv in p.journal.invocations]
    most_at_once = _most_at_once(invocations)
    most_held = slots.peak()
    late = round(max([(present(p.killed_at, f"when {p.name} was killed") - p.journal.invocations[-1].deadline) * 1000
                      for p in deadline_kills], default=0.0), 1)
    figures: dict[str, object] = {
        "containers": containers,
        "top_ups": feed.top_ups,
        **killer.figures(),
        "deadline_kills": len(deadline_kills),
        "deadline_kills_landed_in": dict(Counter(k for p in deadline_kills for k in p.landed)),
        "deadline_kill_lateness_ms_max": late,
        "invocations": len(invocations),
        "invocations_returned": sum(1 for inv in invocations if inv.returned is not None),
        "invocations_raised": sum(1 for inv in invocations if inv.result.startswith("error")),
        "processes_spawned": len(fleet.spawned),
        "most_invocations_working_at_once": most_at_once,
        "most_worker_slots_held_at_once": most_held,
    }
    doubts = [f"a deadline kill came {late} ms late, over half the {grace}s lease grace"] if late > grace * 500 else []
    _finish(storage, items, fleet, killer, clock, t0, workdir, reaper, figures, doubts)
    missing = [f for f in LAMBDA_REQUIRED if f not in killer.landed_families()]
    assert not missing, f"no kill landed in {missing} (the harness could not find that window): {figures}"
    assert deadline_kills, f"no invocation was killed at its deadline: {figures}"
    assert not figures["invocations_raised"], f"run_worker_invocation raised; see {workdir}/lambda-*.out: {figures}"
    # The fleet's cap must let the containers race (a cap of one once let one work at a time).
    # Not asserted on invocations that worked at once: one often claims all there is while the
    # others find nothing; but the slot of each killed holder stays held until its lease ends,
    # while the other containers go on taking slots.
    assert containers == 1 or most_held >= 2, (
        f"no two of the fleet's worker slots were ever held at once (the fleet's cap?): {figures}")
    figures["elapsed_seconds"] = round(elapsed, 2)
    return figures


__all__ = ["run_chaos", "run_runner_chaos", "run_lambda_chaos", "QUEUE", "LEASE_SECONDS"]
