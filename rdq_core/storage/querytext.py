"""Query text kept as data: SQL and Lua live in their own files beside each backend.

A *named-query file* holds several statements or scripts, each introduced by a marker line::

    -- name: claim
    UPDATE rdq_tasks ...

(``--`` starts a comment in both SQL and Lua.) Text before the first marker is the file's
preamble: it documents the file and is not a query. A block may use another block of the same
file as a fragment, written ``{{name}}`` (e.g. a column list every statement returns); fragments
are substituted once, when the file is loaded, so the text a driver receives is plain. A *migrations directory* holds files named
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
    return {name: _expanded(name, queries, origin, ()) for name in queries}


_FRAGMENT = re.compile(r"\{\{([a-z][a-z0-9_]*)\}\}")


def _expanded(name: str, queries: dict[str, str], origin: str, outer: tuple[str, ...]) -> str:
    if name in outer:
        raise RuntimeError(f"{origin}: fragment {name!r} includes itself ({' -> '.join(outer + (name,))})")

    def fragment(match: re.Match[str]) -> str:
        used = match.group(1)
        if used not in queries:
            raise RuntimeError(f"{origin}: {name!r} uses unknown fragment {used!r}")
        text = _expanded(used, queries, origin, outer + (name,))
        # A fragment's own comment lines stay in the file: spliced mid-line, one would swallow
        # the rest of the line it lands on.
        return "\n".join(line for line in text.strip().splitlines() if not line.lstrip().startswith("--"))

    return _FRAGMENT.sub(fragment, queries[name])


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
