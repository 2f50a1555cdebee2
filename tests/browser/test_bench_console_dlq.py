"""``bench/console_dlq.py`` at a tiny size: the measurement runs and prints its figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.browser.conftest import chromium_path
from tests.loopback import without_rdq_settings
from tests.rdq_servers import REPO


def test_the_dlq_measurement_runs_at_a_tiny_size() -> None:
    chromium_path()  # skipped (failed under CI) without a browser
    finished = subprocess.run([sys.executable, "-m", "bench.console_dlq", "--dead", "60", "--loads", "2"], cwd=REPO,
                              env={**without_rdq_settings(os.environ), "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "filled dlq-bench with 60 dead tasks" in finished.stdout
    figures = re.findall(r"first row shown after (\d+) ms median", finished.stdout)
    assert len(figures) == 2 and all(int(ms) > 0 for ms in figures), finished.stdout
