"""A worker process for the chaos test: the real engine, plus a journal the test can audit.

``python -m rdq_core.compliance.chaos_worker URL QUEUE JOURNAL [--plugin MOD] [--lease S]``

The journal (one line per event, written unbuffered so ``kill -9`` loses nothing written)::

    claim <task_id> <token>      after a claim returned
    start <task_id> <unix_ts>    the handler began
    end <task_id> <unix_ts>      the handler finished
    done <task_id> <token>       a settle/release call for the claim returned
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from typing import Any, Sequence

from ..handlers import HandlerRegistry
from ..model import Backoff, ClaimRef, Settlement
from ..retry import PolicyBook, RetryPolicy
from ..storage import open_storage
from ..storage.spi import Storage
from ..worker import Worker, WorkerConfig

HANDLER = "chaos-sleep"


class JournalingStorage:
    """Delegates to the real storage and journals claims and their settlement."""

    def __init__(self, inner: Storage, journal_fd: int) -> None:
        self._inner = inner
        self._fd = journal_fd

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, line: str) -> None:
        os.write(self._fd, (line + "\n").encode())

    def claim(self, queue: str, limit: int, lease_seconds: float):
        claimed = self._inner.claim(queue, limit, lease_seconds)
        for c in claimed:
            self.write(f"claim {c.task.id} {c.claim_token}")
        return claimed

    def settle(self, settlements: Sequence[Settlement]) -> None:
        try:
            self._inner.settle(settlements)
        finally:
            for s in settlements:
                self.write(f"done {s.task_id} {s.claim_token}")

    def release(self, refs: Sequence[ClaimRef]) -> None:
        try:
            self._inner.release(refs)
        finally:
            for r in refs:
                self.write(f"done {r.task_id} {r.claim_token}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("queue")
    parser.add_argument("journal")
    parser.add_argument("--plugin", action="append", default=[])
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=3)
    args = parser.parse_args()
    for module in args.plugin:
        importlib.import_module(module)
    fd = os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    storage = JournalingStorage(open_storage(args.url), fd)

    def sleep_handler(payload: Any, ctx: Any) -> dict:
        storage.write(f"start {ctx.task_id} {time.time():.6f}")
        time.sleep(payload["ms"] / 1000)
        storage.write(f"end {ctx.task_id} {time.time():.6f}")
        return {"pid": os.getpid()}

    registry = HandlerRegistry()
    registry.register(HANDLER, sleep_handler, timeout_seconds=5)
    config = WorkerConfig(queues=[args.queue], batch_size=args.batch, lease_seconds=args.lease, idle_poll_seconds=0.05)
    policies = PolicyBook(RetryPolicy(max_attempts=50, backoff=Backoff(0.05, 2.0, 0.2, 0.0)))
    Worker(storage, config, policies=policies, registry=registry).run_forever()  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
