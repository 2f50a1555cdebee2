"""Per-run rdq stores: each run gets an empty store of its own, removed afterwards."""

from __future__ import annotations

import os
import secrets
import tempfile
from contextlib import ExitStack, contextmanager
from typing import Iterator

from rdq_testing import servers as provisioning

from . import servers

#: ``redis-cluster`` (three masters, one replica each) and ``postgres-pgbouncer`` (transaction
#: mode, 20 server connections) are servers this harness starts and stops by PID.
BACKENDS = ("sqlite", "postgres", "redis", "mongo", "redis-cluster", "postgres-pgbouncer")


class BackendSession:
    """Owns the shared server resources of one harness run (a PG database, an nx server)."""

    def __init__(self, backends: tuple[str, ...]) -> None:
        self.backends = backends
        self._stack = ExitStack()
        self.pg_database_url: str | None = None
        self.mongo_base: str | None = None
        self.tmpdir: str | None = None
        self.redis_cluster_url: str | None = None
        self.pgbouncer: provisioning.OwnedPgBouncer | None = None

    def __enter__(self) -> "BackendSession":
        self.tmpdir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="rdq-bench-"))
        if "postgres" in self.backends:
            self.pg_database_url = self._stack.enter_context(servers.pg_database())
        if "mongo" in self.backends:
            self.mongo_base = self._stack.enter_context(servers.mongo_server())
        if "redis-cluster" in self.backends:
            self.redis_cluster_url = self._stack.enter_context(provisioning.redis_cluster()).url
        if "postgres-pgbouncer" in self.backends:
            self.pgbouncer = self._stack.enter_context(provisioning.pgbouncer(server_connections=20))
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
        elif backend == "redis-cluster":  # the cluster goes with the session: no keys to delete
            assert self.redis_cluster_url is not None
            yield provisioning.redis_url_with_prefix(self.redis_cluster_url, servers.new_redis_prefix())
        elif backend == "postgres-pgbouncer":  # a database of its own (a schema needs startup options)
            assert self.pgbouncer is not None
            with provisioning.pg_scratch_database(provisioning.SHARED_PG_URL, prefix="rdq_bench_") as direct:
                yield self.pgbouncer.url_for(direct)
        elif backend == "mongo":
            with provisioning.mongo_fresh_database(self.mongo_base, prefix="rdq_bench_") as url:
                yield url
        else:
            raise ValueError(backend)

