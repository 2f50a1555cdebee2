"""The heartbeat's ledger (rdq worker): a claim settled while a beat was on its way is not lost."""

from __future__ import annotations

import logging

from rdq_core.errors import StaleClaim
from rdq_core.hosts.process.worker import HeartbeatLedger
from rdq_core.model import ClaimRef


class RacingStore:
    """``extend_leases`` as the store answers it when some claims ended meanwhile: those are
    refused (StaleClaim, the rest applied). ``settled_meanwhile``: ended by this worker's own
    settle, which drops them from the ledger before the refusal comes back."""

    def __init__(self, refused: set[str], settled_meanwhile: set[str]) -> None:
        self.refused = refused
        self.settled_meanwhile = settled_meanwhile
        self.ledger: HeartbeatLedger | None = None

    def extend_leases(self, refs, lease_seconds):
        assert self.ledger is not None
        self.ledger.drop([ref for ref in refs if ref.task_id in self.settled_meanwhile])
        refused = sorted(ref.task_id for ref in refs if ref.task_id in self.refused)
        if refused:
            raise StaleClaim(refused)
        return {}


class Held:
    def __init__(self, task_id: str) -> None:
        self.task = type("T", (), {"id": task_id})()
        self.ref = ClaimRef(task_id, f"tok-{task_id}")


def _ledger(store: RacingStore, *ids: str) -> HeartbeatLedger:
    ledger = HeartbeatLedger(store, 30.0)  # type: ignore[arg-type]
    store.ledger = ledger
    ledger.hold([Held(task_id) for task_id in ids])  # type: ignore[list-item]
    return ledger


def test_a_claim_settled_while_the_beat_was_on_its_way_is_not_reported_lost(caplog):
    store = RacingStore(refused={"a"}, settled_meanwhile={"a"})
    ledger = _ledger(store, "a", "b")
    with caplog.at_level(logging.WARNING):
        ledger.beat()
    assert ledger.lost == set() and {ref.task_id for ref in ledger.held()} == {"b"}
    assert not [r for r in caplog.records if "lost the lease" in r.getMessage()]


def test_a_claim_still_held_when_refused_is_lost_and_no_longer_renewed(caplog):
    store = RacingStore(refused={"a", "b"}, settled_meanwhile={"a"})
    ledger = _ledger(store, "a", "b", "c")
    with caplog.at_level(logging.WARNING):
        ledger.beat()
    assert ledger.lost == {"b"} and {ref.task_id for ref in ledger.held()} == {"c"}
    assert [r.getMessage() for r in caplog.records if "lost the lease" in r.getMessage()] == [
        "lost the lease of 1 task(s); their outcome will be fenced off"]
