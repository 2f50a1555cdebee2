"""The SQLite backend (the embedded default): ``sqlite:///rdq.db``.

| file | holds |
| --- | --- |
| ``backend.py`` | ``SQLiteStorage``: enqueue, claim, fencing, settle, a handler's transaction |
| ``connection.py`` | URL, connections, the write lock, statements, migrations, row helpers |
| ``operator.py`` | selections and the DLQ, counts, retention, pausing, audit, outbox, documents |
| ``queries.sql`` | every statement it sends, one ``-- name:`` block each |
| ``migrations/NNNN_*.sql`` | the schema steps; ``PRAGMA user_version`` is the last one applied |
| ``schema.sql`` | the schema all migrations build (a test holds them equal) |
"""

from .backend import SQLiteStorage
from .connection import DEFAULT_BUSY_TIMEOUT, MAX_BUSY_TIMEOUT

__all__ = ["DEFAULT_BUSY_TIMEOUT", "MAX_BUSY_TIMEOUT", "SQLiteStorage"]
