"""``StorageCompliance``: the whole kit, composed from one module per resource. Each test names
one promise of the storage SPI (see ``spi.py``); a backend's test class subclasses this, gives a
``storage_url`` fixture and declares its ``capabilities`` where backends legitimately differ.

| module                | promises about                                                      |
| --------------------- | ------------------------------------------------------------------- |
| ``lifecycle.py``      | migrate, a store never migrated, the clock                          |
| ``enqueue.py``        | fields, batches, idempotency, delays, ``connection=``               |
| ``claim.py``          | order, limits, leases and tokens, concurrent claimers               |
| ``fencing.py``        | settle, extend, release: fencing, partial batches, what is recorded |
| ``leases.py``         | lease expiry, the reaper, the expired-lease scan                    |
| ``history.py``        | attempt numbering through retries, reaping, dead-lettering, redrive |
| ``dlq.py``            | paging, filters, cursors, redrive, purge                            |
| ``operator.py``       | get, cancel, stats, queues, retention                               |
| ``browsing.py``       | listings by status, counts, cancel by filter, pause, the audit trail |
| ``charts.py``         | the console's per-minute metrics: outcomes, depth, latency, retention |
| ``documents.py``      | engine documents: compare-and-set, delete, paging               |
| ``operations_lock.py`` | bulk operations: one per queue under racing starters, the finished event |
| ``worker_slots.py``   | worker slots: a fleet's cap under racing threads and processes, leases, fencing |
| ``outbox.py``         | lifecycle events: written with the change, leased, acked, ordered   |
| ``flow_control.py``  | priority, aging, concurrency and rate limits, fair groups           |
| ``progress.py``       | a due, allowed task is claimed whatever blocked work is ahead of it |
| ``dedupe_snooze.py``  | snooze without spending budget, retry_on / dead_on              |
| ``bounds.py``         | round-trip budgets, an unreachable server                           |
| ``engine.py``         | the runner on this backend                                          |
| ``runner_paths.py``   | the runner's own paths (buffers, heartbeats, deadlines)             |
| ``exactly_once.py``   | ``ctx.transaction()``: effects and completion commit together, fenced |
| ``exactly_once_chaos.py`` | ``ctx.transaction()`` under kill -9 and freezes (marked ``chaos``) |
| ``stateful.py``       | the model-based test (its model and rules: ``stateful_model.py``, ``stateful_machine.py``) |
| ``chaos_compliance.py`` | multi-process kill -9 runs (marked ``chaos``)                     |

The chaos tests drive processes they start and kill (``rdq_testing.chaos``): test support
outside the runtime package, like the servers the tests start (``rdq_testing.servers``).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from ..storage import open_storage
from ..storage.spi import Storage
from .bounds import BoundsCompliance
from .browsing import BrowsingCompliance
from .charts import ChartsCompliance
from .dedupe_snooze import DedupeSnoozeCompliance
from .documents import DocumentCompliance
from .capabilities import Capabilities
from .chaos_compliance import ChaosCompliance
from .claim import ClaimCompliance
from .dlq import DeadLetterCompliance
from .engine import EngineCompliance
from .exactly_once import ExactlyOnceCompliance
from .exactly_once_chaos import ExactlyOnceChaosCompliance
from .flow_control import FlowControlCompliance
from .enqueue import EnqueueCompliance
from .fencing import FencingCompliance
from .history import HistoryCompliance
from .leases import LeaseCompliance
from .lifecycle import LifecycleCompliance
from .live_stats import LiveStatsCompliance
from .operations_lock import OperationLockCompliance
from .operator import OperatorCompliance
from .outbox import OutboxCompliance
from .progress import ProgressCompliance
from .runner_paths import RunnerPathsCompliance
from .stateful import StatefulCompliance
from .support import OpenStore
from .worker_slots import WorkerSlotCompliance


class StorageCompliance(
    LifecycleCompliance,
    EnqueueCompliance,
    ClaimCompliance,
    FencingCompliance,
    LeaseCompliance,
    HistoryCompliance,
    DeadLetterCompliance,
    OperatorCompliance,
    BrowsingCompliance,
    ChartsCompliance,
    DocumentCompliance,
    OperationLockCompliance,
    WorkerSlotCompliance,
    LiveStatsCompliance,
    OutboxCompliance,
    FlowControlCompliance,
    ProgressCompliance,
    DedupeSnoozeCompliance,
    BoundsCompliance,
    EngineCompliance,
    StatefulCompliance,
    RunnerPathsCompliance,
    ExactlyOnceCompliance,
    ChaosCompliance,
    ExactlyOnceChaosCompliance,
):
    """Subclass this and provide a ``storage_url`` fixture (fresh, isolated, empty store)."""

    #: Where this backend legitimately differs from others (see ``capabilities.py``).
    capabilities = Capabilities()
    #: Short leases used by expiry tests; raise for slow stores.
    short_lease = 0.3

    @pytest.fixture
    def storage_url(self) -> Iterator[str]:  # pragma: no cover - the backend's test provides it
        raise NotImplementedError("a backend's compliance test class must define a storage_url fixture")

    @pytest.fixture
    def storage(self, storage_url: str) -> Iterator[Storage]:
        store = open_storage(storage_url)
        store.migrate()
        yield store
        store.close()

    @pytest.fixture
    def open_another(self, storage_url: str, storage: Storage) -> Iterator[OpenStore]:
        """Opens further, independent connections to the same store (closed at teardown)."""
        opened: list[Storage] = []

        def factory() -> Storage:
            store = open_storage(storage_url)
            opened.append(store)
            return store

        yield factory
        for store in opened:
            store.close()
