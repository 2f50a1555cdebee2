"""PostgreSQL: ``schema.sql`` is what the migrations add up to.

``rdq migrate`` runs in one fresh schema, ``schema.sql`` in another; their catalogs (tables,
columns with types, collations, defaults and nullability, constraints, indexes with definitions)
must be equal. ``rdq_schema_version`` belongs to the migration runner, not to the schema, and is
left out.
"""

from __future__ import annotations

from importlib import resources

import pytest

psycopg = pytest.importorskip("psycopg")

from rdq_testing.servers import pg_fresh_schema  # noqa: E402 - after importorskip
from rdq_core.storage.postgres import PostgresStorage  # noqa: E402 - after importorskip


# Each query runs with search_path set to the schema it describes, so definitions print
# unqualified and two schemas compare equal when their objects do.
CATALOG = {
    "tables": """
        SELECT c.relname, c.relkind::text FROM pg_class AS c
        WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
          AND c.relname <> 'rdq_schema_version'
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               coalesce(co.collname, ''), coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute AS a
        JOIN pg_class AS c ON c.oid = a.attrelid
        LEFT JOIN pg_collation AS co ON co.oid = a.attcollation
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'
          AND c.relname <> 'rdq_schema_version' AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, con.conname, con.contype::text, pg_get_constraintdef(con.oid)
        FROM pg_constraint AS con JOIN pg_class AS c ON c.oid = con.conrelid
        WHERE con.connamespace = current_schema()::regnamespace AND c.relname <> 'rdq_schema_version'
        ORDER BY 1, 2""",
    "indexes": """
        SELECT c.relname, i.relname, pg_get_indexdef(i.oid)
        FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid JOIN pg_class AS c ON c.oid = x.indrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND c.relname <> 'rdq_schema_version'
        ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid)
        FROM pg_proc AS p WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
        ORDER BY 1, 2""",
}


@pytest.fixture
def two_fresh_schemas(pg_database_url: str) -> tuple[str, str]:
    """URLs of two new, empty schemas in the session's scratch database (gone with it)."""
    return pg_fresh_schema(pg_database_url, prefix="schema_check_"), pg_fresh_schema(pg_database_url, prefix="schema_check_")


def _catalog(url: str) -> dict[str, list[tuple]]:
    with psycopg.connect(url, autocommit=True) as conn:
        (schema,) = conn.execute("SELECT current_schema()").fetchone()
        found = {part: conn.execute(query).fetchall() for part, query in CATALOG.items()}
    # pg_get_indexdef names the table with its schema whatever the search_path: drop it.
    return {part: [tuple(v.replace(f"{schema}.", "") if isinstance(v, str) else v for v in row) for row in rows]
            for part, rows in found.items()}


def test_schema_file_equals_all_migrations_applied(two_fresh_schemas):
    migrated_url, from_file_url = two_fresh_schemas
    store = PostgresStorage(migrated_url)
    try:
        store.migrate()
    finally:
        store.close()
    schema_sql = resources.files("rdq_core.storage.postgres").joinpath("schema.sql").read_text(encoding="utf-8")
    with psycopg.connect(from_file_url, autocommit=True) as conn:
        conn.execute(schema_sql)

    migrated, from_file = _catalog(migrated_url), _catalog(from_file_url)
    assert migrated["tables"], "the migrations created no table"
    for part in CATALOG:
        assert from_file[part] == migrated[part], f"schema.sql and the migrations differ in {part}"
