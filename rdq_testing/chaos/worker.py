"""A worker process for the chaos tests: the real engine, plus a journal the test can audit.

``python -m rdq_testing.chaos.worker URL QUEUE JOURNAL [--plugin MOD] [--lease S]
[--batch N] [--dwell-ms MS] [--seed N] [--go-file PATH]`` (a spare waits for PATH to exist)

The journal is one line per event, each written with a single unbuffered ``os.write`` on an
``O_APPEND`` file, so ``kill -9`` loses nothing that was written and lines from the worker's
threads never interleave. ``chaos.journal`` reads it; the grammar (times are ``time.time()``)::

    B <seq> <op> <ts> <label>        a storage call began (op: claim settle release extend reap)
    i <seq> <task_id> <token> <x>    one item of that call (x: the outcome for settle/reap)
    R <seq> <ts> ok|stale|error <x>  the store answered (stale: x = refused ids; error: x = type)
    c <seq> <task_id> <token> <us>   one task a claim returned, with its claimed_at (epoch us)
    E <seq> <ts>                     the call returned to the engine
    H <seq> <point> <ts>             armed for <point>: holding here for the killer
    H <task_id> handler <ts>         armed for a kill inside a handler: holding in it
    H <task_id> freeze <ts>          holding in a handler for the test to freeze the process
                                     (SIGSTOP; ``chaos.exactly_once_worker``)
    S <task_id> <ts> <attempt> <ms>  a handler began (and means to run <ms>)
    F <task_id> <ts> ok|raised       a handler finished (returned or raised)

A call has three points a ``kill -9`` can land on: before the store saw it; after the store
committed but before the journal (and the engine) knew; after the journal knew but before the
engine did. The killer *arms* a process for one of them by writing its aim into
``<JOURNAL>.arm`` (``claim``, ``claim-reply``, ``settle``, ``settle-reply``, ``heartbeat``,
``handler``); the armed wrapper (or handler), on reaching that point, journals the marker as
usual and holds there (up to ``HOLD_SECONDS``) so the SIGKILL sent on seeing the marker lands
exactly on it, however busy the machine. An in-flight aim (``claim``, ``settle``, ``heartbeat``) holds before or after the
store call at random: a store that committed and one that did not. Unarmed, the wrapper pauses a
random few milliseconds at each point (``--dwell-ms``), which varies the timing of random kills.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import random
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Callable, Iterator, Sequence, cast

from rdq_core.flow import NO_FLOW, FlowPolicy
from rdq_core.errors import StaleClaim
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Backoff, ClaimedTask, ClaimRef, Outcome, Settlement
from rdq_core.engine.retry import PolicyBook, RetryPolicy
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage, to_micros
from rdq_core.hosts.process.worker import Worker, WorkerConfig

#: Handler names and their ``timeout_seconds`` in a chaos worker. ``chaos-tight`` runs close to
#: its timeout, so a runner that stops renewing a claim once the handler's time is spent loses
#: the task while its outcome still waits to be settled.
HANDLER = "chaos-sleep"
TIGHT_HANDLER = "chaos-tight"
HANDLER_TIMEOUTS = {HANDLER: 8.0, TIGHT_HANDLER: 1.0}
#: How long an armed process holds at its marker for the killer's SIGKILL.
HOLD_SECONDS = 0.5


def stamp() -> str:
    return f"{time.time():.6f}"


class JournalingStorage:
    """Delegates to the real storage and journals every write call's begin, answer and return."""

    def __init__(
        self, inner: Storage, journal_fd: int, *, dwell_seconds: float = 0.0, seed: int | None = None,
        arm_path: str | None = None,
    ) -> None:
        self._inner = inner
        self._fd = journal_fd
        self._arm_path = arm_path
        self._dwell = dwell_seconds
        self._rng = random.Random(seed)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- journal ---------------------------------------------------------------------------
    def write(self, text: str) -> None:
        os.write(self._fd, text.encode())

    def event(self, *fields: object) -> None:
        self.write(" ".join(str(f) for f in fields) + "\n")

    @contextmanager
    def handler_extension(self) -> Iterator[None]:
        """Marks extend calls made from a handler (``ctx.extend_lease``), so the journal can tell
        them from the heartbeat's."""
        self._local.from_handler = True
        try:
            yield
        finally:
            self._local.from_handler = False

    def _pause(self, seq: int, point: str | None = None) -> None:
        """``point`` is what a kill here would hit: hold if the killer armed us for it."""
        if point is not None and self.armed() == point:
            self.write(f"H {seq} {point} {stamp()}\n")
            time.sleep(HOLD_SECONDS)  # the SIGKILL comes in here
        elif self._dwell > 0:
            with self._lock:
                pause = self._rng.uniform(0, self._dwell)
            time.sleep(pause)

    def armed(self) -> str | None:
        if self._arm_path is None:
            return None
        try:
            with open(self._arm_path) as arm:
                return arm.read().strip()
        except FileNotFoundError:
            return None

    def _in_flight_point(self, op: str) -> tuple[str | None, str | None]:
        """Where an in-flight aim at ``op`` holds: before the store call or after it."""
        with self._lock:
            before = self._rng.random() < 0.5
        return (op, None) if before else (None, op)

    def _journaled(
        self,
        op: str,
        label: str,
        items: Sequence[tuple[str, str, str]],
        call: Callable[[], Any],
        describe: Callable[[int, Any], str] | None = None,
    ) -> Any:
        with self._lock:
            seq = next(self._seq)
        aim = {"claim": "claim", "settle": "settle", "extend": "heartbeat" if label.startswith("hb") else None}.get(op)
        before, after = self._in_flight_point(aim) if aim else (None, None)
        reply = f"{aim}-reply" if aim in ("claim", "settle") else None
        self.write(f"B {seq} {op} {stamp()} {label}\n" + "".join(f"i {seq} {t} {k} {x}\n" for t, k, x in items))
        self._pause(seq, before)
        try:
            result = call()
            # Not yet journaled as answered: a kill here hit a call the store may have committed
            # without anyone knowing -- the ambiguity the history checker must resolve from the store.
            self._pause(seq, after)
        except StaleClaim as exc:
            self.write(f"R {seq} {stamp()} stale {','.join(exc.task_ids) or '-'}\n")
            self._pause(seq)
            self.write(f"E {seq} {stamp()}\n")
            raise
        except BaseException as exc:
            self.write(f"R {seq} {stamp()} error {type(exc).__name__}\n")
            self._pause(seq)
            self.write(f"E {seq} {stamp()}\n")
            raise
        # The answer and what it carried go in one write: a kill after it loses none of it.
        self.write(f"R {seq} {stamp()} ok -\n" + (describe(seq, result) if describe else ""))
        # A claim's reply is worth a kill only when it carried tasks.
        self._pause(seq, reply if (result or op != "claim") else None)
        self.write(f"E {seq} {stamp()}\n")
        return result

    # -- the journaled SPI calls -------------------------------------------------------------
    def claim(self, queue: str, limit: int, lease_seconds: float, flow: FlowPolicy = NO_FLOW, *,
              worker: str = "") -> list[ClaimedTask]:
        def describe(seq: int, claimed: list[ClaimedTask]) -> str:
            return "".join(f"c {seq} {c.task.id} {c.claim_token} {to_micros(c.claimed_at)}\n" for c in claimed)

        claimed: list[ClaimedTask] = self._journaled(
            "claim", f"limit={limit}", (), lambda: self._inner.claim(queue, limit, lease_seconds, flow, worker=worker), describe
        )
        return claimed

    def settle(self, settlements: Sequence[Settlement]) -> None:
        # The engine's reaper settles other processes' claims with LEASE_EXPIRED; journal those
        # apart, they are not this process's own outcomes.
        reaping = bool(settlements) and all(s.outcome is Outcome.LEASE_EXPIRED for s in settlements)
        items = [(s.task_id, s.claim_token, s.outcome.value) for s in settlements]
        self._journaled("reap" if reaping else "settle", "-", items, lambda: self._inner.settle(settlements))

    def release(self, refs: Sequence[ClaimRef]) -> None:
        items = [(r.task_id, r.claim_token, "-") for r in refs]
        self._journaled("release", "-", items, lambda: self._inner.release(refs))

    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        who = "ctx" if getattr(self._local, "from_handler", False) else "hb"
        items = [(r.task_id, r.claim_token, "-") for r in refs]
        extended: dict[str, datetime] = self._journaled(
            "extend", f"{who}:{lease_seconds:.3f}", items, lambda: self._inner.extend_leases(refs, lease_seconds)
        )
        return extended


