"""The Redis client a backend instance holds, and how scripts reach the server: by SHA, loaded
again after NOSCRIPT, one call or one pipeline per round trip (counted), with ``WAIT`` when the
URL asks for replicas, and a script's refusal turned into the SPI error it means. Which script
runs for what is ``backend.py``'s business; this module never names one."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError, SlotNotCoveredError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...errors import ConfigurationError, InvalidInput, RdqError, StorageUnavailable
from ..codec import RecordCodec, epoch_micros
from ..core import StorageCore
from ..spi import from_micros
from .client import open_client, send_pipeline
from .encoding import _QUEUE_NAME
from .lua import QUEUE_ZSETS, SCRIPTS, Call, Script

_MIN_SERVER_VERSION = (5, 0)
#: Error replies of server states that pass (out of memory, failover, loading, a busy script).
_TRANSIENT_REPLIES = ("OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "BUSY")
#: Scripts that write nothing: ``wait_replicas`` has nothing to confirm for them.
_READ_ONLY_SCRIPTS = frozenset({"expired_leases", "read_tasks", "stats", "page", "count", "existing", "audit_page",
                                "doc_page"})
#: The error prefix of a script that refused its arguments before writing anything.
_INVALID_ARGUMENTS = "RDQ_INVALID"


class RedisConnection(StorageCore, abc.ABC):
    """The client the Redis backend sends every script through, and its key bases."""

    schemes = ("redis", "rediss")
    store_name = "Redis"
    codec = RecordCodec(time=epoch_micros)
    # NOSCRIPT twice in a row means the script cache was flushed again meanwhile: it passes.
    # SlotNotCoveredError: a Cluster whose slot map has a hole while a failover is under way.
    transient_errors = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, NoScriptError, SlotNotCoveredError)
    joins_transactions = False

    def __init__(self, url: str) -> None:
        self._client, self.prefix, self._durability = open_client(url)
        self._global_keys = (f"{self.prefix}:{{{self.prefix}:global}}:ids", f"{self.prefix}:{{{self.prefix}:global}}:queues")
        self._paused_registry = f"{self.prefix}:{{{self.prefix}:global}}:paused"
        self._audit_base = f"{self.prefix}:{{{self.prefix}:audit}}:"
        self._docs_base = f"{self.prefix}:{{{self.prefix}:docs}}:"
        self._counter_lock = threading.Lock()
        self.round_trips = 0

    def enqueue_listener(self, queues: Sequence[str]) -> _PubSubListener:
        """A pub/sub connection subscribed to the wake channel of each of ``queues``, or of every
        queue (a pattern) when none is named; returned once the server confirmed it."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=False)
        try:
            if queues:
                pubsub.subscribe(*[self._queue_base_checked(queue) + "wake" for queue in queues])
            else:
                pubsub.psubscribe(f"{self.prefix}:{{*}}:wake")
            confirmed = 0
            while confirmed < max(len(queues), 1):
                message = pubsub.get_message(timeout=DEFAULT_SUBSCRIBE_TIMEOUT)
                if message is None:
                    raise StorageUnavailable("Redis did not confirm the wake-up subscription")
                confirmed += message["type"] in ("subscribe", "psubscribe")
        except BaseException:
            pubsub.close()
            raise
        return _PubSubListener(pubsub)

    def is_transient(self, exc: BaseException) -> bool:
        return super().is_transient(exc) or (isinstance(exc, ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES))

    def _send(self, command: Callable[..., Any], *args: Any) -> Any:
        """Send one command or pipeline: one round trip. A reply that refuses the request itself
        (not the server's state) becomes the SPI error it means."""
        with self._counter_lock:
            self.round_trips += 1
        try:
            return command(*args)
        except ResponseError as exc:
            refusal = _refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc

    def _queue_base_checked(self, queue: str) -> str:
        # The name becomes the hash tag: anything outside the queue charset could change the slot.
        if not isinstance(queue, str) or not _QUEUE_NAME.match(queue):
            raise InvalidInput(f"invalid queue name {queue!r}", field="queue")
        return f"{self.prefix}:{{{queue}}}:"

    def _queue_call(self, name: str, queue: str, *args: Any) -> Call:
        base = self._queue_base_checked(queue)
        return Call(SCRIPTS[name], tuple(base + z for z in QUEUE_ZSETS), (base, *args))

    def _global_call(self, name: str, *args: Any) -> Call:
        return Call(SCRIPTS[name], self._global_keys, args)

    def _audit_call(self, name: str, keys: tuple[str, ...], *args: Any) -> Call:
        return Call(SCRIPTS[name], keys, (self._audit_base + "entry:", *args))

    def _load_scripts(self, scripts: Sequence[Script]) -> None:
        for script in {s.name: s for s in scripts}.values():
            self._send(self._client.script_load, script.source)

    def _run(self, call: Call) -> Any:
        """Send one script by SHA; on NOSCRIPT (server restarted, failed over or flushed its
        script cache) load it and send it again -- a NOSCRIPT reply means nothing ran."""
        if self._durability.replicas and call.script.name not in _READ_ONLY_SCRIPTS:
            return self._run_pipeline([call])[0]  # the script and its WAIT: one round trip
        try:
            return self._send(self._client.evalsha, call.script.sha, len(call.keys), *call.keys, *call.args)
        except NoScriptError:
            self._load_scripts([call.script])
        return self._send(self._client.evalsha, call.script.sha, len(call.keys), *call.keys, *call.args)

    def _run_pipeline(self, calls: Sequence[Call]) -> list[Any]:
        """Send many scripts in one round trip (not a transaction: each script is atomic on its
        own). Calls refused with NOSCRIPT are resent, in order, after loading their scripts."""
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for attempt in range(2):
            if not pending:
                break
            commands = [("EVALSHA", calls[i].script.sha, len(calls[i].keys), *calls[i].keys, *calls[i].args)
                        for i in pending]
            # Errors come back in place (NOSCRIPT among them), on a single Redis and a Cluster alike.
            reads = [calls[i].script.name in _READ_ONLY_SCRIPTS for i in pending]
            replies = self._send(send_pipeline, self._client, commands, self._durability, reads)
            missing = []
            for i, reply in zip(pending, replies, strict=True):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(reply, Exception):
                    refusal = _refusal(reply) if isinstance(reply, ResponseError) else None
                    raise reply if refusal is None else refusal from reply
                else:
                    results[i] = reply
            if missing:
                self._load_scripts([calls[i].script for i in missing])
            pending = missing
        return results

    def _run_batch(self, calls: list[Call]) -> list[Any]:
        """One script alone, or one pipeline of scripts (one per queue): a single round trip."""
        if not calls:
            return []
        if len(calls) == 1:
            return [self._run(calls[0])]
        return self._run_pipeline(calls)

    def close(self) -> None:
        self._client.close()

    def close_idle_connections(self) -> int:
        # A cluster client keeps a pool per node; commands in flight keep their connections.
        pool = getattr(self._client, "connection_pool", None)
        if pool is None:
            return 0
        idle = len(getattr(pool, "_available_connections", ()))
        pool.disconnect(inuse_connections=False)
        return idle

    def _now(self) -> datetime:
        seconds, micros = self._send(self._client.time)
        return from_micros(int(seconds) * 1_000_000 + int(micros))


def _refusal(exc: ResponseError) -> RdqError | None:
    """The SPI error for a reply that refuses the request itself, or None."""
    text = str(exc)
    if text.startswith(_INVALID_ARGUMENTS):  # a script refused its arguments and wrote nothing
        return InvalidInput(text.split(" script: ", 1)[0][len(_INVALID_ARGUMENTS):].strip())
    if "DB index is out of range" in text:  # redis://host/99 on a 16-database server
        return ConfigurationError(f"the Redis URL names a database this server does not have ({text}); "
                                  f"use one in 0..(databases-1), usually 0..15")
    return None


#: Seconds to wait for the server to confirm a wake-up subscription.
DEFAULT_SUBSCRIBE_TIMEOUT = 5.0


class _PubSubListener:
    """The wake-up subscription of one worker (``enqueue_listener``)."""

    def __init__(self, pubsub: Any) -> None:
        self.pubsub = pubsub

    def receive(self, timeout: float) -> list[str]:
        message = self.pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        if message is None or message["type"] not in ("message", "pmessage"):
            return []
        return [str(message["data"])]

    def close(self) -> None:
        self.pubsub.close()
