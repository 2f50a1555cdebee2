"""The functions stay correct under LocalStack's legacy local executor, reproduced without it:

* it imports a function's entry point, then removes from ``sys.modules`` every module that import
  brought in, and runs the invocation afterwards (in a fork): rdq's lazy imports (the
  ``RDQ_HANDLERS`` modules, the storage driver) must not load a second ``rdq_core``;
* its context always answers 60000 from ``get_remaining_time_in_millis()``: a remaining time that
  does not fall, or exceeds the function timeout, must not size leases or deadlines.

These run in the default suite (no LocalStack needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rdq_core.hosts.aws_lambda.invocation import InvocationClock, ModulePin, configured_timeout

REPO = Path(__file__).resolve().parents[2]


class FrozenContext:
    """The legacy executor's context: the remaining time never falls."""

    def __init__(self, millis: int = 60000) -> None:
        self.millis = millis

    def get_remaining_time_in_millis(self) -> int:
        return self.millis


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FallingContext:
    """AWS: the remaining time is the deadline minus the (shared) clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.deadline = clock, clock.now + seconds

    def get_remaining_time_in_millis(self) -> int:
        return int((self.deadline - self.clock.now) * 1000)


def test_a_remaining_time_beyond_the_function_timeout_is_not_believed():
    clock = Clock()
    deadline = InvocationClock(FrozenContext(60000), timeout_seconds=20, clock=clock)
    assert deadline.end == 120.0 and deadline.remaining() == 20.0


def test_a_remaining_time_that_does_not_fall_gives_way_to_the_timeout_from_the_start():
    clock = Clock()
    deadline = InvocationClock(FrozenContext(60000), timeout_seconds=300, clock=clock)
    assert deadline.end == 160.0  # the first reading, as long as nothing contradicts it
    clock.now += 0.001
    assert deadline.check() == 160.0 and deadline.trusted, "too soon to tell: whole milliseconds may repeat"
    clock.now += 5.0
    assert deadline.check() == 400.0 and not deadline.trusted  # started + the configured 300 s
    assert deadline.remaining() == pytest.approx(294.999)


def test_a_falling_remaining_time_is_kept():
    clock = Clock()
    deadline = InvocationClock(FallingContext(clock, 45.0), timeout_seconds=60, clock=clock)
    clock.now += 3.0
    assert deadline.check() == 145.0 and deadline.trusted


def test_the_timeout_comes_from_the_template_else_the_hosts_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_TIMEOUT", "29")
    assert configured_timeout(60) == 60 and configured_timeout() == 29
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_TIMEOUT", "junk")
    assert configured_timeout() == 0.0
    # Unknown: the first reading, rounded up to whole seconds, is the timeout.
    assert InvocationClock(FrozenContext(29400), clock=Clock()).timeout_seconds == 30


def test_module_pin_restores_removed_modules_and_undoes_a_second_copy(monkeypatch: pytest.MonkeyPatch):
    import rdq_core.errors as errors_module

    pin = ModulePin("rdq_core.errors")
    monkeypatch.delitem(sys.modules, "rdq_core.errors")
    stranger = type(sys)("rdq_core.errors")
    assert pin.restore() >= 1 and sys.modules["rdq_core.errors"] is errors_module
    monkeypatch.setitem(sys.modules, "rdq_core.errors", stranger)
    monkeypatch.setitem(sys.modules, "rdq_core.not_ours", type(sys)("rdq_core.not_ours"))
    pin.restore()
    assert sys.modules["rdq_core.errors"] is errors_module and "rdq_core.not_ours" not in sys.modules
    assert pin.restore() == 0, "nothing to do on an ordinary host"


# The legacy executor's sequence, in a fresh interpreter: import the entry point with its folder
# on sys.path, drop every module the import added, then invoke (the fork it runs in inherits
# exactly that sys.modules). Without the pin, the worker's lazy RDQ_HANDLERS import fills a
# second registry and the task fails with "no handler"; the reaper's and API's storage driver
# would raise exceptions of a second rdq_core.errors.
LEGACY_SEQUENCE = textwrap.dedent("""
    import importlib.machinery, json, os, sys
    function_dir, function, event = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    before = set(sys.modules)
    sys.path.insert(0, function_dir)
    entry = importlib.machinery.SourceFileLoader("l_entry", os.path.join(function_dir, "app.py")).load_module()
    sys.path.remove(function_dir)
    for name in set(sys.modules) - before:
        sys.modules.pop(name)

    class Context:
        function_name = function
        memory_limit_in_mb = 512
        invoked_function_arn = "arn:aws:lambda:us-east-1:000000000000:function:" + function
        aws_request_id = "r-1"
        def get_remaining_time_in_millis(self):
            return 60000

    result = entry["lambda_handler"](event, Context()) if isinstance(entry, dict) else entry.lambda_handler(event, Context())
    print(json.dumps(result, default=str))
