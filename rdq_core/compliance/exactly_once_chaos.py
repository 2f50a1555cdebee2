"""Exactly-once effects under ``kill -9`` (marked ``chaos``): worker processes killed and frozen
around ``ctx.transaction()``'s COMMIT, then one row and one SUCCESS per task. The processes, the
kills and freezes and the checks of the run are ``rdq_testing.chaos.exactly_once``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdq_testing.chaos.exactly_once import run_exactly_once_chaos

from ..storage.spi import Storage
from .capabilities import Capabilities


class ExactlyOnceChaosCompliance:
    capabilities: Capabilities
    plugin_modules: tuple[str, ...]
    #: Size: each fate met this many times (on both connection paths), beside plain tasks.
    exactly_once_chaos_workers = 4
    exactly_once_chaos_per_fate = 3
    exactly_once_chaos_plain = 30

    @pytest.mark.chaos
    def test_chaos_kill_9_around_exactly_once_commits(self, storage: Storage, storage_url: str, tmp_path: Path) -> None:
        """Worker processes SIGKILLed inside ``ctx.transaction()`` before COMMIT, between the
        fenced completion and COMMIT, after COMMIT before they heard, and frozen past their
        lease until reaped (then killed, or fenced out at COMMIT): one row and one SUCCESS per
        task, no row from a fenced-out transaction, and the history checker agrees."""
        if not self.capabilities.joins_transactions:
            pytest.skip("this store does not complete tasks inside transactions (see the refusal test)")
        figures = run_exactly_once_chaos(
            storage, storage_url, tmp_path,
            workers=self.exactly_once_chaos_workers, per_fate=self.exactly_once_chaos_per_fate,
            plain=self.exactly_once_chaos_plain, plugin_modules=self.plugin_modules,
        )
        print(f"\nexactly-once chaos: {figures}")
