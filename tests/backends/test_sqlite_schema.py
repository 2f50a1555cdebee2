"""The SQLite schema file is what the migrations build: every file under ``migrations/`` applied
by the backend to one fresh database, ``schema.sql`` to another, and the catalogs compared."""

from __future__ import annotations

import sqlite3
from importlib import resources

from rdq_core.storage.querytext import migrations
from rdq_core.storage.sqlite import SQLiteStorage

PACKAGE = "rdq_core.storage.sqlite"


def catalog(path) -> dict:
    """Everything the schema declares: objects and their normalised SQL, each table's columns
    (type, default, nullability, key), foreign keys, and each index's columns, uniqueness and
    partial predicate; and the migration version the file records."""
    conn = sqlite3.connect(path)
    try:
        objects = {
            (kind, name): (table, " ".join((sql or "").split()))
            for kind, name, table, sql in conn.execute(
                "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            )
        }
        tables = sorted(name for kind, name in objects if kind == "table")
        found = {"objects": objects, "user_version": conn.execute("PRAGMA user_version").fetchone()[0]}
        for table in tables:
            found[f"{table} columns"] = conn.execute(f"PRAGMA table_xinfo({table})").fetchall()
            found[f"{table} foreign keys"] = conn.execute(f"PRAGMA foreign_key_list({table})").fetchall()
            indexes = conn.execute(f"PRAGMA index_list({table})").fetchall()
            found[f"{table} indexes"] = sorted(indexes, key=lambda row: row[1])
            for index in indexes:
                found[f"index {index[1]}"] = conn.execute(f"PRAGMA index_xinfo({index[1]})").fetchall()
        return found
    finally:
        conn.close()


def test_all_migrations_build_exactly_the_schema_file(tmp_path):
    migrated = tmp_path / "migrated.db"
    store = SQLiteStorage(f"sqlite:///{migrated}")
    store.migrate()
    store.close()

    from_file = tmp_path / "schema.db"
    conn = sqlite3.connect(from_file)
    conn.executescript(resources.files(PACKAGE).joinpath("schema.sql").read_text(encoding="utf-8"))
    conn.close()

    expected = catalog(from_file)
    assert expected["objects"], "schema.sql creates nothing"
    assert catalog(migrated) == expected
    assert expected["user_version"] == migrations(PACKAGE)[-1].version


def test_a_database_made_from_the_schema_file_is_taken_as_up_to_date(tmp_path):
    path = tmp_path / "schema.db"
    conn = sqlite3.connect(path)
    conn.executescript(resources.files(PACKAGE).joinpath("schema.sql").read_text(encoding="utf-8"))
    conn.close()
    before = catalog(path)
    store = SQLiteStorage(f"sqlite:///{path}")
    store.migrate()
    assert store.list_queues() == []
    store.close()
    assert catalog(path) == before
