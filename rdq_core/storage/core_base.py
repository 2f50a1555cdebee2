"""What every part of the storage core stands on: the store's name, codec and clock, and the one
place a store's own exception becomes the SPI's ``StorageUnavailable`` (see ``core.py``).
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import ClassVar, Iterator

from ..errors import RdqError, StorageUnavailable
from .codec import RecordCodec
from .spi import Storage


class CoreBase(Storage, abc.ABC):
    """The shared ground of ``StorageCore``'s parts (one per resource, composed in ``core.py``)."""

    #: Reads this store's records.
    codec: ClassVar[RecordCodec]
    #: A name for messages: "PostgreSQL", "Redis", ...
    store_name: ClassVar[str] = "store"
    #: Exception types that mean the store could not serve the call now; they become
    #: ``StorageUnavailable`` (retryable). Anything else is a bug and propagates as is.
    transient_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: Whether ``enqueue(connection=...)`` can write inside the caller's open transaction.
    joins_transactions: ClassVar[bool] = False

    def is_transient(self, exc: BaseException) -> bool:
        """Refine in a backend whose driver reports transient conditions by code or text."""
        return isinstance(exc, self.transient_errors)

    @contextmanager
    def translated_errors(self) -> Iterator[None]:
        """The one place a store's own exception becomes the SPI's ``StorageUnavailable``."""
        try:
            yield
        except RdqError:
            raise
        except Exception as exc:
            if self.is_transient(exc):
                raise StorageUnavailable(f"{self.store_name} operation failed: {exc}") from exc
            raise

    @abc.abstractmethod
    def _now(self) -> datetime:
        """The store's clock."""

    def now(self) -> datetime:
        with self.translated_errors():
            value = self._now()
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
