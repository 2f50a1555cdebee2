"""Per-run rdq stores: each run gets an empty store of its own, removed afterwards."""

from __future__ import annotations

import os
import secrets
import tempfile
from contextlib import ExitStack, contextmanager
from typing import Iterator

from rdq_core.compliance import servers as provisioning

from . import servers

BACKENDS = ("sqlite", "postgres", "redis", "mongo")


class BackendSession:
    """Owns the shared server resources of one harness run (a PG database, an nx server)."""

    def __init__(self, backends: tuple[str, ...]) -> None:
        self.backends = backends
        self._stack = ExitStack()
        self.pg_database_url: str | None = None
        self.mongo_base: str | None = None
        self.tmpdir: str | None = None

    def __enter__(self) -> "BackendSession":
        self.tmpdir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="rdq-bench-"))
        if "postgres" in self.backends:
            self.pg_database_url = self._stack.enter_context(servers.pg_database())
        if "mongo" in self.backends:
            self.mongo_base = self._stack.enter_context(servers.mongo_server())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextmanager
    def store_url(self, backend: str) -> Iterator[str]:
        """A URL naming a fresh, empty store; everything under it is removed on exit."""
        token = secrets.token_hex(4)
        if backend == "sqlite":
            path = os.path.join(self.tmpdir, f"rdq-{token}.db")
            try:
                yield f"sqlite:///{path}"
            finally:
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.unlink(path + suffix)
                    except FileNotFoundError:
                        pass
        elif backend == "postgres":
            # A schema of its own in the run's scratch database (dropped with it).
            yield provisioning.pg_fresh_schema(self.pg_database_url, prefix="b_")
        elif backend == "redis":
            prefix = servers.new_redis_prefix()
            try:
                yield servers.redis_storage_url(prefix)
            finally:
                servers.redis_delete_prefix(prefix)
        elif backend == "mongo":
            with provisioning.mongo_fresh_database(self.mongo_base, prefix="rdq_bench_") as url:
                yield url
        else:
            raise ValueError(backend)

