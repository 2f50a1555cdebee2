"""Worker slots: a concurrency cap the store enforces, written once over engine documents.

A fleet of workers (the invocations of one Lambda worker function) may run at most ``cap`` at
once. Each running worker holds one *slot*: the engine document ``worker-slot/<fleet>:<n>`` for a
number ``n < cap``. A slot is free when it was never taken, was freed, or its lease has expired
by the store's clock; it is taken by compare-and-set on the document's version with a fresh
random token, so two takers racing for one slot cannot both win, and renewed or freed only by
the token that took it (a holder whose lease ran out and whose slot was taken again changes
nothing). No backend writes any of this: it needs only ``get_document``, ``put_document``,
``list_documents`` and ``now`` (a ``values.DocumentStore``), so it never imports the SPI, whose
default slot methods delegate here; the slot value types live in ``values.py`` beside it.

**A lowered cap.** Slots numbered ``cap`` or above are never taken, and those still held count
against the cap until their holders end: with ``h`` of them held, only slots ``n < cap - h`` may be
taken. ``h`` only falls once the cap is lowered, so every slot held below the cap was taken when
the range was at most as wide as now: at no instant do more than ``cap`` holders run.

**Pending starts.** A starter about to invoke ``k`` workers first reserves ``k`` free slots for
them (``reserve_worker_starts``): each is the same slot document, taken the same way, marked
``start`` and leased briefly, so a reservation counts against the cap exactly as a holder does
(free = cap - held - pending) and needs no rule of its own. The invoked worker receives its
reservation in its event and turns it into its own holding (``take_reserved_worker_slot``: a
compare-and-set from the reservation's version, fenced by its token, under a fresh token); a
reservation whose invocation never ran frees itself when its short lease ends; one whose invoke
failed is given back at once (``cancel_worker_start``). Starts are decided one at a time per
fleet: the decision is taken under the fleet's *plan* document (``<fleet>:plan``, leased for
``PLAN_LEASE_SECONDS`` by the same compare-and-set), and a starter that finds it held, or written
since its listing, waits for that decision and then decides on the fleet it left (a wake-up is
never dropped because another starter was deciding on an older backlog). Within it the
starter tops the fleet up to the size it asked for, so concurrent starters never reserve more
than the largest of their requests.

**Cost.** A take lists the fleet's documents (one read), then writes one. Whether a lease has
expired is decided only by the store's clock; a clock estimate (the last ``now()`` reading plus
local time since) only spares that read when every held lease is clearly still running, so a
full fleet costs one round trip and an estimate that is off can only make a take give up early,
never take a slot that is held.
"""

from __future__ import annotations

import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from ..errors import InvalidInput, StorageUnavailable
from ..model import Document
from .values import MAX_CAP, DocumentStore, WorkerSlot, WorkerStart, fleet_prefix, slot_key

__all__ = ["MAX_CAP", "SLOT_KIND", "PLAN_SUFFIX", "WorkerSlot", "WorkerStart", "fleet_prefix", "slot_key",
           "take_worker_slot", "renew_worker_slot", "free_worker_slot", "worker_slots_held", "worker_starts_pending",
           "reserve_worker_starts", "take_reserved_worker_slot", "cancel_worker_start"]

#: The engine-document kind of worker slots.
SLOT_KIND = "worker-slot"
#: The longest lease a slot may be taken or renewed for (a day: far above any invocation).
MAX_LEASE_SECONDS = 86_400.0
#: A lease ending within this of the estimated store time is checked against the store's clock.
CLOCK_ESTIMATE_MARGIN_SECONDS = 1.0
#: Documents read per listing call.
_PAGE = 200
#: Rounds of "list, then compare-and-set" a take tries before it gives up: each lost round means
#: another taker won a slot, so a fleet that is filling up ends in "no slot" quickly.
_TAKE_ROUNDS = 3
#: The longest one starter's decision holds the fleet's plan; one that runs longer stops reserving.
PLAN_LEASE_SECONDS = 5.0
#: How long a starter waits for another's decision before giving up, and how often it looks.
PLAN_WAIT_SECONDS = 1.0
PLAN_RETRY_SECONDS = 0.02
#: The key suffix of a fleet's plan document (four characters, as long as a slot number).
PLAN_SUFFIX = "plan"


