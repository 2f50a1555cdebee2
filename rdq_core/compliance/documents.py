"""Engine documents: small versioned JSON documents with compare-and-set, on which the engine
keeps what is not a task (bulk operations and their per-queue locks)."""

from __future__ import annotations

import threading

import pytest

from ..errors import InvalidInput
from ..storage.spi import Storage
from .support import OpenStore


class DocumentCompliance:
    def test_insert_only_if_absent_then_replace_only_at_the_expected_version(self, storage: Storage) -> None:
        assert storage.get_document("kit", "a") is None
        first = storage.put_document("kit", "a", {"n": 1, "text": "é\udcff"}, expected_version=None)
        assert first is not None and first.version == 1 and first.body == {"n": 1, "text": "é\ufffd"}
        assert storage.put_document("kit", "a", {"n": 9}, expected_version=None) is None, "exists: no insert"
        assert storage.put_document("kit", "a", {"n": 9}, expected_version=2) is None, "stale version: no write"
        second = storage.put_document("kit", "a", {"n": 2}, expected_version=1)
        assert second is not None and second.version == 2
        stored = storage.get_document("kit", "a")
        assert stored is not None and (stored.version, stored.body) == (2, {"n": 2})
        assert storage.put_document("kit", "a", {"n": 3}, expected_version=1) is None
        assert storage.get_document("other-kind", "a") is None, "kinds are separate"

    def test_delete_only_at_the_expected_version(self, storage: Storage) -> None:
        storage.put_document("kit", "gone", {}, expected_version=None)
        assert not storage.delete_document("kit", "gone", expected_version=2)
        assert storage.get_document("kit", "gone") is not None
        assert storage.delete_document("kit", "gone", expected_version=1)
        assert storage.get_document("kit", "gone") is None
        assert not storage.delete_document("kit", "gone", expected_version=1)
        again = storage.put_document("kit", "gone", {"back": True}, expected_version=None)
        assert again is not None and again.version == 1

    def test_documents_page_by_key(self, storage: Storage) -> None:
        keys = [f"k{n:03d}" for n in (5, 1, 12, 3, 8)]
        for key in keys:
            storage.put_document("paged", key, {"key": key}, expected_version=None)
        storage.put_document("elsewhere", "k000", {}, expected_version=None)
        seen, after = [], None
        while True:
            page = storage.list_documents("paged", limit=2, after=after)
            if not page:
                break
            seen += [d.key for d in page]
            after = page[-1].key
        assert seen == sorted(keys)
        assert all(d.body == {"key": d.key} for d in storage.list_documents("paged", limit=10))

    def test_concurrent_compare_and_set_lets_exactly_one_writer_win(self, storage: Storage, open_another: OpenStore) -> None:
        storage.put_document("race", "lock", {"holder": None}, expected_version=None)
        stores = [open_another() for _ in range(4)]
        barrier = threading.Barrier(len(stores))
        wins: list[int] = []
        inserts: list[int] = []

        def contend(n: int, store: Storage) -> None:
            barrier.wait()
            if store.put_document("race", "lock", {"holder": n}, expected_version=1) is not None:
                wins.append(n)
            if store.put_document("race", f"new-{n % 2}", {"holder": n}, expected_version=None) is not None:
                inserts.append(n)

        threads = [threading.Thread(target=contend, args=(n, s)) for n, s in enumerate(stores)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(wins) == 1 and len(inserts) == 2
        stored = storage.get_document("race", "lock")
        assert stored is not None and stored.body == {"holder": wins[0]} and stored.version == 2

    def test_document_names_are_checked(self, storage: Storage) -> None:
        for kind, key in (("", "a"), ("kit", ""), ("kit", "a b"), ("kit", {"$ne": ""}), ("kit", "x" * 201)):
            with pytest.raises(InvalidInput):
                storage.get_document(kind, key)  # type: ignore[arg-type]  # deliberately wrong values
        with pytest.raises(InvalidInput):
            storage.put_document("kit", "a", {}, expected_version="1")  # type: ignore[arg-type]
