"""The storage core's part for engine documents: key checks, JSON bodies and versions over the
backend's compare-and-set primitives (what ``slots.py`` and ``rollup.py`` are written over).
"""

from __future__ import annotations

import abc
import json
from typing import Any, Mapping, Sequence

from ..errors import InvalidInput
from ..model import Document
from .core_base import CoreBase
from .guards import require_document_key, require_limit
from .spi import storable_json


class DocumentsCore(CoreBase, abc.ABC):
    """The engine-document SPI over the backend's document primitives."""

    # -- primitives a backend writes (one atomic store operation each) -----------------------
    @abc.abstractmethod
    def _doc_get(self, kind: str, key: str) -> tuple[int, str] | None:
        """``(version, body)`` of the document, or None."""

    @abc.abstractmethod
    def _doc_put(self, kind: str, key: str, body: str, expected: int | None) -> int | None:
        """Compare-and-set in one atomic step: with ``expected`` None, insert unless the document
        exists; else replace it only while its version is ``expected``. The new version (1 for an
        insert, ``expected + 1`` after), or None when the condition did not hold."""

    @abc.abstractmethod
    def _doc_delete(self, kind: str, key: str, expected: int) -> bool:
        """Delete the document if its version is still ``expected``; whether it was deleted."""

    @abc.abstractmethod
    def _doc_page(self, kind: str, after: str | None, limit: int) -> Sequence[tuple[str, int, str]]:
        """Up to ``limit`` ``(key, version, body)`` of ``kind`` ordered by key bytes, after ``after``."""

    # -- the SPI ---------------------------------------------------------------------------
    def get_document(self, kind: str, key: str) -> Document | None:
        require_document_key(kind, key)
        with self.translated_errors():
            found = self._doc_get(kind, key)
        return None if found is None else Document(kind, key, found[0], json.loads(found[1]))

    def put_document(self, kind: str, key: str, body: Mapping[str, Any], *, expected_version: int | None) -> Document | None:
        require_document_key(kind, key)
        if expected_version is not None and (isinstance(expected_version, bool) or not isinstance(expected_version, int)):
            raise InvalidInput("expected_version must be an integer or None", field="expected_version")
        text = storable_json(dict(body))
        with self.translated_errors():
            version = self._doc_put(kind, key, text, expected_version)
        return None if version is None else Document(kind, key, version, json.loads(text))

    def delete_document(self, kind: str, key: str, *, expected_version: int) -> bool:
        require_document_key(kind, key)
        with self.translated_errors():
            return bool(self._doc_delete(kind, key, int(expected_version)))

    def list_documents(self, kind: str, *, limit: int, after: str | None = None) -> list[Document]:
        require_document_key(kind, after if after is not None else kind)
        require_limit(limit)
        with self.translated_errors():
            rows = self._doc_page(kind, after, limit)
        return [Document(kind, key, version, json.loads(body)) for key, version, body in rows]
