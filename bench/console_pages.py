"""What the console benchmarks share: a real ``rdq dev`` on a filled SQLite store, the system's
Chromium, and the median of several fresh page loads, each timed from navigation start to the
moment the page's own probe says its content is painted."""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def measure(browser: Any, url: str, loads: int, *, probe: str, painted_var: str,
            request_fragment: str) -> tuple[list[float], list[float]]:
    """(navigation start -> ``window[painted_var]`` set by ``probe``, duration of the last request
    whose URL holds ``request_fragment``) in ms, one pair per fresh load."""
    painted, requests = [], []
    for _ in range(loads):
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        try:
            context.add_init_script(probe)
            page = context.new_page()
            page.goto(url, wait_until="commit")
            page.wait_for_function(f"() => window.{painted_var} !== undefined", timeout=60_000)
            painted.append(float(page.evaluate(f"window.{painted_var}")))
            requests.append(float(page.evaluate(
                f"performance.getEntriesByType('resource').filter((e) => e.name.includes({request_fragment!r}))"
                ".map((e) => e.duration).pop() ?? NaN")))
        finally:
            context.close()
    return painted, requests


def report(label: str, shown: str, request: str, painted: list[float], requests: list[float]) -> None:
    each = ", ".join(f"{ms:.0f}" for ms in painted)
    print(f"{label}: {shown} after {statistics.median(painted):.0f} ms median (loads: {each} ms); "
          f"the {request} request itself {statistics.median(requests):.0f} ms median")


@contextmanager
def console_on_filled_store(name: str, fill: Callable[[str], None]) -> Iterator[tuple[Any, str] | None]:
    """``(browser, rdq dev's URL)`` on a temporary SQLite store that ``fill(storage_url)`` filled;
    None (after saying why) when Chromium is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install -y chromium)", file=sys.stderr)
        yield None
        return
    from playwright.sync_api import sync_playwright

    from tests.rdq_servers import DevServer

    with tempfile.TemporaryDirectory(prefix=f"rdq-console-{name}-") as workdir:
        storage_url = f"sqlite:///{workdir}/{name}.db"
        fill(storage_url)
        dev = DevServer(Path(workdir), storage_url=storage_url, env={"RDQ_DEV_WORKER_EVERY_SECONDS": "5"})
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                try:
                    yield browser, dev.url
                finally:
                    browser.close()
        finally:
            dev.stop()
