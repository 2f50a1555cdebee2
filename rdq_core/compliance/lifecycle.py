"""Lifecycle: migrate (idempotent, safe to race), a store never migrated, the store's clock."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from ..errors import SchemaMissing
from ..storage import open_storage
from ..storage.spi import Storage
from .support import new_task


class LifecycleCompliance:
    def test_migrate_is_idempotent(self, storage: Storage) -> None:
        storage.enqueue([new_task("mig")])
        storage.migrate()
        storage.migrate()
        assert storage.stats("mig").pending == 1

    def test_concurrent_migrations_of_a_new_store_all_succeed(self, storage_url: str) -> None:
        """Workers started together each run ``migrate`` (auto-migrate): none may fail."""
        stores = [open_storage(storage_url) for _ in range(4)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(stores))

        def run(store: Storage) -> None:
            barrier.wait()
            try:
                store.migrate()
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in stores]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert errors == []
            stores[0].enqueue([new_task("raced")])
            assert stores[-1].stats("raced").pending == 1
        finally:
            for store in stores:
                store.close()

    def test_a_store_never_migrated_says_to_run_migrate(self, storage_url: str) -> None:
        """Before ``migrate``, every call either works (a backend that sets itself up) or raises
        ``SchemaMissing`` naming ``rdq migrate`` -- never a driver's own error."""
        store = open_storage(storage_url)
        try:
            for call in (lambda: store.enqueue([new_task("unmigrated")]), lambda: store.stats("unmigrated"),
                         lambda: store.claim("unmigrated", 1, 30), lambda: store.get("nope")):
                try:
                    call()
                except SchemaMissing as exc:
                    assert "rdq migrate" in str(exc)
        finally:
            store.close()

    def test_clock_is_timezone_aware_utc(self, storage: Storage) -> None:
        now = storage.now()
        assert now.tzinfo is not None
        assert abs((now - datetime.now(timezone.utc)).total_seconds()) < 300
