"""Per-run rdq stores: each run gets an empty store of its own, removed afterwards."""

from __future__ import annotations

import os
import secrets
import tempfile
from contextlib import ExitStack, contextmanager
from typing import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
            import psycopg
            from psycopg import sql

            schema = f"b_{token}"
            with psycopg.connect(self.pg_database_url, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            try:
                yield with_search_path(self.pg_database_url, schema)
            finally:
                with psycopg.connect(self.pg_database_url, autocommit=True) as conn:
                    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        elif backend == "redis":
            prefix = servers.new_redis_prefix()
            try:
                yield servers.redis_storage_url(prefix)
            finally:
                servers.redis_delete_prefix(prefix)
        elif backend == "mongo":
            import pymongo

            database = f"rdq_bench_{token}"
            try:
                yield f"{self.mongo_base}/{database}"
            finally:
                client = pymongo.MongoClient(self.mongo_base)
                client.drop_database(database)
                client.close()
        else:
            raise ValueError(backend)


def with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["options"] = f"-csearch_path={schema}"
    return urlunsplit(parts._replace(query=urlencode(query)))
