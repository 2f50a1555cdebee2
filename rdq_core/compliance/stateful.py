"""Model-based compliance test: random operation sequences run against the backend and against
a small reference model in plain Python, and compared after every step.

Time is the hard part of modelling a queue, so the test makes it deterministic instead of
guessing at it:

* **Due-ness.** Every delay (enqueue delay, retry delay, backoff) is either 0 or ``FAR`` (an
  hour), so a PENDING task is either claimable now or certainly not during the run.
* **Leases.** A lease is long (``LONG_LEASE``, never lapses during a run) or short
  (``short_lease/2 .. short_lease``). A short lease is *uncertain* until the clock rule has waited
  for the backend's own clock to pass it; the reaper only runs when no lease is uncertain, so
  which tasks it takes is always known.
* **Claim order among ties.** Backends stamp times at their own resolution (MongoDB: ms) and
  order ties as they like, so "oldest first" is checked against the backend's own
  ``next_attempt_at`` values, which in turn must respect the model's order of events.

Each Hypothesis example works on its own pair of fresh queues in the one migrated store and,
when it passes, deletes its tasks through the SPI on the way out (some stores count by scanning,
so leftovers would slow every later example). Hypothesis has no time limit, so the test runs it
in chunks sized from the measured cost per example until ``stateful_examples`` have run or
``stateful_budget_seconds`` is spent. ``ReferenceModel`` is plain Python and is reused by the
cross-backend differential test (``tests/backends/test_differential.py``).

The test is in three modules: the model (``stateful_model``), the rules that drive store and
model side by side (``stateful_machine``), and here the runner that binds the machine to a store
and runs Hypothesis in chunks within the budget.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ..storage import open_storage
from .stateful_machine import StorageMachine, Tally
from .stateful_model import (
    ERROR_TYPES,
    FAR,
    FAR_BACKOFF,
    HANDLERS,
    LONG_LEASE,
    NEVER_ISSUED,
    ZERO_BACKOFF,
    Lease,
    ModelTask,
    ReferenceModel,
)

log = logging.getLogger("rdq.compliance")

# Hypothesis leaves this entry point unannotated: a typed name for it spares the module an
# exemption from the strict check of untyped calls.
_run_state_machine: Callable[..., None] = run_state_machine_as_test


class StatefulCompliance:
    """The model-based test of the kit (mixed into ``StorageCompliance``)."""

    #: Hypothesis examples and the most steps per example; scale for slow or very fast stores.
    stateful_examples = 30
    stateful_steps = 30
    #: Tasks one example may hold at once; bounds what every step compares.
    stateful_max_tasks = 10
    #: Wall-clock budget. Examples run in consecutive Hypothesis runs sized from the measured cost
    #: per example, so a slow store runs fewer of them (the summary line says how many ran).
    stateful_budget_seconds = 40.0

    def test_stateful_model_matches_backend(self, storage_url: str) -> None:
        store = open_storage(storage_url)
        store.migrate()
        tally = Tally()
        longest = getattr(self, "short_lease", 0.3)  # StorageCompliance's short lease, when mixed in
        machine = type("StorageModelMachine", (StorageMachine,), {
            "store": store, "tally": tally, "max_tasks": self.stateful_max_tasks,
            "short_lease": (longest / 2, longest),
        })
        started = time.monotonic()
        try:
            # Hypothesis has no time limit, so run it in chunks: the first is a quarter of the
            # examples, each later one as many as the measured cost per example lets fit.
            chunk = max(1, math.ceil(self.stateful_examples / 4))
            while tally.examples < self.stateful_examples:
                tally.runs += 1
                _run_state_machine(machine, settings=settings(
                    max_examples=chunk,
                    stateful_step_count=self.stateful_steps,
                    deadline=None,
                    derandomize=False,
                    print_blob=True,  # a failure prints @reproduce_failure: the exact run, replayable
                    database=None,    # the kit runs in other projects' trees: leave no .hypothesis/ behind
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large],
                ))
                spent = time.monotonic() - started
                per_example = spent / max(tally.examples, 1)
                chunk = min(self.stateful_examples - tally.examples,
                            int((self.stateful_budget_seconds - spent) / per_example))
                if chunk <= 0:
                    break
        finally:
            store.close()
            summary = (f"stateful: {tally.examples} examples, {tally.steps} steps in {tally.runs} run(s),"
                       f" {time.monotonic() - started:.1f}s; rules {dict(sorted(tally.rules.items()))}")
            log.info(summary)
            print(f"\n{summary}")


__all__ = ["StatefulCompliance", "ReferenceModel", "ModelTask", "Lease", "StorageMachine",
           "FAR", "LONG_LEASE", "ZERO_BACKOFF", "FAR_BACKOFF", "HANDLERS", "ERROR_TYPES", "NEVER_ISSUED"]
