"""One process of the flow-control benchmark (``bench/flow.py``), run with a chosen tree first
on ``PYTHONPATH`` so the same harness measures rdq before and after flow control.

``python bench/flow_worker.py prepare URL CASE N``: migrate the store, enqueue N no-op tasks
shaped for CASE, print ``ok``.
``python bench/flow_worker.py drain URL CASE BATCH``: print ``ready``, wait for ``go``, then claim
(under CASE's flow policy) and settle SUCCEEDED until a claim comes back empty; print one JSON line.
Only the claim and the settle are timed: no handler, no host, so the claim's own cost shows.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from rdq_core.model import NewTask, Outcome, Settlement, TaskStatus
from rdq_core.storage import open_storage

QUEUE = "flowbench"
#: Each case: the task fields it sets and the queue policy its claims run under (None: no policy,
#: the claim as it was before flow control).
CASES: dict[str, dict[str, Any]] = {
    "off": {"policy": None},
    "priorities": {"policy": None},
    "many_keys": {"policy": {"concurrency_limit": 1}},
    "hot_key": {"policy": {"concurrency_limit": 4}},
}


def fields(case: str, n: int) -> dict[str, Any]:
    if case == "priorities":
        return {"priority": random.Random(n).randrange(10)}
    if case == "many_keys":
        return {"concurrency_key": f"k{n}"}
    if case == "hot_key":
        return {"concurrency_key": "hot"}
    return {}


def prepare(url: str, case: str, n: int) -> None:
    storage = open_storage(url)
    storage.migrate()
    for start in range(0, n, 500):
        storage.enqueue([NewTask(id=f"t{i:07d}", queue=QUEUE, handler="noop", payload={"n": i}, **fields(case, i))
                         for i in range(start, min(n, start + 500))])
    storage.close()
    print("ok", flush=True)


def drain(url: str, case: str, batch: int) -> None:
    storage = open_storage(url)
    storage.now()  # connect before the clock starts
    policy = CASES[case]["policy"]
    args: tuple[Any, ...] = ()
    if policy is not None:
        from rdq_core.flow import flow_policy_from_config  # only in a tree with flow control

        args = (flow_policy_from_config(policy),)
    # The barrier handshake written out (not bench.common.ready_then_go): this script runs with
    # an older tree first on PYTHONPATH, whose bench package may not have it.
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    trips = storage.round_trips
    first = last = time.time()
    tasks = claims = empty = 0
    claim_seconds = 0.0
    while True:
        began = time.perf_counter()
        claimed = storage.claim(QUEUE, batch, 30.0, *args)
        claim_seconds += time.perf_counter() - began
        claims += 1
        if not claimed:
            # Under a limit, an empty claim can mean "all slots busy" while tasks remain.
            if storage.stats(QUEUE).pending == 0:
                break
            empty += 1
            continue
        storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed])
        tasks += len(claimed)
        last = time.time()
    print(json.dumps({"tasks": tasks, "first": first, "last": last, "claims": claims, "empty_claims": empty,
                      "claim_seconds": claim_seconds, "round_trips": storage.round_trips - trips}), flush=True)
    storage.close()


if __name__ == "__main__":
    command, url, case, number = sys.argv[1:5]
    (prepare if command == "prepare" else drain)(url, case, int(number))
