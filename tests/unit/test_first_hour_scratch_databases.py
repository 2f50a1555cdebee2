"""The test command of the README, interrupted the ways a newcomer interrupts it: Ctrl-C, a
``timeout`` (SIGTERM), a closed terminal (SIGHUP) or ``kill -9``. The run's scratch PostgreSQL
database must not outlive it: dropped by the run's own teardown, or, when the run was killed
outright, by the next run as it starts. The README's statements about the test command are
checked here too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rdq_testing import servers
from rdq_core.compliance.support import wait_until

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()

#: A test that takes the run's scratch database, says which it is, and waits to be interrupted.
HOLDING_TEST = textwrap.dedent('''
    import os, threading
    from pathlib import Path

    def test_holds_the_scratch_database(pg_database_url):
        Path(os.environ["RDQ_TEST_HOLD_FILE"]).write_text(pg_database_url)
        threading.Event().wait(120)

    def test_quick(pg_database_url):
        Path(os.environ["RDQ_TEST_HOLD_FILE"]).write_text(pg_database_url)
''')


@pytest.fixture(scope="module")
def postgres() -> str:
    pytest.importorskip("psycopg")
    problem = servers.pg_reachable(servers.SHARED_PG_URL)
    if problem:
        servers.fail_or_skip(problem)
    return servers.SHARED_PG_URL


def database_exists(admin_url: str, name: str) -> bool:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
        return admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def start_run(tmp_path: Path, test: str) -> tuple[subprocess.Popen[str], Path]:
    """``python -m pytest`` on one test of HOLDING_TEST with the suite's fixtures, as a process of its own."""
    (tmp_path / "test_holding.py").write_text(HOLDING_TEST)
    hold = tmp_path / f"{test}.url"
    # Without the installed plugins (browser, fuzzing): they add seconds to every start and nothing here.
    env = {**os.environ, "RDQ_TEST_HOLD_FILE": str(hold), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                            "--rootdir", str(tmp_path), str(tmp_path / "test_holding.py") + f"::{test}"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return run, hold


def scratch_name(url: str) -> str:
    return url.split("?", 1)[0].rsplit("/", 1)[1]


# SIGTERM stands for all three in the quick subset: Ctrl-C is pytest's own, SIGHUP is handled as SIGTERM.
@pytest.mark.parametrize("stop", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM,
                                  pytest.param(signal.SIGHUP, marks=pytest.mark.slow)], ids=lambda s: s.name)
def test_an_interrupted_run_drops_its_scratch_database(postgres, tmp_path, stop):
    run, hold = start_run(tmp_path, "test_holds_the_scratch_database")
    try:
        url = wait_until(lambda: hold.exists() and hold.read_text(), timeout=60, what="the run's scratch database")
        name = scratch_name(url)
        assert database_exists(postgres, name)
        run.send_signal(stop)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
    assert run.returncode == 2, output  # pytest's "interrupted"
    assert not database_exists(postgres, name), f"{name} outlived the run stopped by {stop.name}:\n{output}"


def test_the_next_run_drops_the_scratch_database_of_a_run_killed_outright(postgres, tmp_path):
    killed, hold = start_run(tmp_path, "test_holds_the_scratch_database")
    try:
        url = wait_until(lambda: hold.exists() and hold.read_text(), timeout=60, what="the run's scratch database")
    finally:
        killed.kill()  # SIGKILL: no teardown runs
        killed.wait(10)
    left = scratch_name(url)
    assert re.fullmatch(r"rdq_test_[0-9a-f]{6}_%d_[0-9a-f]{12}" % killed.pid, left), left
    assert database_exists(postgres, left)
    hold.unlink()
    following, next_hold = start_run(tmp_path, "test_quick")
    output, _ = following.communicate(timeout=120)
    assert following.returncode == 0, output
    assert not database_exists(postgres, left), f"the next run left {left} behind:\n{output}"
    assert not database_exists(postgres, scratch_name(next_hold.read_text())), "the next run drops its own too"


def test_the_readme_gives_the_suites_duration_and_a_quick_subset_that_the_markers_define():
    tests_section = README.split("## Tests", 1)[1]
    assert re.search(r"`python -m pytest` runs everything \(about \d+ minutes", tests_section), "the main suite's duration"
    assert 'python -m pytest -m "not slow"' in tests_section
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^\s*"slow: ', pyproject, re.M), "the slow marker is registered"
    # One module of tests/unit and one of each kind outside it: only the first is in the quick subset.
    probes = ["tests/unit/test_retry.py", "tests/test_owned_servers.py", "tests/backends/test_sqlite_schema.py"]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                                "-p", "no:cacheprovider", "-p", "pytest_timeout", *probes], cwd=REPO,
                               env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                               capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    modules = {line.split("::", 1)[0] for line in collected.stdout.splitlines() if "::" in line}
    assert modules == {"tests/unit/test_retry.py"}, sorted(modules)
