"""The SQLite backend (the embedded default): ``sqlite:///rdq.db``. See ``backend.py``."""

from .backend import DEFAULT_BUSY_TIMEOUT, MAX_BUSY_TIMEOUT, SQLiteStorage

__all__ = ["SQLiteStorage", "DEFAULT_BUSY_TIMEOUT", "MAX_BUSY_TIMEOUT"]
