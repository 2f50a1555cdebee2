"""The MongoDB schema as data: ``migrate`` creates exactly the collections and indexes the
migration files declare, nothing more, nothing different.

nx-27017 keeps an index's keys and uniqueness but names it itself and drops partial filters;
names and filters are compared where the server keeps them (a real MongoDB)."""

from __future__ import annotations

import json

import pytest

pymongo = pytest.importorskip("pymongo")

from rdq_core.storage.mongo import MongoStorage  # noqa: E402 - after importorskip
from rdq_core.storage.querytext import migrations  # noqa: E402 - after importorskip

PACKAGE = "rdq_core.storage.mongo"


def _declared() -> tuple[set[str], dict[str, dict[str, tuple]]]:
    """Collections, and per collection ``{index name: (keys, partial filter, unique)}``, after
    every migration file."""
    collections: set[str] = set()
    indexes: dict[str, dict[str, tuple]] = {}
    for migration in migrations(PACKAGE):
        step = json.loads(migration.text)
        collections.update(step.get("collections", ()))
        for index in step.get("indexes", ()):
            keys = tuple((field, int(order)) for field, order in index["keys"])
            indexes.setdefault(index["collection"], {})[index["name"]] = (
                keys, index.get("partial"), bool(index.get("unique")))
    return collections, indexes


def _created(store: MongoStorage, collection: str) -> dict[str, tuple]:
    found = {}
    for name, info in store._db[collection].index_information().items():
        if name == "_id_":
            continue
        keys = tuple((field, int(order)) for field, order in info["key"])
        found[name] = (keys, info.get("partialFilterExpression"), bool(info.get("unique")))
    return found


def test_migration_files_are_numbered_json_documents():
    found = migrations(PACKAGE)
    versions = [m.version for m in found]
    # Numbered from 1, increasing; a number may be skipped (one reserved by work on another branch).
    assert versions[0] == 1 and versions == sorted(set(versions)), versions
    for migration in found:
        step = json.loads(migration.text)
        assert set(step) <= {"comment", "collections", "indexes"}, migration.name


def test_migrate_creates_what_the_migrations_declare(fresh_mongo_url):
    collections, indexes = _declared()
    store = MongoStorage(fresh_mongo_url)
    try:
        store.migrate()
        store.migrate()  # idempotent: nothing changes the second time
        assert collections <= set(store._db.list_collection_names())
        for collection in collections:
            declared, created = indexes.get(collection, {}), _created(store, collection)
            if set(created) & set(declared):
                assert created == declared, collection
            else:
                assert sorted((keys, unique) for keys, _, unique in created.values()) == \
                    sorted((keys, unique) for keys, _, unique in declared.values()), collection
        assert store._schema.find_one({"_id": "schema"})["version"] == migrations(PACKAGE)[-1].version
    finally:
        store.close()


def test_every_status_is_listed_through_an_index_on_queue_its_order_field_and_id():
    """Task listings filter on (queue, status) and sort by (order field, task_id): for each
    status some tasks index starts with queue, ends with the order field and task_id, and holds
    that status's tasks (partial on it, so other statuses' writes never touch it)."""
    from rdq_core.storage.core import ORDER_FIELD

    _, indexes = _declared()
    order_key = {status: MongoStorage.codec.keys.get(field, field) for status, field in ORDER_FIELD.items()}
    for status, key in order_key.items():
        serving = [name for name, (keys, partial, _) in indexes["tasks"].items()
                   if keys[0] == ("queue", 1) and keys[-2:] == ((key, 1), ("task_id", 1))
                   and {field for field, _ in keys[1:-2]} <= {"status"} and partial == {"status": status.value}]
        assert serving, f"no index serves the {status.value} listing"
