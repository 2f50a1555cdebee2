"""The storage SPI's value types, and the shape of a store of engine documents.

A leaf: it imports only the vocabulary. ``spi.py`` re-exports the value types (the engine names
them through the SPI); ``slots.py`` and ``rollup.py``, written once over the engine documents,
take a ``DocumentStore`` instead of the ``Storage`` class, so the SPI can delegate its default
methods to them without either side importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Protocol

from ..errors import InvalidInput
from ..model import Document


@dataclass(frozen=True)
class LiveQueueStats:
    """A queue's live work (``Storage.live_stats``): what its gauges and the worker's fan-out
    read. Finished tasks (SUCCEEDED, CANCELLED) are not counted, nor read."""

    queue: str
    pending: int
    in_flight: int
    dead: int
    oldest_pending_age_seconds: float
    paused: bool = False

    @property
    def live(self) -> bool:
        """Whether the queue has any live work (pending, in flight or dead)."""
        return bool(self.pending or self.in_flight or self.dead)


class DocumentStore(Protocol):
    """What the code written once over the engine documents needs of a store (``Storage`` has
    all of it): the store's clock, the documents' compare-and-set primitives, and its queues."""

    def now(self) -> datetime:
        """The store's clock (timezone-aware UTC)."""

    def get_document(self, kind: str, key: str) -> Document | None:
        """The document, or None."""

    def put_document(self, kind: str, key: str, body: Mapping[str, Any], *,
                     expected_version: int | None) -> Document | None:
        """Compare-and-set (see ``Storage.put_document``): the stored document, or None."""

    def delete_document(self, kind: str, key: str, *, expected_version: int) -> bool:
        """Delete while the stored version is ``expected_version``; whether it was deleted."""

    def list_documents(self, kind: str, *, limit: int, after: str | None = None) -> list[Document]:
        """Documents of ``kind`` by key, after ``after``."""

    def list_queues(self) -> list[str]:
        """Names of queues that hold at least one task."""


# -- worker slots (the rules that use them: ``slots.py``) -----------------------------------------
#: The largest cap: slot numbers are written with four digits so that keys sort by number.
MAX_CAP = 9999


@dataclass(frozen=True)
class WorkerSlot:
    """A slot this caller holds: ``number`` of ``fleet``, under ``token`` until ``expires_at``."""

    fleet: str
    number: int
    token: str
    expires_at: datetime

    @property
    def key(self) -> str:
        return slot_key(self.fleet, self.number)


@dataclass(frozen=True)
class WorkerStart:
    """A *pending start*: slot ``number`` of ``fleet`` reserved under ``token`` until ``expires_at``
    for a worker being invoked; the worker takes it over with ``take_reserved_worker_slot``."""

    fleet: str
    number: int
    token: str
    expires_at: datetime

    def to_event(self) -> dict[str, Any]:
        """What the invoked worker's event carries (``from_event`` reads it back)."""
        return {"fleet": self.fleet, "slot": self.number, "token": self.token,
                "expires_at": self.expires_at.isoformat()}

    @classmethod
    def from_event(cls, value: Any) -> WorkerStart | None:
        """The reservation an event carries; None for anything else (an event is input: a
        malformed one makes its worker take a slot the ordinary way, nothing more)."""
        if not isinstance(value, Mapping):
            return None
        fleet, number, token, expires = (value.get(k) for k in ("fleet", "slot", "token", "expires_at"))
        if not (isinstance(fleet, str) and isinstance(token, str) and 0 < len(token) <= 64
                and isinstance(number, int) and not isinstance(number, bool) and 0 <= number < MAX_CAP
                and isinstance(expires, str)):
            return None
        try:
            fleet_prefix(fleet)
            at = datetime.fromisoformat(expires)
        except (InvalidInput, ValueError):
            return None
        return cls(fleet, number, token, at if at.tzinfo else at.replace(tzinfo=timezone.utc))


def fleet_prefix(fleet: str) -> str:
    """The key prefix of ``fleet``'s slots. Document keys allow ``[A-Za-z0-9._:~-]``: any other
    character (a Lambda function name may hold ``_``) is written as ``~XX`` per UTF-8 byte, and
    ``~`` itself too, so two fleet names never share a prefix."""
    if not isinstance(fleet, str) or not fleet:
        raise InvalidInput("a worker fleet is a non-empty string", field="fleet")
    encoded = "".join(
        char if (char.isascii() and (char.isalnum() or char in ".-")) else "".join(f"~{b:02X}" for b in char.encode())
        for char in fleet
    )
    prefix = f"{encoded}:"
    if len(prefix) + 4 > 200 or not prefix[0].isalnum():
        # Document keys start with a letter or digit; a fleet that would not is refused, not mangled.
        raise InvalidInput("a worker fleet name must start with a letter or digit and stay short "
                           "(at most 195 characters once encoded)", field="fleet")
    return prefix


def slot_key(fleet: str, number: int) -> str:
    return f"{fleet_prefix(fleet)}{number:04d}"
