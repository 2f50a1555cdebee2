"""Helpers for tests that run rdq itself as a process: its address, and its environment.

Servers (PostgreSQL, Redis, nx-27017) are started, owned and stopped by
``rdq_core.compliance.servers``, not here.
"""

from __future__ import annotations

import re
from typing import Mapping

#: The first line ``rdq dev`` prints once it serves: its real address, so a test can start it
#: with ``--port 0`` (the kernel picks a free port at bind time) instead of guessing a free port
#: beforehand and racing every other process for it.
_DEV_BANNER = re.compile(r"rdq dev: API on http://(\S+):(\d+)\s")

#: Variables the test harness itself reads (which servers to use); never host settings.
_HARNESS_PREFIXES = ("RDQ_TEST_", "RDQ_BENCH_")


def rdq_dev_address(output: str) -> tuple[str, int] | None:
    """(host, port) from ``rdq dev``'s banner in ``output``, or None if not printed yet."""
    found = _DEV_BANNER.search(output)
    return (found.group(1), int(found.group(2))) if found else None


def rdq_settings(environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that configure an rdq host (every ``RDQ_*`` but the harness's
    own): a test that sets up a host clears these first, so the caller's shell cannot leak in.
    Derived from the prefix, not listed, so a new setting can never be missed."""
    return [name for name in environ if name.startswith("RDQ_") and not name.startswith(_HARNESS_PREFIXES)]


def without_rdq_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for an rdq subprocess, with no host setting of the caller's."""
    settings = set(rdq_settings(environ))
    return {name: value for name, value in environ.items() if name not in settings}
