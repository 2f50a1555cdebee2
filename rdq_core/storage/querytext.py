"""Query text kept as data: SQL and Lua live in their own files beside each backend.

A *named-query file* holds several statements or scripts, each introduced by a marker line::

    -- name: claim
    UPDATE rdq_tasks ...

(``--`` starts a comment in both SQL and Lua.) Text before the first marker is the file's
preamble: it documents the file and is not a query. A *migrations directory* holds files named
``NNNN_what_it_does.EXT``, applied in version order; versions are unique.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Iterable

_NAME_MARKER = re.compile(r"^--\s*name:\s*([a-z][a-z0-9_]*)\s*$", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.(sql|lua|json)$")


def named_queries(package: str, filename: str) -> dict[str, str]:
    """``{name: text}`` for every ``-- name:`` block of ``filename`` in ``package``."""
    return parse_named(resources.files(package).joinpath(filename).read_text(encoding="utf-8"), filename)


def parse_named(text: str, origin: str = "<text>") -> dict[str, str]:
    markers = list(_NAME_MARKER.finditer(text))
    queries: dict[str, str] = {}
    for marker, following in zip(markers, [*markers[1:], None], strict=True):
        name = marker.group(1)
        if name in queries:
            raise RuntimeError(f"{origin}: query {name!r} is defined twice")
        body = text[marker.end(): following.start() if following else len(text)].strip()
        if not body:
            raise RuntimeError(f"{origin}: query {name!r} is empty")
        queries[name] = body + "\n"
    return queries


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def migrations(package: str, directory: str = "migrations") -> list[Migration]:
    """Every ``NNNN_name.ext`` file of ``package/directory``, in version order."""
    folder = resources.files(package).joinpath(directory)
    found = [
        Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if (match := _MIGRATION_FILE.match(entry.name))
    ]
    found.sort(key=lambda m: m.version)
    _require_unique(m.version for m in found)
    return found


def _require_unique(versions: Iterable[int]) -> None:
    seen: set[int] = set()
    for version in versions:
        if version in seen:
            raise RuntimeError(f"migration version {version:04d} appears twice")
        seen.add(version)
