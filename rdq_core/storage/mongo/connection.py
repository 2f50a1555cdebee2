"""The MongoDB client a backend instance holds: URL options and timeouts, the collections, the
round-trip count, the schema's migrations and the server clock. The backend's parts (one per
resource, composed in ``backend.py``) derive from ``MongoConnection``.
"""

from __future__ import annotations

import abc
import json
import threading
from datetime import datetime, timezone
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl, urlsplit

import pymongo
from pymongo import monitoring
from pymongo.errors import (
    AutoReconnect,
    CollectionInvalid,
    ConnectionFailure,
    InvalidURI,
    NetworkTimeout,
    OperationFailure,
    ServerSelectionTimeoutError,
)

from ...errors import ConfigurationError, StorageUnavailable
from ..codec import RecordCodec, epoch_millis
from ..core import StorageCore
from ..querytext import migrations
from ..spi import from_micros
from .shapes import _epoch_ms


DEFAULT_DATABASE = "rdq"
NAMESPACE_EXISTS = 48


# How long to look for a server before giving up. pymongo's 30 s default would eat a Lambda
# invocation; a URL that sets serverSelectionTimeoutMS wins (as for the two below).
DEFAULT_SERVER_SELECTION_MS = 10_000
# Opening a connection (TCP + TLS + handshake); pymongo's default is 20 s.
DEFAULT_CONNECT_TIMEOUT_MS = 10_000
# Waiting for any reply. pymongo waits forever by default, so a half-open connection would hang
# a claim loop; every rdq command answers in milliseconds.
DEFAULT_SOCKET_TIMEOUT_MS = 30_000


class _CommandCounter(monitoring.CommandListener):
    """Counts every command pymongo sends on behalf of this storage (find, getMore, hello…)."""

    def __init__(self, on_command: Callable[[], None]):
        self._on_command = on_command

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self._on_command()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


class MongoConnection(StorageCore, abc.ABC):
    """The client and collections every part of the MongoDB backend works on."""

    schemes = ("mongodb", "mongodb+srv")
    store_name = "MongoDB"
    # Network errors, timeouts and server selection failures; a server's refusal is a bug.
    transient_errors = (ConnectionFailure,)
    codec = RecordCodec(
        time=epoch_millis,
        keys={
            "id": "_id", "payload": "payload_json", "headers": "headers_json", "result": "result_json",
            "next_attempt_at": "next_attempt_at_ms", "lease_expires_at": "lease_expires_at_ms",
            "claimed_at": "claimed_at_ms", "created_at": "created_at_ms", "updated_at": "updated_at_ms",
            "dead_at": "dead_at_ms", "started_at": "started_at_ms", "finished_at": "finished_at_ms",
        },
    )

    def __init__(self, url: str):
        self.url = url
        self.round_trips = 0
        self._round_trip_lock = threading.Lock()
        options: dict[str, Any] = {
            "tz_aware": True,
            "tzinfo": timezone.utc,
            "event_listeners": [_CommandCounter(self._count_round_trip)],
            "appname": "rdq",
        }
        in_url = {name.lower() for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
        for name, value in (("serverSelectionTimeoutMS", DEFAULT_SERVER_SELECTION_MS),
                            ("connectTimeoutMS", DEFAULT_CONNECT_TIMEOUT_MS),
                            ("socketTimeoutMS", DEFAULT_SOCKET_TIMEOUT_MS)):
            if name.lower() not in in_url:  # keyword arguments would override the URL
                options[name] = value
        try:
            self._client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(url, **options)
        except (InvalidURI, ValueError) as exc:
            raise ConfigurationError(f"malformed MongoDB URL: {exc}") from exc
        except ConnectionFailure as exc:  # mongodb+srv may resolve DNS while constructing
            raise StorageUnavailable(f"MongoDB unavailable: {exc}") from exc
        self._db = self._client.get_default_database(default=DEFAULT_DATABASE)
        self._tasks = self._db["tasks"]
        self._attempts = self._db["attempts"]
        self._schema = self._db["schema"]
        self._queue_flags = self._db["queues"]
        self._audit = self._db["audit"]
        self._documents = self._db["documents"]
        self._outbox = self._db["outbox"]
        self._flow_slots = self._db["flow_slots"]
        self._dedupe_locks = self._db["dedupe_locks"]

    def _count_round_trip(self) -> None:
        with self._round_trip_lock:
            self.round_trips += 1

    def migrate(self) -> None:
        """Every migration file, in order (each is idempotent), then the version is raised."""
        with self.translated_errors():
            steps = [(m.version, json.loads(m.text)) for m in migrations(__package__)]
            existing = set(self._db.list_collection_names())
            for _, step in steps:
                for name in step.get("collections", ()):
                    if name not in existing:
                        self._create_collection(name)
                        existing.add(name)
                for index in step.get("indexes", ()):
                    self._create_index(index)
            self._schema.update_one(
                {"_id": "schema"},
                {"$max": {"version": steps[-1][0]}, "$set": {"migrated_at_ms": _epoch_ms(self._server_now())}},
                upsert=True,
            )

    def _create_collection(self, name: str) -> None:
        try:
            self._db.create_collection(name)
        except CollectionInvalid:
            pass  # a concurrent migrate created it first
        except OperationFailure as exc:
            if exc.code != NAMESPACE_EXISTS:
                raise

    def _create_index(self, index: Mapping[str, Any]) -> None:
        options: dict[str, Any] = {"name": index["name"]}
        if "partial" in index:
            options["partialFilterExpression"] = index["partial"]
        if index.get("unique"):
            options["unique"] = True
        self._db[index["collection"]].create_index([(field, order) for field, order in index["keys"]], **options)

    def close(self) -> None:
        self._client.close()

    def _now(self) -> datetime:
        return self._server_now()

    def _server_now(self) -> datetime:
        """The server clock, read with ``hello`` (one round trip), as aware UTC at ms precision.
        ``$$NOW`` would need update pipelines, which the nx-27017 test server does not implement."""
        try:
            reply = self._client.admin.command("hello")
        except (NetworkTimeout, ServerSelectionTimeoutError):
            raise  # a half-open connection or no server: fail now, do not wait a second timeout
        except AutoReconnect:
            # A pooled connection the server closed (a restart): hello is read-only, so it is
            # sent once more on a fresh connection, like pymongo's own retryable reads (which do
            # not cover commands).
            reply = self._client.admin.command("hello")
        local_time = reply.get("localTime")
        if not isinstance(local_time, datetime):
            raise StorageUnavailable("MongoDB server did not report localTime in its hello reply")
        if local_time.tzinfo is None:  # admin.command decodes with default (naive UTC) options
            local_time = local_time.replace(tzinfo=timezone.utc)
        return from_micros(_epoch_ms(local_time) * 1000)

    def _at_crash_point(self, name: str) -> None:
        """Called between two writes that a crash may separate (``backend.py`` lets tests stop a
        call there); nothing happens here."""
