"""Live stats on this store: ``live_stats`` counts a queue's PENDING, IN_FLIGHT and DEAD tasks,
gives the oldest due age and the paused flag exactly as ``stats`` does, and leaves finished
tasks out; bad input is refused as ``stats`` refuses it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from ..errors import InvalidInput
from ..storage.spi import LiveQueueStats, Storage
from .support import dead_letter, enqueue_n, success


class LiveStatsCompliance:
    def test_live_stats_count_live_work_and_agree_with_stats(self, storage: Storage) -> None:
        assert storage.live_stats("live") == LiveQueueStats("live", 0, 0, 0, 0.0, False)
        assert not storage.live_stats("live").live
        dead_letter(storage, "live", 3)
        enqueue_n(storage, "live", 8)
        enqueue_n(storage, "live", 2, delay_seconds=3600)  # pending, not due
        claimed = storage.claim("live", 4, 30)
        storage.settle([success(c) for c in claimed[:2]])
        storage.cancel(enqueue_n(storage, "live", 1, delay_seconds=3600)[0])
        time.sleep(0.3)
        live, full = storage.live_stats("live"), storage.stats("live")
        assert (live.pending, live.in_flight, live.dead) == (4 + 2, 2, 3)
        assert (full.succeeded, full.cancelled) == (2, 1), "the finished tasks are there, and not counted"
        assert (live.pending, live.in_flight, live.dead) == (full.pending, full.in_flight, full.dead)
        assert 0.25 <= live.oldest_pending_age_seconds < 60 and live.live and not live.paused
        assert abs(live.oldest_pending_age_seconds - full.oldest_pending_age_seconds) < 5

    def test_a_queue_with_only_finished_work_has_no_live_work(self, storage: Storage) -> None:
        enqueue_n(storage, "finished-only", 3)
        storage.settle([success(c) for c in storage.claim("finished-only", 3, 30)])
        storage.cancel(enqueue_n(storage, "finished-only", 1)[0])
        live = storage.live_stats("finished-only")
        assert (live.pending, live.in_flight, live.dead, live.oldest_pending_age_seconds) == (0, 0, 0, 0.0)
        assert not live.live
        assert storage.stats("finished-only").succeeded == 3, "stats still counts them"

    def test_live_stats_read_the_oldest_due_age_and_the_paused_flag(self, storage: Storage) -> None:
        enqueue_n(storage, "live-age", 1, run_at=storage.now() - timedelta(hours=2))
        assert 7000 < storage.live_stats("live-age").oldest_pending_age_seconds < 7300
        storage.set_paused("live-age", True)
        assert storage.live_stats("live-age").paused and storage.live_stats("live-age").pending == 1
        storage.set_paused("live-age", False)
        assert not storage.live_stats("live-age").paused
        for bad in (7, None, {"$gt": ""}):
            with pytest.raises(InvalidInput):
                storage.live_stats(bad)  # type: ignore[arg-type]  # deliberately wrong values
