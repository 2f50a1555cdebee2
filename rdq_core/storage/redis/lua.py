"""The Lua scripts as the server runs them: one file per script under ``scripts/``.

A queue script is sent as ``_checks.lua`` + ``_keyset.lua`` + ``_queue_prelude.lua`` + its own
file and runs with the queue's five sorted sets as ``KEYS``; a global script (the id index and
queue registry), an audit script (the audit trail) or a document script (engine documents) is
``_checks.lua`` + ``_keyset.lua`` + its own file. Scripts are sent by SHA1 and loaded on ``NOSCRIPT``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

#: Scripts that run on one queue's keys (all in that queue's hash-tag slot).
QUEUE_SCRIPTS = (
    "enqueue", "claim", "settle", "extend", "release", "expired_leases", "read_tasks", "cancel", "stats",
    "page", "count", "apply", "purge_finished", "existing", "outbox_put", "outbox_take", "outbox_ack",
    "index_lanes", "enqueue_dedupe",
)
#: Scripts that run on the global id index and queue registry.
GLOBAL_SCRIPTS = ("reserve_ids", "unindex", "take_over_ids")
#: Scripts that run on the audit trail (its own hash-tag slot).
AUDIT_SCRIPTS = ("audit_append", "audit_page")
#: Scripts that run on one kind of engine document: its hash and lex index (their own slot).
DOC_SCRIPTS = ("doc_put", "doc_delete", "doc_page")
#: Files included before scripts, not run on their own.
INCLUDES = ("_checks", "_keyset", "_queue_prelude")
#: The sorted sets a queue script gets as KEYS, in this order (see ``_queue_prelude.lua``).
QUEUE_ZSETS = ("due", "inflight", "dead", "succeeded", "cancelled")


_SCRIPT_DIR = resources.files(__package__).joinpath("scripts")


def script_file(name: str) -> str:
    return _SCRIPT_DIR.joinpath(f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str

    @classmethod
    def of(cls, name: str, source: str) -> Script:
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


def _load_all() -> dict[str, Script]:
    common, prelude = script_file("_checks") + script_file("_keyset"), script_file("_queue_prelude")
    scripts = [Script.of(name, common + prelude + script_file(name)) for name in QUEUE_SCRIPTS]
    scripts += [Script.of(name, common + script_file(name)) for name in GLOBAL_SCRIPTS + AUDIT_SCRIPTS + DOC_SCRIPTS]
    return {s.name: s for s in scripts}


SCRIPTS = _load_all()


@dataclass(frozen=True)
class Call:
    """One script invocation, ready to send alone or in a pipeline."""

    script: Script
    keys: tuple[str, ...]
    args: tuple[Any, ...]
