"""Redis backend: the Lua files under ``scripts/`` are the scripts the backend runs.

Every file is either an include or a script the backend loads; every script the backend calls
has a file; and every script compiles on the server to the SHA the backend sends it by.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

redis = pytest.importorskip("redis")

from rdq_core.storage.redis import backend, lua  # noqa: E402 - after importorskip

SCRIPT_DIR = resources.files("rdq_core.storage.redis").joinpath("scripts")


def test_every_script_file_is_loaded_or_included():
    files = {entry.name[:-len(".lua")] for entry in SCRIPT_DIR.iterdir() if entry.name.endswith(".lua")}
    assert files == set(lua.SCRIPTS) | set(lua.INCLUDES)
    kinds = (set(lua.QUEUE_SCRIPTS), set(lua.GLOBAL_SCRIPTS), set(lua.AUDIT_SCRIPTS), set(lua.DOC_SCRIPTS))
    assert sum(len(kind) for kind in kinds) == len(set().union(*kinds)), "a script is of one kind only"


def test_every_script_the_backend_calls_exists():
    source = Path(backend.__file__).read_text(encoding="utf-8")
    called = set(re.findall(r'_(?:queue|global|audit|doc)_call\(\s*"([a-z_]+)"', source))
    called |= set(re.findall(r'_fenced\(\s*"([a-z_]+)"', source))
    assert called and called <= set(lua.SCRIPTS), sorted(called - set(lua.SCRIPTS))
    unused = set(lua.SCRIPTS) - called
    assert not unused, f"scripts no code calls: {sorted(unused)}"


def test_every_script_compiles_on_the_server_to_its_sha(redis_client):
    for script in lua.SCRIPTS.values():
        assert redis_client.script_load(script.source) == script.sha, script.name
