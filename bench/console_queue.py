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
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rdq_core.client import build_new_tasks
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus
from rdq_core.storage import open_storage
from rdq_core.storage import rollup
from rdq_core.storage.spi import Storage

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


def measure(browser: Any, url: str, loads: int) -> tuple[list[float], list[float]]:
    """(navigation start -> charts and first row painted, metrics request duration) in ms per load."""
    painted, requests = [], []
    for _ in range(loads):
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        try:
            context.add_init_script(PAINT_PROBE)
            page = context.new_page()
            page.goto(url, wait_until="commit")
            page.wait_for_function("() => window.__paintedMs !== undefined", timeout=60_000)
            painted.append(float(page.evaluate("window.__paintedMs")))
            requests.append(float(page.evaluate(
                "performance.getEntriesByType('resource').filter((e) => e.name.includes('/metrics'))"
                ".map((e) => e.duration).pop() ?? NaN")))
        finally:
            context.close()
    return painted, requests


def report(label: str, painted: list[float], requests: list[float]) -> None:
    each = ", ".join(f"{ms:.0f}" for ms in painted)
    print(f"{label}: charts and first row shown after {statistics.median(painted):.0f} ms median "
          f"(loads: {each} ms); the metrics request itself {statistics.median(requests):.0f} ms median")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="real tasks on the queue (default 2000)")
    parser.add_argument("--loads", type=int, default=5, help="page loads per measurement (default 5)")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install -y chromium)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from tests.rdq_servers import DevServer

    with tempfile.TemporaryDirectory(prefix="rdq-console-queue-") as workdir:
        storage_url = f"sqlite:///{workdir}/queue.db"
        seconds = fill(storage_url, args.tasks)
        print(f"filled {QUEUE} with {args.tasks} tasks and a day of per-minute metrics "
              f"({rollup.RETENTION_MINUTES} minutes, {len(HANDLERS)} handlers) on SQLite in {seconds:.1f} s")
        dev = DevServer(Path(workdir), storage_url=storage_url, env={"RDQ_DEV_WORKER_EVERY_SECONDS": "5"})
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                try:
                    page_url = f"{dev.url}/#/queues/{QUEUE}/tasks"
                    measure(browser, page_url, 1)  # warm the server's caches once
                    report("queue page, last hour", *measure(browser, page_url, args.loads))
                    report("queue page, last day", *measure(browser, f"{page_url}?window=day", args.loads))
                finally:
                    browser.close()
        finally:
            dev.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
