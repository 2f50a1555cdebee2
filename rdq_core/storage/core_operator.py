"""The storage core's part for operator reads and switches: per-queue counts (``stats``,
``live_stats``, the overview), the queue list, retention, pausing and the audit trail.
"""

from __future__ import annotations

import abc
import json
from typing import Any, Callable, Mapping, Sequence

from ..errors import InvalidInput
from ..ids import new_sequential_id
from ..model import AuditEntry, AuditPage, QueueStats, TaskStatus
from .codec import Record
from .core_base import CoreBase
from .cursors import decode_audit_cursor, encode_audit_cursor
from .guards import require_limit, require_text
from .primitives import QueueCounts
from .spi import LiveQueueStats, storable_json, storable_text


class OperatorCore(CoreBase, abc.ABC):
    """The operator SPI over the backend's counting, pausing and audit primitives."""

    # -- primitives a backend writes (one atomic store operation each) -----------------------
    @abc.abstractmethod
    def _stats(self, queue: str) -> QueueCounts:
        """Counts per status and the oldest due PENDING task's age."""

    def _live_stats(self, queue: str) -> QueueCounts:
        """``_stats`` for PENDING, IN_FLIGHT and DEAD only (other counts may be left out), read
        at a cost in proportion to those tasks. A backend whose ``_stats`` already costs that
        (counters, not scans) keeps this default."""
        return self._stats(queue)

    @abc.abstractmethod
    def _queues(self) -> Sequence[str]:
        """Names of queues that hold at least one task."""

    @abc.abstractmethod
    def _purge_finished(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` SUCCEEDED/CANCELLED tasks last updated before the cutoff."""

    @abc.abstractmethod
    def _set_paused(self, queue: str, paused: bool) -> None:
        """Record whether ``queue`` is paused. ``_claim`` of a paused queue claims nothing, checked
        in the claim's own step or before it: a claim that starts after this returns sees it."""

    @abc.abstractmethod
    def _paused(self) -> Sequence[str]:
        """Names of the paused queues."""

    @abc.abstractmethod
    def _audit_append(self, entry: Mapping[str, Any]) -> Any:
        """Store one audit entry (``id, actor, action, queue, selection`` as JSON text, ``count``),
        stamped with the store's clock; returns that time as the store keeps it."""

    @abc.abstractmethod
    def _audit_page(self, queue: str | None, before: tuple[int, str] | None, limit: int) -> Sequence[Record]:
        """Up to ``limit`` audit entries (of ``queue``, or all) newest first by ``(at, id)``,
        strictly before ``before``; records with the fields of ``_audit_append`` plus ``at``."""

    # -- the SPI ---------------------------------------------------------------------------
    def stats(self, queue: str) -> QueueStats:
        return self._queue_stats(queue, None)

    def queue_overview(self) -> list[QueueStats]:
        # The paused set is read once for all queues, not once per queue.
        paused = self.paused_queues()
        with self.translated_errors():
            names = set(self._queues()) | paused
        return [self._queue_stats(queue, paused) for queue in sorted(names)]

    def _queue_stats(self, queue: str, paused: set[str] | None) -> QueueStats:
        live, counts = self._read_counts(queue, self._stats, paused)
        return QueueStats(queue=queue, pending=live.pending, in_flight=live.in_flight, dead=live.dead,
                          succeeded=counts.get(TaskStatus.SUCCEEDED.value, 0),
                          cancelled=counts.get(TaskStatus.CANCELLED.value, 0),
                          oldest_pending_age_seconds=live.oldest_pending_age_seconds, paused=live.paused)

    def live_stats(self, queue: str) -> LiveQueueStats:
        return self._read_counts(queue, self._live_stats, None)[0]

    def _read_counts(self, queue: str, read: Callable[[str], QueueCounts], paused: set[str] | None
                     ) -> tuple[LiveQueueStats, dict[str, int]]:
        """``read``'s counts of ``queue`` as its live figures, and every count by status."""
        require_text(queue, "queue")
        with self.translated_errors():
            found = read(queue)
        counts = {str(status): int(n) for status, n in found.counts.items()}
        live = LiveQueueStats(
            queue=queue,
            pending=counts.get(TaskStatus.PENDING.value, 0),
            in_flight=counts.get(TaskStatus.IN_FLIGHT.value, 0),
            dead=counts.get(TaskStatus.DEAD.value, 0),
            oldest_pending_age_seconds=max(0.0, float(found.oldest_due_age_seconds or 0.0)),
            paused=found.paused if found.paused is not None
            else queue in (paused if paused is not None else self.paused_queues()),
        )
        return live, counts

    def list_queues(self) -> list[str]:
        with self.translated_errors():
            return sorted(set(self._queues()))

    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        if limit <= 0:
            return 0
        with self.translated_errors():
            return self._purge_finished(max(0.0, float(older_than_seconds)), int(limit))

    def set_paused(self, queue: str, paused: bool) -> None:
        require_text(queue, "queue")
        if not isinstance(paused, bool):
            raise InvalidInput("paused must be true or false", field="paused")
        with self.translated_errors():
            self._set_paused(queue, paused)

    def paused_queues(self) -> set[str]:
        with self.translated_errors():
            return set(self._paused())

    def record_audit(self, *, actor: str, action: str, queue: str, selection: Any, count: int) -> AuditEntry:
        for name, value in (("actor", actor), ("action", action), ("queue", queue)):
            require_text(value, name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidInput("count must be a non-negative integer", field="count")
        entry = {"id": new_sequential_id(), "actor": storable_text(actor)[:_AUDIT_ACTOR_CHARS], "action": action,
                 "queue": queue, "selection": storable_json(selection if selection is not None else {}),
                 "count": int(count)}
        with self.translated_errors():
            at = self._audit_append(entry)
        return self._audit_entry({**entry, "at": at})

    def list_audit(self, *, queue: str | None = None, limit: int, cursor: str | None = None) -> AuditPage:
        require_limit(limit)
        if queue is not None:
            require_text(queue, "queue")
        before = decode_audit_cursor(queue, cursor) if cursor is not None else None
        with self.translated_errors():
            records = self._audit_page(queue, before, limit + 1)
        entries = tuple(self._audit_entry(r) for r in records[:limit])
        next_cursor = None
        if len(records) > limit:
            next_cursor = encode_audit_cursor(queue, entries[-1].at, entries[-1].id)
        return AuditPage(entries=entries, next_cursor=next_cursor)

    def _audit_entry(self, record: Record) -> AuditEntry:
        at = self.codec.time(record["at"])
        assert at is not None, "an audit entry has a time"
        selection = record.get("selection")
        if isinstance(selection, (str, bytes, bytearray)):
            selection = json.loads(selection)
        return AuditEntry(id=str(record["id"]), at=at, actor=str(record["actor"]), action=str(record["action"]),
                          queue=str(record["queue"]), selection=dict(selection or {}), count=int(record["count"]))


#: An actor is an IAM principal ARN, an API key id or ``local``: kept whole up to this length.
_AUDIT_ACTOR_CHARS = 512
