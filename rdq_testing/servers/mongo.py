"""MongoDB for tests: nx-27017 (the MongoDB wire server) run as our child process, or the server
``RDQ_TEST_MONGO_URL`` names; a database of its own per test, dropped afterwards."""

from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from typing import Any, ContextManager, Iterator
from urllib.parse import urlsplit, urlunsplit

from .processes import OwnedProcessServer, ServerStartError, running

#: A MongoDB to use instead of starting nx-27017 (e.g. a real mongod).
CONFIGURED_MONGO_URL = os.environ.get("RDQ_TEST_MONGO_URL")


def mongo_served_pid(port: int) -> int | None:
    """The PID the MongoDB wire server on ``port`` reports (``serverStatus``), or None."""
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        f"mongodb://127.0.0.1:{port}/", serverSelectionTimeoutMS=250, connectTimeoutMS=250)
    try:
        return int(client.admin.command("serverStatus")["pid"])
    except (pymongo.errors.PyMongoError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()



class OwnedNx27017(OwnedProcessServer):
    """The nx-27017 MongoDB wire server: in memory by default, or over a SQLite file (``durable``)
    so data survives a restart. Its own ``--pid-file``: without one nx-27017 uses a fixed path and
    refuses to start while that names a live process (any other nx-27017 on the machine)."""

    what = "nx-27017"

    def __init__(self, durable: bool = False, prefix: str = "rdq-nx27017-", new_session: bool = False) -> None:
        super().__init__(prefix, new_session)
        self.durable = durable

    def argv(self, port: int) -> list[str]:
        executable = shutil.which("nx-27017") or "nx-27017"
        database = str(self.workdir / "data.db") if self.durable else "memory"
        return [executable, "--host", "127.0.0.1", "-p", str(port), "--db", database,
                "--log-file", str(self.workdir / f"nx-{port}.log"), "--pid-file", str(self.workdir / f"nx-{port}.pid")]

    def served_pid(self, port: int) -> int | None:
        return mongo_served_pid(port)

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/"



def nx_27017(durable: bool = False, new_session: bool = False) -> ContextManager[OwnedNx27017]:
    """nx-27017 started for the block and stopped (by PID) after it."""
    if shutil.which("nx-27017") is None:
        raise ServerStartError("nx-27017 is not installed (pip install nx-27017)")
    return running(OwnedNx27017(durable=durable, new_session=new_session))



def mongo_url_with_database(server_url: str, database: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def mongo_answers(url: str, timeout_ms: int = 500) -> bool:
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        url, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms)
    try:
        client.admin.command("ping")
        return True
    except pymongo.errors.PyMongoError:
        return False
    finally:
        client.close()


@contextmanager
def mongo_fresh_database(server_url: str, prefix: str = "rdq_test_") -> Iterator[str]:
    """A URL naming a database no one has used; dropped afterwards."""
    import pymongo

    database = prefix + secrets.token_hex(6)
    try:
        yield mongo_url_with_database(server_url, database)
    finally:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(server_url, serverSelectionTimeoutMS=5000)
        try:
            client.drop_database(database)
        finally:
            client.close()
