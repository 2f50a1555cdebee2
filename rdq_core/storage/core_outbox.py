"""The storage core's part for lifecycle events (``rdq_core/events.py``): which events the task
primitives write with their change, and the outbox's guards and records.
"""

from __future__ import annotations

import abc
import json
from typing import Any, Mapping, Sequence

from ..errors import InvalidInput
from ..events import EventSettings, OutboxEvent
from .codec import Record
from .core_base import CoreBase
from .guards import require_limit, require_text
from .spi import storable_json


class OutboxCore(CoreBase, abc.ABC):
    """The outbox SPI over the backend's outbox primitives."""

    # -- primitives a backend writes (one atomic store operation each) -----------------------
    @abc.abstractmethod
    def _outbox_put(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Insert outbox events (``id, type, queue, task_id, detail`` as JSON text), stamped with
        the store's clock, after every event already there; an id already there is kept."""

    @abc.abstractmethod
    def _outbox_take(self, limit: int, lease_seconds: float) -> Sequence[Record]:
        """Up to ``limit`` events whose lease is absent or past, in write order, each leased
        until now + ``lease_seconds`` in the same atomic step; records with the fields of
        ``_outbox_put`` plus ``at``."""

    @abc.abstractmethod
    def _outbox_ack(self, ids: Sequence[str]) -> int:
        """Delete these events; how many there were."""

    # -- the SPI ---------------------------------------------------------------------------
    #: Which events the task primitives write (``events``); None until configured or first read.
    _event_settings: EventSettings | None = None

    @property
    def events(self) -> EventSettings:
        """What ``_settle`` and ``_redrive`` write into the outbox with the change: read from the
        environment on first use, so every process of one deployment (worker, reaper, API, a
        producer's Client) writes the same events."""
        if self._event_settings is None:
            self._event_settings = EventSettings.from_env()
        return self._event_settings

    def configure_events(self, settings: EventSettings) -> None:
        self._event_settings = settings

    def record_events(self, events: Sequence[OutboxEvent]) -> None:
        if not self.events.enabled or not events:
            return
        for event in events:
            require_text(event.id, "id")
            require_text(event.queue, "queue")
        rows = [{"id": e.id, "type": e.type, "queue": e.queue, "task_id": e.task_id,
                 "detail": storable_json(dict(e.detail))} for e in events]
        with self.translated_errors():
            self._outbox_put(rows)

    def take_events(self, limit: int, *, lease_seconds: float) -> list[OutboxEvent]:
        require_limit(limit)
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) or not 0 < lease_seconds <= 3600:
            raise InvalidInput("lease_seconds must be a number in (0, 3600]", field="lease_seconds")
        with self.translated_errors():
            records = self._outbox_take(int(limit), float(lease_seconds))
        return [self._outbox_event(r) for r in records]

    def ack_events(self, ids: Sequence[str]) -> int:
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return 0
        for event_id in wanted:
            require_text(event_id, "ids")
        with self.translated_errors():
            return int(self._outbox_ack(wanted))

    def _outbox_event(self, record: Record) -> OutboxEvent:
        at = self.codec.time(record["at"])
        assert at is not None, "an outbox event has a time"
        detail = record.get("detail")
        if isinstance(detail, (str, bytes, bytearray)):
            detail = json.loads(detail)
        task_id = record.get("task_id")
        return OutboxEvent(id=str(record["id"]), type=str(record["type"]), queue=str(record["queue"]),
                           task_id=None if task_id in (None, "") else str(task_id), at=at, detail=dict(detail or {}))
