"""A warm Lambda worker container for the chaos tests: ``run_worker_invocation`` back to back.

``python -m rdq_testing.chaos.lambda_container URL QUEUE JOURNAL [--plugin MOD] [--seed N]
[--grace S] [--budget-min S] [--budget-max S] [--dwell-ms MS] [--go-file PATH]``

Like a warm container, one process serves one invocation after another with the same shared
storage connection. Each invocation gets a fresh ``Settings`` (built here, not read from the
environment) and a context whose ``get_remaining_time_in_millis()`` counts down from a random
budget. The test kills the process -- at a journal marker, or exactly at the invocation's
deadline as Lambda's timeout would -- and starts a cold one in its place.

Storage goes through ``shared_storage``, which opens ``$RDQ_STORAGE_URL``; that URL names the
``chaosjournal:`` scheme registered below, so the container's one connection is a
``JournalingStorage`` around the real backend. The journal adds two lines to ``chaos.worker``'s::

    V <n> <ts> <deadline_ts> <budget_ms> <settle_reserve>   invocation n began
    W <n> <ts> <result...>                                  invocation n returned (or raised)
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time
import traceback
from typing import Any, Callable

from rdq_core.storage import open_storage, register_backend
from .worker import JournalingStorage, chaos_handler, chaos_process_arguments, stamp, wait_for_go

SCHEME = "chaosjournal"
#: Handler names and timeouts in a chaos Lambda container. Every one fits a 3 s invocation with
#: the largest settle reserve used (0.75 s) and the runner's 1 s settle margin.
HANDLER = "chaos-sleep"
EXTEND_HANDLER = "chaos-extend"
OVERRUN_HANDLER = "chaos-overrun"
HANDLER_TIMEOUTS = {HANDLER: 0.5, EXTEND_HANDLER: 1.0, OVERRUN_HANDLER: 0.5}
SETTLE_RESERVES = (0.0, 0.25, 0.75)
#: The worker fleet every container's invocations take their slots in (the harness watches it).
FLEET = "chaos-lambda"

_journal: dict[str, Any] = {}


class JournaledStore(JournalingStorage):
    """``open_storage("chaosjournal:<real url>")``: the real backend, journaled."""

    def __init__(self, url: str) -> None:
        super().__init__(
            open_storage(url.split(":", 1)[1]), _journal["fd"], dwell_seconds=_journal["dwell"], seed=_journal["seed"],
            arm_path=_journal["arm"],
        )
        _journal["storage"] = self


class CountdownContext:
    """The parts of a Lambda context the worker reads, with a real deadline."""

    function_name = "rdq-chaos-worker"
    function_version = "$LATEST"
    memory_limit_in_mb = 256
    invoked_function_arn = "arn:aws:lambda:us-east-1:000000000000:function:rdq-chaos-worker"

    def __init__(self, budget_seconds: float, request_id: str) -> None:
        self.aws_request_id = request_id
        self._end = time.monotonic() + budget_seconds

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._end - time.monotonic()) * 1000))


class _LazyHandler:
    """The storage is opened inside the first invocation; handlers journal through it."""

    def __init__(self) -> None:
        self._handle: Callable[[Any, Any], dict[str, Any]] | None = None

    def __call__(self, payload: Any, ctx: Any) -> Any:
        if self._handle is None:
            self._handle = chaos_handler(_journal["storage"])
        return self._handle(payload, ctx)


def main() -> None:
    parser = chaos_process_arguments()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace", type=float, default=1.0)
    parser.add_argument("--budget-min", type=float, default=3.0)
    parser.add_argument("--budget-max", type=float, default=6.0)
    # The fleet's cap (worker slots): the harness passes its container count, so invocations
    # of every live container race for the same tasks, as a fleet at its cap does.
    parser.add_argument("--fleet-cap", type=int, default=4)
    args = parser.parse_args()
    # The Lambda host reads these at import; the test process may not have set them (this
    # repository's tests/conftest.py does). Tracing off keeps the X-Ray SDK out of cold starts.
    for name, value in {
        "POWERTOOLS_TRACE_DISABLED": "1",
        "POWERTOOLS_SERVICE_NAME": "rdq",
        "POWERTOOLS_METRICS_NAMESPACE": "rdq",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    for module in args.plugin:
        importlib.import_module(module)
    _journal.update(
        fd=os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        dwell=args.dwell_ms / 1000,
        seed=args.seed,
        arm=args.journal + ".arm",
    )
    register_backend(SCHEME, f"{__name__}:JournaledStore")
    os.environ["RDQ_STORAGE_URL"] = f"{SCHEME}:{args.url}"

    from rdq_core.engine.handlers import registry
    from rdq_core.hosts.aws_lambda.settings import Settings
    from rdq_core.hosts.aws_lambda.worker import run_worker_invocation

    handle = _LazyHandler()
    for name, timeout in HANDLER_TIMEOUTS.items():
        registry.register(name, handle, timeout_seconds=timeout)
    policies = json.dumps({args.queue: {"max_attempts": 50, "backoff": {
        "initial_seconds": 0.05, "factor": 2.0, "max_seconds": 0.2, "jitter": 0.0}}})
    wait_for_go(args.go_file)
    rng = random.Random(args.seed)
    number = 0
    while True:
        number += 1
        budget = rng.uniform(args.budget_min, args.budget_max)
        reserve = rng.choice(SETTLE_RESERVES)
        settings = Settings(
            queues=(args.queue,), policies_json=policies, batch_size=args.batch,
            lease_grace_seconds=args.grace, settle_reserve_seconds=reserve,
            max_worker_concurrency=args.fleet_cap, worker_fleet=FLEET, wake_worker=False,
        )
        # The deadline the killer enforces is taken at the same instant as the context's.
        context = CountdownContext(budget, f"chaos-{args.seed}-{number}")
        deadline = time.time() + budget
        os.write(_journal["fd"], f"V {number} {stamp()} {deadline:.6f} {int(budget * 1000)} {reserve}\n".encode())
        try:
            summary = run_worker_invocation({}, context, settings)
            result = f"ok claimed={summary.get('claimed')} started={summary.get('started')} released={summary.get('released')}"
        except Exception as exc:  # noqa: BLE001 - Lambda reports it and keeps the container warm
            traceback.print_exc(file=sys.stderr)
            result = f"error {type(exc).__name__}"
        os.write(_journal["fd"], f"W {number} {stamp()} {result}\n".encode())
        time.sleep(rng.uniform(0.02, 0.12))  # the next schedule tick


if __name__ == "__main__":
    main()
