"""What a backend declares where backends legitimately differ; the kit holds it to the declaration.

A backend's test class sets ``capabilities = Capabilities(...)``. Everything not declared here is
the same promise for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

#: Operations whose round trips the kit measures (``Storage.round_trips``) on a batch of 1 and of 50.
OPERATIONS = ("enqueue", "claim", "extend", "release", "settle", "find_expired", "get", "list_dead",
              "stats", "redrive")


@dataclass(frozen=True)
class PerTask:
    """A budget that grows with the batch: ``fixed + each * len(batch)``. Only for a store with no
    atomic multi-task primitive for the operation (MongoDB's claim is one findAndModify per task);
    the SPI asks for a constant number per call, so every use of this is a known exception."""

    fixed: int
    each: int

    def allows(self, batch: int) -> int:
        return self.fixed + self.each * batch


Budget = Union[int, PerTask]


@dataclass(frozen=True)
class Capabilities:
    #: Round trips one call may cost, per operation in ``OPERATIONS``. An ``int`` is one bound per
    #: call, whatever the batch size: the kit measures a batch of 1 and one of 50 (for ``get``, a
    #: history of 1 and of 50 attempts) and holds both to it. An operation left out is skipped.
    round_trips: Mapping[str, Budget] = field(default_factory=dict)
    #: ``enqueue(..., connection=)`` writes inside the caller's open transaction, and a handler can
    #: complete its task inside one (``ctx.transaction()``; PostgreSQL, SQLite). Backends that
    #: cannot raise ``UnsupportedOperation`` and write nothing.
    joins_transactions: bool = False
    #: A URL of this backend with ``{port}`` where the kit puts a closed loopback port; every
    #: operation through it must raise ``StorageUnavailable`` within ``unreachable_within``
    #: seconds. None for an embedded store (SQLite) that has no server to be unreachable.
    unreachable_url: str | None = None
    unreachable_within: float = 5.0
    #: Stored JSON (payloads, results) and text may hold U+0000. PostgreSQL's jsonb and text
    #: cannot: a payload or result with one is ``InvalidInput`` and the whole call writes nothing,
    #: and error text is stored with U+FFFD in its place (diagnostics must not sink a settle).
    holds_nul: bool = True
    #: Round trips a ``settle`` or ``redrive`` may add to its budget when lifecycle events are on
    #: (``rdq_core/events.py``): 0 where the events are written by the same statement or script.
    event_round_trips: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.round_trips) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"round-trip budgets for unknown operations: {sorted(unknown)}; known: {OPERATIONS}")
