"""Multi-process ``kill -9`` tests (marked ``chaos``): workers and Lambda invocations killed at
random and at chosen points, then every claim, execution and kill held against the store."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..storage.spi import Storage


class ChaosCompliance:
    #: Modules the chaos workers import before ``open_storage`` (third-party backends register here).
    plugin_modules: tuple[str, ...] = ()
    #: Chaos test size (the product promise: >= 4 workers, >= 300 tasks, >= 10 kills).
    chaos_workers = 4
    chaos_tasks = 300
    chaos_kills = 10

    @pytest.mark.chaos
    def test_chaos_kill_9_workers_mid_task(self, storage: Storage, storage_url: str, tmp_path: Path) -> None:
        from rdq_testing.chaos.runs import run_chaos

        figures = run_chaos(
            storage, storage_url, tmp_path,
            workers=self.chaos_workers, tasks=self.chaos_tasks, kills=self.chaos_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nchaos: {figures}")

    #: Runner-path chaos size: ``chaos_workers`` long-running workers, killed inside claim and
    #: settle calls, with outcomes in the settle buffer, inside the heartbeat and at random.
    #: The task counts are the first batch; the queue is topped up (to 3x at most) until the
    #: last kill, so it never drains early on a fast store nor runs long on a slow one.
    chaos_runner_tasks = 120
    chaos_runner_kills = 12
    #: Lambda chaos size: warm containers running invocations, killed at markers and deadlines.
    chaos_lambda_containers = 4
    chaos_lambda_tasks = 100
    chaos_lambda_kills = 10

    @pytest.mark.chaos
    def test_chaos_kill_9_workers_on_runner_paths(self, storage: Storage, storage_url: str, tmp_path: Path) -> None:
        """``rdq worker`` processes killed inside claim and settle calls (before and after the
        store committed), with finished outcomes in the settle buffer, inside the heartbeat's
        extend, inside handlers and at random; then every claim, execution and kill is held
        against the store (``rdq_testing.chaos.history``)."""
        from rdq_testing.chaos.runs import run_runner_chaos

        figures = run_runner_chaos(
            storage, storage_url, tmp_path,
            workers=self.chaos_workers, tasks=self.chaos_runner_tasks, kills=self.chaos_runner_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nrunner chaos: {figures}")

    @pytest.mark.chaos
    def test_chaos_kill_9_lambda_invocations_at_markers_and_deadlines(
        self, storage: Storage, storage_url: str, tmp_path: Path
    ) -> None:
        """Warm Lambda worker containers running ``run_worker_invocation`` back to back, killed
        at journal markers and exactly at an invocation's deadline (Lambda's timeout, also
        under a handler that overruns it); then the same history audit."""
        from rdq_testing.chaos.runs import run_lambda_chaos

        figures = run_lambda_chaos(
            storage, storage_url, tmp_path,
            containers=self.chaos_lambda_containers, tasks=self.chaos_lambda_tasks, kills=self.chaos_lambda_kills,
            plugin_modules=self.plugin_modules,
        )
        print(f"\nlambda chaos: {figures}")
