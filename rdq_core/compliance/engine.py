"""The engine on this backend: the runner classifies outcomes end to end and releases what it
cannot finish before its deadline."""

from __future__ import annotations

import time

from ..engine.handlers import HandlerRegistry
from ..model import Backoff, Outcome, TaskStatus
from ..engine.retry import PolicyBook, RetryPolicy
from ..engine.outcomes import UNKNOWN_HANDLER
from ..engine.runner import BatchRunner
from ..storage.spi import Storage
from .support import enqueue_n, error_of, must_get, new_task, present


class EngineCompliance:
    def test_engine_classifies_outcomes_end_to_end(self, storage: Storage) -> None:
        from ..errors import PermanentError

        registry = HandlerRegistry()
        registry.register("ok", lambda payload, ctx: {"echo": payload, "attempt": ctx.attempt})
        registry.register("flaky", lambda payload, ctx: 1 / 0)
        registry.register("fatal", lambda payload, ctx: (_ for _ in ()).throw(PermanentError("bad input")))
        registry.register("crash", lambda payload, ctx: (_ for _ in ()).throw(SystemExit(3)))
        registry.register("weird", lambda payload, ctx: object())
        names = ["ok", "flaky", "fatal", "crash", "weird", "missing"]
        results = storage.enqueue([new_task("engine", name, {"i": name}, id=f"engine-{name}") for name in names])
        runner = BatchRunner(storage, PolicyBook(RetryPolicy(3, Backoff(60, 2, 600, 0))), registry)
        claimed = storage.claim("engine", 10, 30)
        report = runner.run(claimed)
        assert report.started == 6 and report.stale == 0
        got = {name: must_get(storage, r.task.id) for name, r in zip(names, results, strict=True)}
        assert got["ok"].status is TaskStatus.SUCCEEDED and got["ok"].result == {"echo": {"i": "ok"}, "attempt": 1}
        assert got["flaky"].status is TaskStatus.PENDING
        flaky = error_of(got["flaky"].attempts[0])
        assert flaky.type == "ZeroDivisionError" and "1 / 0" in present(flaky.stack, "the flaky attempt's stack")
        assert got["fatal"].status is TaskStatus.DEAD and got["fatal"].attempts[0].outcome is Outcome.PERMANENT_FAILURE
        assert got["crash"].status is TaskStatus.PENDING and error_of(got["crash"].attempts[0]).type == "SystemExit"
        assert got["weird"].status is TaskStatus.PENDING and error_of(got["weird"].attempts[0]).type == "rdq.InvalidResult"
        missing = got["missing"]
        assert missing.status is TaskStatus.DEAD and present(missing.last_error, "last_error").type == UNKNOWN_HANDLER

    def test_engine_releases_what_it_cannot_finish_before_the_deadline(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("slow", lambda payload, ctx: time.sleep(0.05), timeout_seconds=1.0)
        enqueue_n(storage, "deadline", 5, handler="slow")
        runner = BatchRunner(storage, registry=registry, settle_margin=0.1)
        claimed = storage.claim("deadline", 5, 30)
        report = runner.run(claimed, deadline=time.monotonic() + 1.15)
        assert (report.started, report.released) == (1, 4)
        stats = storage.stats("deadline")
        assert (stats.succeeded, stats.pending, stats.in_flight) == (1, 4, 0)
        for c in claimed[1:]:
            assert must_get(storage, c.task.id).attempt_count == 0

    def test_engine_skips_only_the_tasks_that_do_not_fit_the_deadline(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("long", lambda payload, ctx: None, timeout_seconds=60)
        registry.register("quick", lambda payload, ctx: None, timeout_seconds=0.5)
        long_id = enqueue_n(storage, "fit", 1, handler="long")[0]
        time.sleep(0.002)
        quick_ids = enqueue_n(storage, "fit", 3, handler="quick")
        runner = BatchRunner(storage, registry=registry, settle_margin=0.1)
        report = runner.run(storage.claim("fit", 10, 30), deadline=time.monotonic() + 5)
        assert (report.started, report.released) == (3, 1)
        assert must_get(storage, long_id).status is TaskStatus.PENDING and must_get(storage, long_id).attempt_count == 0
        assert all(must_get(storage, i).status is TaskStatus.SUCCEEDED for i in quick_ids)


    def test_an_attempt_starts_when_its_handler_starts_not_when_its_batch_was_claimed(self, storage: Storage) -> None:
        registry = HandlerRegistry()
        registry.register("slow", lambda payload, ctx: time.sleep(0.4), timeout_seconds=5)
        registry.register("quick", lambda payload, ctx: None, timeout_seconds=5)
        slow_id = enqueue_n(storage, "starts", 1, handler="slow")[0]
        time.sleep(0.002)
        quick_id = enqueue_n(storage, "starts", 1, handler="quick")[0]
        claimed = storage.claim("starts", 2, 30)
        assert [c.task.id for c in claimed] == [slow_id, quick_id]
        BatchRunner(storage, registry=registry, settle_margin=0.1).run(claimed)
        (slow,) = must_get(storage, slow_id).attempts
        (quick,) = must_get(storage, quick_id).attempts
        slow_start, quick_start = present(slow.started_at, "a start"), present(quick.started_at, "a start")
        assert (quick_start - slow_start).total_seconds() >= 0.35, "the quick task started after the slow one ran"
        assert quick_start <= present(quick.finished_at, "a finish")
