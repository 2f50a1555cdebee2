"""How fast the console's queue page paints with a day of chart data behind it.

``python -m bench.console_queue [--loads 5] [--tasks 2000]``

1. Fills a fresh SQLite store: ``--tasks`` real tasks on one queue through the storage SPI
   (most succeeded, some dead, some pending), and a day (1,440 minutes) of per-minute metrics for
   three handlers, written the way the maintenance pass writes them (``rollup.store_minute``).
2. Starts ``rdq dev`` on that store (a subprocess, 127.0.0.1, a free port).
3. Opens the queue page in chromium (Playwright, the system's browser) ``--loads`` times, each in
   a fresh browser context (nothing cached), and records, in the page itself, the time from
   navigation start to the first frame painted with the charts drawn (every chart's canvas in
   place and the metrics answer rendered) and the first task row shown; also the metrics
   request's own time. Once with the default window (the last hour) and once with the last day.

Prints the figures (each load, the median); asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

from rdq_core.client import build_new_tasks
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus
from rdq_core.storage import open_storage
from rdq_core.storage import rollup
from rdq_core.storage.spi import Storage

from .console_pages import console_on_filled_store, measure, report

QUEUE = "orders"
HANDLERS = {"orders.charge": 180.0, "orders.ship": 45.0, "orders.notify": 9.0}

#: Runs in the page before its own scripts: notes when the charts and a task row are on screen.
PAINT_PROBE = """
(() => {
  const done = () => {
    const section = document.querySelector('section.charts[data-loaded]');
    return section && section.querySelectorAll('figure.chart canvas').length >= 5
      && document.querySelector('table.data tbody tr[data-task]');
  };
  const observer = new MutationObserver(() => {
    if (!done()) return;
    observer.disconnect();
    requestAnimationFrame(() => { window.__paintedMs = performance.now(); });
  });
  observer.observe(document, { childList: true, subtree: true, attributes: true });
})();
"""


def seed_day(storage: Storage, queue: str, *, minutes: int = rollup.RETENTION_MINUTES, seed: int = 7) -> None:
    """``minutes`` of per-minute metrics up to the current minute (a daily wave, a slow handler,
    an incident of failures half an hour ago), written as the maintenance pass writes them."""
    rng = random.Random(seed)
    now = rollup.minute_of(storage.now())
    for minute in range(now - minutes, now):
        wave = 0.55 + 0.45 * math.sin((minute % 1440) / 1440 * 2 * math.pi)
        incident = now - 40 <= minute < now - 25
        handlers = {}
        succeeded = retried = dead = 0
        for name, typical_ms in HANDLERS.items():
            attempts = max(1, int(rng.gauss(40 * wave, 4)))
            failures = int(attempts * (0.35 if incident and name == "orders.charge" else 0.02))
            durations = [rng.lognormvariate(math.log(typical_ms * (3 if incident else 1)), 0.5) for _ in range(attempts)]
            handlers[name] = (attempts, failures, durations)
            succeeded += attempts - failures
            retried += failures - failures // 4
            dead += failures // 4
        depth = {"pending": int(200 * wave + (900 if incident else 0)), "in_flight": int(16 * wave) + 2,
                 "dead": 40 + max(0, min(minute - (now - 40), 15)),
                 "oldest_pending_age_seconds": round(3 + 20 * wave + (240 if incident else 0), 1)}
        rollup.store_minute(storage, queue, minute, counts={
            "succeeded": succeeded, "retried": retried, "dead_lettered": dead, "cancelled": rng.randint(0, 1)},
            depth=depth, handlers=handlers)


def fill(storage_url: str, tasks: int) -> float:
    """Real tasks on QUEUE and a day of metrics; the seconds it took."""
    started = time.perf_counter()
    storage = open_storage(storage_url)
    try:
        storage.migrate()
        names = list(HANDLERS)
        for first in range(0, tasks, 500):
            size = min(500, tasks - first)
            storage.enqueue(build_new_tasks(QUEUE, [
                {"handler": names[(first + i) % 3], "payload": {"order": first + i}, "max_attempts": 3}
                for i in range(size)]))
            claimed = storage.claim(QUEUE, size, 300)
            storage.settle([
                Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) if n % 25
                else Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                error=ErrorInfo("orders.CardDeclined", f"order {c.task.payload['order']} declined"))
                for n, c in enumerate(claimed)])
        storage.enqueue(build_new_tasks(QUEUE, [{"handler": "orders.ship", "payload": {"order": -n}} for n in range(50)]))
        seed_day(storage, QUEUE)
    finally:
        storage.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="real tasks on the queue (default 2000)")
    parser.add_argument("--loads", type=int, default=5, help="page loads per measurement (default 5)")
    args = parser.parse_args(argv)

    def filled(storage_url: str) -> None:
        seconds = fill(storage_url, args.tasks)
        print(f"filled {QUEUE} with {args.tasks} tasks and a day of per-minute metrics "
              f"({rollup.RETENTION_MINUTES} minutes, {len(HANDLERS)} handlers) on SQLite in {seconds:.1f} s")

    def timed(browser: Any, url: str, loads: int) -> tuple[list[float], list[float]]:
        return measure(browser, url, loads, probe=PAINT_PROBE, painted_var="__paintedMs", request_fragment="/metrics")

    with console_on_filled_store("queue", filled) as console:
        if console is None:
            return 2
        browser, base = console
        page_url = f"{base}/#/queues/{QUEUE}/tasks"
        timed(browser, page_url, 1)  # warm the server's caches once
        for label, url in (("queue page, last hour", page_url), ("queue page, last day", f"{page_url}?window=day")):
            report(label, "charts and first row shown", "metrics", *timed(browser, url, args.loads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
