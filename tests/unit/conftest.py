"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from rdq_core.storage import open_storage


@pytest.fixture
def storage(tmp_path):
    """A migrated SQLite store of the test's own (the embedded default), closed afterwards."""
    store = open_storage(f"sqlite:///{tmp_path}/rdq.db")
    store.migrate()
    yield store
    store.close()
