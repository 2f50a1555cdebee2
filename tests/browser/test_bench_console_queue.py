"""``bench/console_queue.py`` at a small size: the measurement runs and prints its figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.browser.conftest import chromium_path
from tests.loopback import without_rdq_settings
from tests.rdq_servers import REPO


def test_the_queue_page_measurement_runs_at_a_small_size() -> None:
    chromium_path()  # skipped (failed under CI) without a browser
    finished = subprocess.run([sys.executable, "-m", "bench.console_queue", "--tasks", "100", "--loads", "1"], cwd=REPO,
                              env={**without_rdq_settings(os.environ), "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "filled orders with 100 tasks and a day of per-minute metrics (1440 minutes" in finished.stdout
    figures = re.findall(r"charts and first row shown after (\d+) ms median", finished.stdout)
    assert len(figures) == 2 and all(int(ms) > 0 for ms in figures), finished.stdout