class _ClockEstimate:
    """The store's time as last read, moved on by this process's monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading: tuple[datetime, float] | None = None

    def read(self, storage: DocumentStore) -> datetime:
        now = storage.now()
        with self._lock:
            self._reading = (now, time.monotonic())
        return now

    def estimate(self) -> datetime | None:
        with self._lock:
            if self._reading is None:
                return None
            at, taken = self._reading
        return at + timedelta(seconds=time.monotonic() - taken)


# One estimate per store instance, kept beside it rather than on it (a store is the backend's).
_estimates: "weakref.WeakKeyDictionary[DocumentStore, _ClockEstimate]" = weakref.WeakKeyDictionary()
_estimates_lock = threading.Lock()


def _estimate_of(storage: DocumentStore) -> _ClockEstimate:
    with _estimates_lock:
        found = _estimates.get(storage)
        if found is None:
            found = _estimates[storage] = _ClockEstimate()
        return found


@dataclass(frozen=True)
class _Seen:
    """One slot document as listed: its number, version, holder token and lease end (micros)."""

    number: int
    version: int
    token: str | None
    expires_micros: int | None
    start: bool = False  # reserved for a worker being invoked (a pending start)


def _seen(prefix: str, document: Document, suffix_number: int | None = None) -> _Seen | None:
    suffix = document.key[len(prefix):]
    if suffix_number is None and not suffix.isdigit():
        return None
    body: Mapping[str, Any] = document.body if isinstance(document.body, Mapping) else {}
    token = body.get("token")
    expires = body.get("expires_at")
    return _Seen(int(suffix) if suffix_number is None else suffix_number, document.version,
                 token if isinstance(token, str) and token else None,
                 expires if isinstance(expires, int) and not isinstance(expires, bool) else None,
                 body.get("start") is True)


def _list_fleet(storage: DocumentStore, prefix: str) -> list[_Seen]:
    return _list_fleet_and_plan(storage, prefix)[0]


def _list_fleet_and_plan(storage: DocumentStore, prefix: str) -> tuple[list[_Seen], _Seen | None]:
    """The fleet's slots and its plan document (numbered -1), in one listing: the plan's key
    sorts after every slot's."""
    found: list[_Seen] = []
    plan: _Seen | None = None
    after = prefix  # sorts just before "<prefix>0000"
    while True:
        page = storage.list_documents(SLOT_KIND, limit=_PAGE, after=after)
        for document in page:
            if not document.key.startswith(prefix):
                return found, plan
            if document.key == prefix + PLAN_SUFFIX:
                plan = _seen(prefix, document, suffix_number=-1)
                continue
            seen = _seen(prefix, document)
            if seen is not None:
                found.append(seen)
        if len(page) < _PAGE:
            return found, plan
        after = page[-1].key


class _HeldView:
    """Which listed slots are held, judged by the store's clock, read only when it matters."""

    def __init__(self, storage: DocumentStore, slots: list[_Seen]) -> None:
        self._slots = [s for s in slots if s.token is not None]
        estimate = _estimate_of(storage).estimate()
        margin = _micros(timedelta(seconds=CLOCK_ESTIMATE_MARGIN_SECONDS))
        clearly_running = estimate is not None and all(
            s.expires_micros is not None and s.expires_micros > _to_micros(estimate) + margin for s in self._slots)
        # Every lease ends well after the estimated store time: no read needed (an estimate that is
        # wrong can only call a free slot held). Otherwise the store's clock decides.
        self.now_micros: int | None = None if clearly_running else _to_micros(_estimate_of(storage).read(storage))

    def held(self, slot: _Seen) -> bool:
        if slot.token is None:
            return False
        if self.now_micros is None:
            return True
        return slot.expires_micros is not None and slot.expires_micros > self.now_micros


def take_worker_slot(storage: DocumentStore, fleet: str, cap: int, lease_seconds: float) -> WorkerSlot | None:
    """Take a free slot ``n < cap`` of ``fleet`` for ``lease_seconds`` by the store's clock; None
    when ``cap`` slots are held (including slots at or above a lowered cap, until they end)."""
    prefix = fleet_prefix(fleet)
    cap = _require_cap(cap)
    lease = _require_lease(lease_seconds)
    for _ in range(_TAKE_ROUNDS):
        slots = _list_fleet(storage, prefix)
        view = _HeldView(storage, slots)
        by_number = {s.number: s for s in slots}
        held_above = sum(1 for s in slots if s.number >= cap and view.held(s))
        held_below = sum(1 for s in slots if s.number < cap and view.held(s))
        if held_above + held_below >= cap:
            return None
        candidates = [n for n in range(cap - held_above) if n not in by_number or not view.held(by_number[n])]
        if not candidates:
            return None
        # Takers that listed together would all try the lowest free number: start at a random
        # one, so most of them win on the first try instead of one per round.
        start = secrets.randbelow(len(candidates))
        for number in candidates[start:] + candidates[:start]:
            taken = _take(storage, fleet, prefix, number, by_number.get(number), lease, view)
            if taken is not None:
                return taken
    return None