def chaos_handler(storage: JournalingStorage) -> Callable[[Any, Any], dict[str, Any]]:
    """The handler every chaos host runs; the payload says what it does::

        {"ms": 80}                                   sleep 80 ms
        {"ms": 900, "extend": [[100, 0.2], [400, null]]}
                                                     at 100 ms call ctx.extend_lease(0.2), at
                                                     400 ms ctx.extend_lease(); done at 900 ms
        {"ms": 50, "overrun_attempts": 1, "overrun_ms": 60000}
                                                     attempt 1 sleeps 60 s (past any deadline)
    """

    def handle(payload: Any, ctx: Any) -> dict[str, Any]:
        duration = payload["ms"]
        if ctx.attempt <= payload.get("overrun_attempts", 0):
            duration = payload["overrun_ms"]
        storage.event("S", ctx.task_id, stamp(), ctx.attempt, duration)
        ended = "raised"
        try:
            if storage.armed() == "handler":
                storage.event("H", ctx.task_id, "handler", stamp())
                time.sleep(HOLD_SECONDS)  # the SIGKILL comes in here, inside the handler
            began = time.monotonic()
            for at_ms, seconds in payload.get("extend", ()):
                time.sleep(max(0.0, began + at_ms / 1000 - time.monotonic()))
                with storage.handler_extension():
                    ctx.extend_lease(seconds)
            time.sleep(max(0.0, began + duration / 1000 - time.monotonic()))
            ended = "ok"
            return {"pid": os.getpid()}
        finally:
            # A handler that raised has ended too: its execution must not look open until a kill.
            storage.event("F", ctx.task_id, stamp(), ended)

    return handle


