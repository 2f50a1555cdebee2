"""Counters and timings the engine reports; hosts map them to their metrics system.

The Lambda host maps these to CloudWatch EMF via Powertools; the local host keeps the counts
in memory and logs. Metric names: claimed, succeeded, retried, snoozed, dead_lettered, lease_expired,
released, stale_settlements, claim_latency_ms.
"""

from __future__ import annotations

import threading
from collections import Counter


class Telemetry:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, name: str, value: int = 1) -> None:
        if value:
            with self._lock:
                self.counts[name] += value

    def timing_ms(self, name: str, value_ms: float) -> None:
        """A latency sample; the in-memory default keeps only the last one."""
        with self._lock:
            self.counts[name] = int(value_ms)