""")


def _invoke_like_the_legacy_executor(function: str, event: dict, env: dict[str, str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", LEGACY_SEQUENCE, str(REPO / "functions" / function), function, json.dumps(event)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_worker_runs_handlers_registered_by_a_lazily_imported_module_after_its_modules_were_removed(tmp_path: Path):
    from rdq_core import Client

    url = f"sqlite:///{tmp_path}/rdq.db"
    with Client(url) as client:
        client.storage.migrate()
        task = client.enqueue("emails", "greet", {"name": "Ada"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    env.update(RDQ_STORAGE_URL=url, RDQ_HANDLERS="rdq_core.examples", RDQ_WORKER_TIMEOUT_SECONDS="20",
               PYTHONPATH=str(REPO), POWERTOOLS_TRACE_DISABLED="1", POWERTOOLS_METRICS_DISABLED="1")
    scheduled = json.loads((REPO / "events" / "worker-scheduled.json").read_text())
    summary = _invoke_like_the_legacy_executor("worker", scheduled, env)
    assert summary["outcomes"] == {"SUCCESS": 1}, summary
    with Client(url) as client:
        done = client.get(task.id)
    assert done.status.value == "SUCCEEDED"


def test_worker_sizes_leases_and_its_deadline_by_the_timeout_when_the_remaining_time_is_frozen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from rdq_core.hosts.aws_lambda import connection, worker
    from rdq_core.hosts.aws_lambda.settings import Settings

    seen: dict[str, float] = {}

    class Recorder:
        def __init__(self, *args: object, lease_seconds: float, **kwargs: object) -> None:
            seen["lease"] = lease_seconds

    class Loop:
        def __init__(self, *args: object, deadline: float, **kwargs: object) -> None:
            seen["deadline"] = deadline

        def run(self) -> object:
            raise StopIteration

    ticks = iter(range(10_000))
    monkeypatch.setattr(worker, "BatchRunner", Recorder)
    monkeypatch.setattr(worker, "ClaimLoop", Loop)
    monkeypatch.setenv("RDQ_STORAGE_URL", f"sqlite:///{tmp_path}/rdq.db")
    settings = Settings(queues=("emails",), worker_timeout_seconds=10, lease_grace_seconds=30, auto_migrate=True)
    try:
        with pytest.raises(StopIteration):
            # Each reading of the clock is 10 ms later: time passes, the context's 60 s does not fall.
            worker.run_worker_invocation({}, FrozenContext(60000), settings, clock=lambda: next(ticks) / 100)
    finally:
        connection.close_shared_storage()
    assert seen["deadline"] == 10 - settings.settle_reserve_seconds  # started at 0: 10 s timeout, minus the reserve
    assert seen["lease"] <= 10 + 30


def test_api_answers_problems_of_its_own_rdq_core_after_its_modules_were_removed(tmp_path: Path):
    # An unknown task id raises rdq_core.errors.TaskNotFound from the lazily imported driver: it
    # must be the class the API's handlers catch (404), not a second copy's (500).
    url = f"sqlite:///{tmp_path}/rdq.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    env.update(RDQ_STORAGE_URL=url, RDQ_AUTO_MIGRATE="true", RDQ_WAKE_WORKER="false", PYTHONPATH=str(REPO),
               POWERTOOLS_TRACE_DISABLED="1", POWERTOOLS_METRICS_DISABLED="1")
    event = json.loads((REPO / "events" / "api-get-task.json").read_text())
    reply = _invoke_like_the_legacy_executor("api", event, env)
    assert reply["statusCode"] == 404, reply
