"""The PostgreSQL backend: ``backend.py`` (the task lifecycle's primitives: enqueue, claim,
fencing, settle, a handler's transaction), ``operator.py`` (selections, the DLQ, counts, pausing,
outbox, documents, audit), ``connection.py`` (the pool, sending a statement, migrations, the
clock, LISTEN), ``queries.sql`` (every statement), ``migrations/`` (schema changes, applied in
order), ``schema.sql`` (the schema they add up to) and ``pool.py`` (connections, bounded in
time)."""

from .backend import QUERIES, PostgresStorage, page_statement

#: The claim and the expired-lease scan, for plan checks (``EXPLAIN``); ``page_statement`` gives a
#: listing page's.
CLAIM_SQL = QUERIES["claim"]
FIND_EXPIRED_LEASES_SQL = QUERIES["find_expired_leases"]

__all__ = ["CLAIM_SQL", "FIND_EXPIRED_LEASES_SQL", "QUERIES", "PostgresStorage", "page_statement"]
