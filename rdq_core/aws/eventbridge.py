"""EventBridge ``PutEvents``: how the outbox's lifecycle events reach the account's event bus.

The outbox and its delivery loop are the engine's (``rdq_core/engine/outbox.py``); this module is
the one publisher that speaks to AWS: it turns an ``OutboxEvent`` into a ``PutEvents`` entry and
tells which entries EventBridge accepted.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from ..events import EventSettings, OutboxEvent

# The logger lifecycle events have always used, whichever module now writes the line.
log = logging.getLogger("rdq_core.events")

#: PutEvents takes at most this many entries per call.
PUT_EVENTS_MAX_ENTRIES = 10
#: EventBridge refuses an entry above 256 KB (Source + DetailType + Detail + …); rdq keeps each
#: entry's Detail well under it so the other fields always fit.
MAX_DETAIL_BYTES = 250_000


def detail_json(event: OutboxEvent) -> str:
    """The ``Detail`` text, under EventBridge's entry limit: a payload that would not fit is
    dropped and said so."""
    body = event.to_dict()
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_DETAIL_BYTES and "payload" in body:
        body["payload"] = None
        body["payload_omitted"] = "too large for an event"
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return text


def put_events_entry(event: OutboxEvent, settings: EventSettings) -> dict[str, Any]:
    entry: dict[str, Any] = {"Source": settings.source, "DetailType": event.type, "Detail": detail_json(event),
                             "Time": event.at}
    if settings.bus:
        entry["EventBusName"] = settings.bus
    return entry


class EventBridgePublisher:
    """``PutEvents`` with short timeouts and one botocore attempt per call: retries are
    ``deliver_events``'s (``rdq_core/engine/outbox.py``), bounded by the reaper's deadline, so a
    slow EventBridge never holds the reaper past its budget."""

    def __init__(self, settings: EventSettings, client: Any = None) -> None:
        self.settings = settings
        if client is None:
            from .clients import aws_client

            client = aws_client("events")
        self.client = client

    def publish(self, events: Sequence[OutboxEvent]) -> list[bool]:
        """Send up to ``PUT_EVENTS_MAX_ENTRIES`` events; whether each was accepted, in order."""
        reply = self.client.put_events(Entries=[put_events_entry(e, self.settings) for e in events])
        results = reply.get("Entries") or []
        # An entry without an ErrorCode was accepted (it carries an EventId).
        accepted = [not result.get("ErrorCode") and bool(result.get("EventId")) for result in results]
        if len(accepted) != len(events):
            return [False] * len(events)
        for event, result in zip(events, results, strict=True):
            if result.get("ErrorCode"):
                log.warning("event not accepted", extra={"event": event.id, "error_code": result.get("ErrorCode"),
                                                         "error_message": result.get("ErrorMessage")})
        return accepted


def publisher_from_settings(settings: EventSettings) -> EventBridgePublisher | None:
    """EventBridge when a bus is configured; None (no delivery) otherwise."""
    return EventBridgePublisher(settings) if settings.enabled and settings.bus else None
