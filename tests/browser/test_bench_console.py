"""The console benchmarks (``bench/console_dlq.py``, ``bench/console_queue.py``) at a small size:
each measurement runs and prints its figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.browser.conftest import chromium_path
from tests.loopback import without_rdq_settings
from tests.rdq_servers import REPO


@pytest.mark.parametrize(("module", "arguments", "filled", "shown"), [
    ("bench.console_dlq", ["--dead", "60", "--loads", "2"], "filled dlq-bench with 60 dead tasks", "first row shown"),
    ("bench.console_queue", ["--tasks", "100", "--loads", "1"],
     "filled orders with 100 tasks and a day of per-minute metrics (1440 minutes", "charts and first row shown"),
], ids=["dlq", "queue"])
def test_the_console_measurement_runs_at_a_small_size(module: str, arguments: list[str], filled: str, shown: str) -> None:
    chromium_path()  # skipped (failed under CI) without a browser
    finished = subprocess.run([sys.executable, "-m", module, *arguments], cwd=REPO,
                              env={**without_rdq_settings(os.environ), "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert filled in finished.stdout
    figures = re.findall(rf"{shown} after (\d+) ms median", finished.stdout)
    assert len(figures) == 2 and all(int(ms) > 0 for ms in figures), finished.stdout
