"""The SQLite backend (the embedded default): ``sqlite:///rdq.db``.

| file | holds |
| --- | --- |
| ``backend.py`` | ``SQLiteStorage``: URL, connections, the write lock, the core's primitives |
| ``queries.sql`` | every statement it sends, one ``-- name:`` block each |
| ``migrations/NNNN_*.sql`` | the schema steps; ``PRAGMA user_version`` is the last one applied |
| ``schema.sql`` | the schema all migrations build (a test holds them equal) |
"""

from .backend import DEFAULT_BUSY_TIMEOUT, MAX_BUSY_TIMEOUT, SQLiteStorage

__all__ = ["DEFAULT_BUSY_TIMEOUT", "MAX_BUSY_TIMEOUT", "SQLiteStorage"]
