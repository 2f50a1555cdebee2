"""The console in a real browser: Playwright's Python API driving the system's chromium (never a
browser Playwright downloads), against ``rdq dev`` and ``rdq console`` subprocesses.

Without chromium or Playwright the tests skip locally with the reason and fail under ``CI``
(``.ci/run`` installs chromium). Screenshots of every view at 1280×800 and 375×740 go to
``tests/browser/artifacts/`` (not committed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_testing.servers import fail_or_skip, stop_process
from rdq_core.compliance.support import wait_until
from tests.loopback import without_rdq_settings
from tests.rdq_servers import REPO, DevServer, dev_server

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
HANDLERS = "tests.browser.console_handlers"
FAILURE_TYPE = "tests.browser.console_handlers.PipelineBroken"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}
#: How long any one browser-side condition may take (a worker cycle is 0.3 s here).
WAIT_MS = 20_000


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        fail_or_skip("chromium is not installed (apt-get install -y chromium); the browser tests need it")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        fail_or_skip("playwright is not installed (python -m pip install -e '.[dev]')")
        raise
    executable = chromium_path()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


#: Visible form controls and buttons without an accessible name, as short descriptions.
UNNAMED_CONTROLS = """() => [...document.querySelectorAll('input, select, textarea, button')]
  .filter((c) => c.getClientRects().length > 0 || c.closest('dialog[open]'))
  .filter((c) => !((c.labels && c.labels.length) || c.getAttribute('aria-label')
                  || c.getAttribute('aria-labelledby') || (c.tagName === 'BUTTON' && c.textContent.trim())))
  .map((c) => c.outerHTML.slice(0, 120))"""


class Page:
    """One browser page with the helpers the scenarios share; records script errors."""

    def __init__(self, browser: Any, base_url: str, query: str = "") -> None:
        self.context = browser.new_context(viewport=DESKTOP)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.base_url = base_url
        self.query = query  # rdq console's ?token=…: the page keeps it and takes it out of the address
        self.script_errors: list[str] = []
        self.page.on("pageerror", lambda error: self.script_errors.append(str(error)))
        self.page.on("console", self._console_message)

    def _console_message(self, message: Any) -> None:
        # A Content-Security-Policy violation is only a console message: count it as a script error.
        if message.type == "error" and "Content Security Policy" in message.text:
            self.script_errors.append(message.text)

    def open(self, route: str) -> Any:
        self.page.goto(f"{self.base_url}/{self.query}#{route}")
        return self.page

    def shoot(self, name: str) -> None:
        """Screenshots at 1280×800 and 375×740; at phone width the page must not scroll sideways.
        Every visible control must have an accessible name (a label, or text for a button)."""
        unnamed = self.page.evaluate(UNNAMED_CONTROLS)
        assert unnamed == [], f"{name}: controls without a label: {unnamed}"
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}-1280x800.png"), full_page=True)
        self.page.set_viewport_size(PHONE)
        try:
            widths = self.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert widths[0] <= widths[1], f"{name}: the page scrolls sideways at 375 px ({widths[0]} px wide)"
            self.page.screenshot(path=str(ARTIFACTS / f"{name}-375x740.png"), full_page=True)
        finally:
            self.page.set_viewport_size(DESKTOP)

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """rdq dev without a token (loopback Host only), the console handlers, SQLite in a tmp dir."""
    with dev_server(tmp_path_factory.mktemp("console-dev"), handlers=HANDLERS) as server:
        yield server


@pytest.fixture
def page(browser: Any, dev: DevServer) -> Iterator[Page]:
    opened = Page(browser, dev.url)
    try:
        yield opened
        assert opened.script_errors == [], f"script errors in the page: {opened.script_errors}"
    finally:
        opened.close()


_numbers = iter(range(1, 100_000))


def fresh_queue(stem: str) -> str:
    return f"{stem}-{os.getpid()}-{next(_numbers)}"


def call(base_url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request to an rdq API (or the console) from the test itself: (status, JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base_url}{path}", data=data, method=method,
                                     headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            return error.code, json.loads(raw) if raw else None
        except ValueError:
            return error.code, raw.decode(errors="replace")


def task_status(base_url: str, task_id: str) -> str:
    status, task = call(base_url, "GET", f"/v1/tasks/{task_id}")
    assert status == 200, task
    return str(task["status"])


def wait_status(base_url: str, task_id: str, wanted: str, timeout: float = 20) -> None:
    wait_until(lambda: task_status(base_url, task_id) == wanted, timeout, interval=0.1, what=f"{task_id} {wanted}")


class ConsoleProcess:
    """``rdq console --api URL --port 0 …`` (or, with ``global_api``, ``rdq --api URL console …``)
    as a subprocess this test owns."""

    _BANNER = re.compile(r"rdq console: http://127\.0\.0\.1:(\d+)/\?token=([A-Za-z0-9_-]+)\n")

    def __init__(self, workdir: Path, api_url: str, *options: str, env: dict[str, str] | None = None,
                 global_api: bool = False) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # No AWS setting of the caller's: only the credentials this test gives.
        environ = {name: value for name, value in without_rdq_settings(os.environ).items() if not name.startswith("AWS_")}
        environ.update({"PYTHONPATH": str(REPO), "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true", **(env or {})})
        self.out, self.err = workdir / "console.out", workdir / "console.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            api = ["--api", api_url]
            command = [*api, "console"] if global_api else ["console", *api]
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rdq_core.hosts.cli", *command, "--port", "0", *options],
                cwd=workdir, env=environ, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

        def ready() -> int | None:
            if self.process.poll() is not None:
                raise AssertionError(f"rdq console exited: {self.out.read_text()}{self.err.read_text()[-2000:]}")
            found = self._BANNER.search(self.out.read_text(errors="replace"))
            return (int(found.group(1)), found.group(2)) if found else None

        self.port, self.token = wait_until(ready, 30, what="rdq console's banner")
        self.url = f"http://127.0.0.1:{self.port}"
        #: What the page sends to prove it is the operator's (the token in the printed address).
        self.auth = {"Authorization": f"Bearer {self.token}"}

    def page(self, browser: Any) -> "Page":
        """A browser page opened the way the operator opens it: the printed address, with its token."""
        return Page(browser, self.url, query=f"?token={self.token}")

    def stop(self) -> None:
        stop_process(self.process, timeout=10)