def wait_for_go(path: str | None) -> None:
    """A spare process, started and imported ahead of need, says so (``PATH.ready``) and waits
    here until put to work (``PATH`` exists)."""
    if path is None:
        return
    open(path + ".ready", "w").close()
    while not os.path.exists(path):
        time.sleep(0.02)


def chaos_process_arguments() -> argparse.ArgumentParser:
    """What every chaos process takes: its store, queue and journal, plugins, batch size, the
    dwell at journal markers, the go file and a seed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("queue")
    parser.add_argument("journal")
    parser.add_argument("--plugin", action="append", default=[])
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--dwell-ms", type=float, default=0.0)
    parser.add_argument("--go-file", default=None)
    return parser


def run_chaos_worker(storage: JournalingStorage, registry: HandlerRegistry, args: argparse.Namespace) -> None:
    """Wait for the go file, then run a ``Worker`` over the journaling ``storage`` until killed:
    short leases and a fast retry policy, so a run sees many claims, retries and reaps."""
    wait_for_go(args.go_file)
    config = WorkerConfig(queues=[args.queue], batch_size=args.batch, lease_seconds=args.lease, idle_poll_seconds=0.05)
    policies = PolicyBook(RetryPolicy(max_attempts=50, backoff=Backoff(0.05, 2.0, 0.2, 0.0)))
    # Duck-typed: the journal forwards every SPI call it does not journal by ``__getattr__``.
    Worker(cast(Storage, storage), config, policies=policies, registry=registry).run_forever()


def main() -> None:
    parser = chaos_process_arguments()
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    for module in args.plugin:
        importlib.import_module(module)
    fd = os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    storage = JournalingStorage(
        open_storage(args.url), fd, dwell_seconds=args.dwell_ms / 1000, seed=args.seed, arm_path=args.journal + ".arm"
    )
    registry = HandlerRegistry()
    handle = chaos_handler(storage)
    for name, timeout in HANDLER_TIMEOUTS.items():
        registry.register(name, handle, timeout_seconds=timeout)
    run_chaos_worker(storage, registry, args)


if __name__ == "__main__":
    main()
