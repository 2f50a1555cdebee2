"""The no-op job every peer runs (importable by name, as RQ and Celery need)."""

from __future__ import annotations

import os

from ..common import JobCounter

COUNTER = JobCounter(os.environ.get("RDQ_BENCH_COUNTER_DIR", "/tmp"))


def noop(*args, **kwargs):
    COUNTER.start()
    COUNTER.end()
    return None