def _take(storage: DocumentStore, fleet: str, prefix: str, number: int, seen: _Seen | None, lease: float,
          view: _HeldView) -> WorkerSlot | None:
    if view.now_micros is None:
        # The lease end is counted from the store's clock: read it (the full-fleet case needed none).
        view.now_micros = _to_micros(_estimate_of(storage).read(storage))
    token = secrets.token_hex(16)
    expires = view.now_micros + _micros(timedelta(seconds=lease))
    stored = storage.put_document(SLOT_KIND, f"{prefix}{number:04d}", {"token": token, "expires_at": expires},
                                  expected_version=None if seen is None else seen.version)
    if stored is None:
        return None  # another taker wrote first
    return WorkerSlot(fleet, number, token, _from_micros(expires))


def renew_worker_slot(storage: DocumentStore, slot: WorkerSlot, lease_seconds: float) -> WorkerSlot | None:
    """The slot with its lease set to now + ``lease_seconds``, or None when it is no longer this
    holder's (another token took it, or its lease ran out by the store's clock)."""
    lease = _require_lease(lease_seconds)
    current = _current(storage, slot)
    if current is None:
        return None
    now = _to_micros(_estimate_of(storage).read(storage))
    if current.expires_micros is None or current.expires_micros <= now:
        return None  # the slot was free from its expiry on: it must be taken again, not revived
    expires = now + _micros(timedelta(seconds=lease))
    stored = storage.put_document(SLOT_KIND, slot.key, {"token": slot.token, "expires_at": expires},
                                  expected_version=current.version)
    return None if stored is None else WorkerSlot(slot.fleet, slot.number, slot.token, _from_micros(expires))


def free_worker_slot(storage: DocumentStore, slot: WorkerSlot) -> bool:
    """Free the slot if ``slot.token`` still holds it; whether this call freed it."""
    current = _current(storage, slot)
    if current is None:
        return False
    return storage.put_document(SLOT_KIND, slot.key, {"token": None, "expires_at": None},
                                expected_version=current.version) is not None


def worker_slots_held(storage: DocumentStore, fleet: str) -> int:
    """How many of ``fleet``'s slots are held now, whatever their number (pending starts included:
    they count against the cap)."""
    slots = _list_fleet(storage, fleet_prefix(fleet))
    view = _HeldView(storage, slots)
    return sum(1 for s in slots if view.held(s))


def worker_starts_pending(storage: DocumentStore, fleet: str) -> int:
    """How many of ``fleet``'s held slots are reservations not yet taken over by their worker."""
    slots = _list_fleet(storage, fleet_prefix(fleet))
    view = _HeldView(storage, slots)
    return sum(1 for s in slots if s.start and view.held(s))


def reserve_worker_starts(storage: DocumentStore, fleet: str, cap: int, lease_seconds: float, *,
                          fleet_size: int, most: int | None = None) -> list[WorkerStart]:
    """Reserve slots for workers about to be invoked, so that ``fleet``'s held and pending slots
    reach ``min(fleet_size, cap)`` (at most ``most`` new ones); each reservation lasts
    ``lease_seconds`` unless its worker takes it over. Empty when the fleet is that big already
    or has no free slot.

    While another starter is deciding, this one waits for that decision (up to
    ``PLAN_WAIT_SECONDS``) and then decides on what it left: giving up at once would drop a
    wake-up whose backlog the other decision never saw, and the burst would wait for a tick."""
    prefix = fleet_prefix(fleet)
    cap = _require_cap(cap)
    lease = _require_lease(lease_seconds)
    fleet_size = _require_count(fleet_size, "fleet_size")
    limit = MAX_CAP if most is None else _require_count(most, "most")
    give_up_at = time.monotonic() + PLAN_WAIT_SECONDS
    while True:
        reserved = _reserve_once(storage, prefix, fleet, cap, lease, fleet_size, limit)
        if reserved is not None:
            return reserved
        if time.monotonic() >= give_up_at:
            return []  # the plan stayed held (a starter that died deciding): its lease ends it
        time.sleep(PLAN_RETRY_SECONDS)


