"""How fast the console's DLQ view shows its first page over a large dead-letter queue.

``python -m bench.console_dlq [--dead 10000] [--loads 5]``

1. Fills one queue of a fresh SQLite store with ``--dead`` dead tasks through the storage SPI,
   the way a worker makes them: enqueue (batches of 500), claim, and settle each claim as a
   failure whose budget is spent (status DEAD, one attempt with an error and a stack), three
   error types in turn.
2. Starts ``rdq dev`` on that store (a subprocess, 127.0.0.1, a free port).
3. Opens the DLQ view in chromium (Playwright, the system's browser) ``--loads`` times, each in
   a fresh browser context (nothing cached), and records, in the page itself, the time from
   navigation start to the first frame painted with a row of the table (a MutationObserver sees
   the row, the next animation frame is when it is on screen). Also the DLQ request's own time,
   from the page's resource timing. The same with an error-type filter.

Prints the figures (each load, the median); asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rdq_core.client import build_new_tasks
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus
from rdq_core.storage import open_storage

from .console_pages import console_on_filled_store, measure, report

QUEUE = "dlq-bench"
ERROR_TYPES = ("bench.PaymentDeclined", "bench.UpstreamTimeout", "bench.BadAddress")
BATCH = 500
STACK = "".join(f'  File "bench/handlers.py", line {n}, in step_{n}\n    raise_if_broken()\n' for n in range(12))

#: Runs in the page before its own scripts: notes when the first DLQ row reaches the screen.
FIRST_ROW_PROBE = """
(() => {
  const seen = () => document.querySelector('table.data tbody tr[data-task]');
  const observer = new MutationObserver(() => {
    if (!seen()) return;
    observer.disconnect();
    requestAnimationFrame(() => { window.__firstRowMs = performance.now(); });
  });
  observer.observe(document, { childList: true, subtree: true });
})();
"""


def fill(storage_url: str, dead: int) -> float:
    """``dead`` dead tasks on QUEUE; the seconds it took."""
    started = time.perf_counter()
    storage = open_storage(storage_url)
    try:
        storage.migrate()
        for first in range(0, dead, BATCH):
            size = min(BATCH, dead - first)
            items = [{"handler": "bench.settle", "payload": {"order": first + i, "note": "x" * 40}, "max_attempts": 1}
                     for i in range(size)]
            storage.enqueue(build_new_tasks(QUEUE, items))
            claimed = storage.claim(QUEUE, size, 300)
            storage.settle([
                Settlement(c.task.id, c.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD,
                           error=ErrorInfo(ERROR_TYPES[n % len(ERROR_TYPES)], f"order {c.task.payload['order']} failed", STACK))
                for n, c in enumerate(claimed)])
        stats = storage.stats(QUEUE)
        if stats.dead != dead:
            raise SystemExit(f"expected {dead} dead tasks, the store holds {stats.dead}")
    finally:
        storage.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_dlq", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dead", type=int, default=10_000, help="dead tasks to fill the DLQ with (default 10000)")
    parser.add_argument("--loads", type=int, default=5, help="page loads per measurement (default 5)")
    args = parser.parse_args(argv)

    def filled(storage_url: str) -> None:
        seconds = fill(storage_url, args.dead)
        print(f"filled {QUEUE} with {args.dead} dead tasks on SQLite in {seconds:.1f} s "
              f"(enqueue, claim and settle through the storage SPI, {BATCH} at a time)")

    def timed(browser: Any, url: str, loads: int) -> tuple[list[float], list[float]]:
        return measure(browser, url, loads, probe=FIRST_ROW_PROBE, painted_var="__firstRowMs", request_fragment="/dlq")

    with console_on_filled_store("dlq", filled) as console:
        if console is None:
            return 2
        browser, base = console
        dlq_url = f"{base}/#/queues/{QUEUE}/dlq"
        timed(browser, dlq_url, 1)  # warm the server's caches once
        report(f"DLQ view, {args.dead} dead, page of 50", "first row shown", "DLQ", *timed(browser, dlq_url, args.loads))
        report(f"DLQ view filtered by error type ({args.dead // len(ERROR_TYPES)} match)", "first row shown", "DLQ",
               *timed(browser, f"{dlq_url}?error_type={ERROR_TYPES[1]}", args.loads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