def _reserve_once(storage: DocumentStore, prefix: str, fleet: str, cap: int, lease: float, fleet_size: int,
                  limit: int) -> list[WorkerStart] | None:
    """One decision under the fleet's plan; None when another starter holds the plan."""
    slots, plan = _list_fleet_and_plan(storage, prefix)
    view = _HeldView(storage, slots)
    by_number = {s.number: s for s in slots}
    held_above = sum(1 for s in slots if s.number >= cap and view.held(s))
    busy = sum(1 for s in slots if view.held(s))
    wanted = min(min(fleet_size, cap) - busy, limit)
    # Lowest numbers first: a taker of a free slot picks at random, so it seldom wants the same one.
    candidates = [n for n in range(cap - held_above) if n not in by_number or not view.held(by_number[n])]
    if wanted <= 0 or not candidates:
        return []  # a full or big-enough fleet costs one read
    if view.now_micros is None:
        view.now_micros = _to_micros(_estimate_of(storage).read(storage))
    now = view.now_micros
    if plan is not None and plan.token is not None and plan.expires_micros is not None and plan.expires_micros > now:
        return None  # another starter is deciding
    decided_by = time.monotonic() + PLAN_LEASE_SECONDS / 2
    plan_token = secrets.token_hex(16)
    plan_expires = now + _micros(timedelta(seconds=PLAN_LEASE_SECONDS))
    planning = storage.put_document(SLOT_KIND, prefix + PLAN_SUFFIX, {"token": plan_token, "expires_at": plan_expires},
                                    expected_version=None if plan is None else plan.version)
    if planning is None:
        return None  # another starter took the plan since the listing
    reserved: list[WorkerStart] = []
    try:
        expires = now + _micros(timedelta(seconds=lease))
        for number in candidates:
            # A decision that outlives half its plan lease stops: the plan may soon pass to another.
            if len(reserved) >= wanted or time.monotonic() >= decided_by:
                break
            token = secrets.token_hex(16)
            seen = by_number.get(number)
            stored = storage.put_document(SLOT_KIND, f"{prefix}{number:04d}",
                                          {"token": token, "expires_at": expires, "start": True},
                                          expected_version=None if seen is None else seen.version)
            if stored is not None:  # otherwise a taker won it since the listing
                reserved.append(WorkerStart(fleet, number, token, _from_micros(expires)))
    finally:
        try:
            storage.put_document(SLOT_KIND, prefix + PLAN_SUFFIX, {"token": None, "expires_at": None},
                                 expected_version=planning.version)
        except StorageUnavailable:
            pass  # the plan's lease ends it; the reservations made stand
    return reserved


def take_reserved_worker_slot(storage: DocumentStore, start: WorkerStart, lease_seconds: float) -> WorkerSlot | None:
    """Turn the reservation ``start`` into a slot held for ``lease_seconds`` under a fresh token;
    None when it is no longer pending under ``start.token`` (taken over, cancelled, or its lease
    ran out by the store's clock: the worker then takes a slot the ordinary way)."""
    lease = _require_lease(lease_seconds)
    seen = _pending(storage, start)
    if seen is None:
        return None
    now = _to_micros(_estimate_of(storage).read(storage))
    if seen.expires_micros is None or seen.expires_micros <= now:
        return None  # a free slot now: taken, if at all, under the cap's rules like any other
    token = secrets.token_hex(16)
    expires = now + _micros(timedelta(seconds=lease))
    stored = storage.put_document(SLOT_KIND, slot_key(start.fleet, start.number), {"token": token, "expires_at": expires},
                                  expected_version=seen.version)
    return None if stored is None else WorkerSlot(start.fleet, start.number, token, _from_micros(expires))


def cancel_worker_start(storage: DocumentStore, start: WorkerStart) -> bool:
    """Give back a reservation whose worker will not come (its invoke failed); whether this freed
    it. Fenced by the token: a reservation its worker has taken over is that worker's."""
    seen = _pending(storage, start)
    if seen is None:
        return False
    return storage.put_document(SLOT_KIND, slot_key(start.fleet, start.number), {"token": None, "expires_at": None},
                                expected_version=seen.version) is not None


def _pending(storage: DocumentStore, start: WorkerStart) -> _Seen | None:
    """The stored slot while it is still the reservation ``start`` (the token is the fence)."""
    prefix = fleet_prefix(start.fleet)
    document = storage.get_document(SLOT_KIND, f"{prefix}{start.number:04d}")
    seen = None if document is None else _seen(prefix, document)
    return seen if seen is not None and seen.start and seen.token == start.token else None


def _current(storage: DocumentStore, slot: WorkerSlot) -> _Seen | None:
    """The stored slot while ``slot.token`` holds it, else None (the token is the fence)."""
    prefix = fleet_prefix(slot.fleet)
    document = storage.get_document(SLOT_KIND, f"{prefix}{slot.number:04d}")
    seen = None if document is None else _seen(prefix, document)
    return seen if seen is not None and seen.token is not None and seen.token == slot.token else None


def _require_cap(cap: Any) -> int:
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_CAP:
        raise InvalidInput(f"cap must be an integer in 1..{MAX_CAP}", field="cap")
    return cap


def _require_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CAP:
        raise InvalidInput(f"{field} must be an integer in 0..{MAX_CAP}", field=field)
    return value


def _require_lease(lease_seconds: Any) -> float:
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) \
            or not 0 < lease_seconds <= MAX_LEASE_SECONDS:
        raise InvalidInput(f"lease_seconds must be a number in (0, {MAX_LEASE_SECONDS:g}]", field="lease_seconds")
    return float(lease_seconds)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _micros(delta: timedelta) -> int:
    return delta // timedelta(microseconds=1)


def _to_micros(value: datetime) -> int:
    return _micros(value - _EPOCH)


def _from_micros(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)
