"""Opening a Redis client from an rdq URL: the key prefix, Cluster or not, and bounded calls.

``redis://host:port/db?prefix=rdq`` (``rediss://`` for TLS). ``&cluster=true`` for Redis Cluster,
with ``&nodes=host:port,host:port`` naming more start-up nodes than the URL's host (a client
starting while that node is down still finds the cluster); ``&wait_replicas=N`` to have N
replicas confirm every script with ``WAIT``. Other query parameters go to redis-py (e.g.
``socket_timeout``) and win over the defaults below.

``send_pipeline`` sends many commands in one round trip on a single Redis and on a Cluster alike
(redis-py's cluster pipeline refuses ``EVALSHA`` through its method, and would resend commands
whose connection failed; rdq never resends what may have run).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.connection import parse_url
from redis.exceptions import AskError, RedisClusterException, ResponseError, TryAgainError
from redis.retry import Retry

from ...errors import ConfigurationError, StorageUnavailable

log = logging.getLogger(__name__)

_PREFIX = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
#: Seconds to open a connection, and to wait for any reply (a script runs in milliseconds).
DEFAULT_CONNECT_TIMEOUT = 5
DEFAULT_SOCKET_TIMEOUT = 30
#: Seconds a pooled connection may sit idle before it is checked with a PING on reuse.
DEFAULT_HEALTH_CHECK_INTERVAL = 30
#: redis-py URL options that would make it resend a command after a timeout or error.
_RESEND_OPTIONS = ("retry_on_timeout", "retry_on_error")


#: Milliseconds ``WAIT`` gives the replicas to confirm a write when ``wait_replicas`` is set.
DEFAULT_WAIT_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class Durability:
    """``wait_replicas``: how many replicas must confirm each script before it counts as done
    (0: Redis' own asynchronous replication, nothing waited for)."""

    replicas: int = 0
    timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS


def _durability(options: dict[str, str]) -> Durability:
    try:
        replicas = int(options.pop("wait_replicas", "0"))
        timeout_ms = int(options.pop("wait_timeout_ms", str(DEFAULT_WAIT_TIMEOUT_MS)))
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL: wait_replicas and wait_timeout_ms take integers ({exc})") from exc
    if replicas < 0 or timeout_ms < 1:
        raise ConfigurationError("invalid Redis URL: wait_replicas must be >= 0 and wait_timeout_ms >= 1")
    return Durability(replicas, timeout_ms)


def _startup_nodes(listed: str) -> list[ClusterNode]:
    nodes = []
    for address in filter(None, listed.split(",")):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"invalid Redis URL: nodes takes host:port,host:port (got {address!r})")
        nodes.append(ClusterNode(host, int(port)))  # type: ignore[no-untyped-call]
    return nodes


def open_client(url: str) -> tuple[Any, str, Durability]:
    """``(client, key prefix, durability)`` for ``url``; ``ConfigurationError`` for a malformed
    prefix or durability option."""
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    prefix = options.pop("prefix", "rdq")
    if not _PREFIX.match(prefix):
        raise ConfigurationError(f"invalid Redis key prefix {prefix!r}: use 1-64 of A-Z a-z 0-9 . _ : -")
    cluster = options.pop("cluster", "").lower() in ("1", "true", "yes")
    startup_nodes = _startup_nodes(options.pop("nodes", ""))
    durability = _durability(options)
    for name in _RESEND_OPTIONS:
        if options.pop(name, None) is not None:
            log.warning("ignoring %s in the Redis URL: rdq never resends a command", name)
    client_url = urlunsplit(parts._replace(query=urlencode(options)))
    # No automatic resend: a script whose reply was lost may have run, and resending a
    # claim or settle is not idempotent. Failures surface as StorageUnavailable instead.
    # Every call is bounded: the timeouts below apply unless the URL sets them (redis-py
    # lets URL options win), so a half-open connection raises instead of hanging.
    client_options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT,
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
        "socket_keepalive": True,
        # A connection idle this long is PINGed before reuse; a dead one fails there,
        # before any script was sent.
        "health_check_interval": DEFAULT_HEALTH_CHECK_INTERVAL,
        "retry": Retry(NoBackoff(), 0),
    }
    try:
        if cluster:
            # A URL redis-py cannot read is refused now, not at the first call.
            parse_url(client_url)  # type: ignore[no-untyped-call]
            return LazyCluster(client_url, {**client_options, "startup_nodes": startup_nodes}), prefix, durability
        return redis.Redis.from_url(client_url, **client_options), prefix, durability
    except ValueError as exc:  # redis-py's word for a URL or option it cannot read
        raise ConfigurationError(f"invalid Redis URL: {exc}") from exc


class LazyCluster:
    """A ``RedisCluster`` made at the first call. redis-py's reads the cluster's slot map when it
    is constructed, so a cluster that is down would make opening a store fail; a single Redis
    connects at the first call, and this makes a Cluster behave the same: an unreachable cluster
    is a ``ConnectionError`` on the call (``StorageUnavailable``), and the next call tries again."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self._url, self._options = url, options
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def connected(self) -> RedisCluster:
        with self._lock:
            if self._client is None:
                try:
                    self._client = RedisCluster.from_url(self._url, **self._options)
                except RedisClusterException as exc:
                    raise redis.ConnectionError(str(exc)) from exc
            return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connected(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def send_pipeline(client: Any, commands: Sequence[tuple[Any, ...]], durability: Durability = Durability(),
                  reads: Sequence[bool] = ()) -> list[Any]:
    """Send ``commands`` (each one command's argv) in one round trip, none of them ever resent.
    Replies come back in order; a command's error comes back as the exception, in its place.

    With ``durability.replicas``, each command is followed by ``WAIT`` on the same connection
    (on a Cluster: sent to the same node), and a command its replicas did not confirm in time
    gets ``StorageUnavailable`` in its place: it ran on the primary, but a failover now could
    lose it. Commands flagged in ``reads`` (read-only scripts) are not waited for: a read has
    nothing to confirm, and must work while a primary has no replica."""
    if durability.replicas and reads and all(reads):
        durability = Durability()
    if isinstance(client, LazyCluster):
        replies = _send_cluster_pipeline(client.connected(), commands, durability)
    else:
        pipe = client.pipeline(transaction=False)
        for argv in commands:
            pipe.execute_command(*argv)
            if durability.replicas:
                pipe.execute_command("WAIT", durability.replicas, durability.timeout_ms)
        replies = pipe.execute(raise_on_error=False)
    if not durability.replicas:
        return list(replies)
    return [_confirmed(reply, acks, durability) for reply, acks in zip(replies[::2], replies[1::2], strict=True)]


def _confirmed(reply: Any, acks: Any, durability: Durability) -> Any:
    if isinstance(reply, Exception) or (isinstance(acks, int) and acks >= durability.replicas):
        return reply
    if isinstance(acks, Exception):
        return acks
    return StorageUnavailable(
        f"Redis applied the write but only {acks} of {durability.replicas} replica(s) confirmed it within "
        f"{durability.timeout_ms} ms (wait_replicas): a failover now could lose it")


def _send_cluster_pipeline(client: Any, commands: Sequence[tuple[Any, ...]], durability: Durability) -> list[Any]:
    """redis-py's cluster pipeline with its resends turned off: it splits the commands by node
    and sends each node's share at once. A redirection (``MOVED``/``ASK``/``TRYAGAIN``: a
    failover or a slot migration) means the command did not run there, so it is sent again
    alone, through the client, which follows it; a failed connection surfaces as an error."""
    stack: list[Any] = []
    for argv in commands:
        stack.append(PipelineCommand(tuple(argv), {}, len(stack)))  # type: ignore[no-untyped-call]
        if durability.replicas:
            node = client.get_node_from_key(_first_key(argv))
            wait = ("WAIT", durability.replicas, durability.timeout_ms)
            stack.append(PipelineCommand(wait, {"target_nodes": node}, len(stack)))  # type: ignore[no-untyped-call]
    try:
        replies: list[Any] = client.pipeline().send_cluster_commands(stack, raise_on_error=False,
                                                                     allow_redirections=False)
    except (redis.ConnectionError, redis.TimeoutError):
        _refresh_slot_map(client)
        raise
    if any(isinstance(reply, (redis.ConnectionError, redis.TimeoutError)) for reply in replies):
        _refresh_slot_map(client)
    step = 2 if durability.replicas else 1
    for i in range(0, len(replies), step):
        if isinstance(replies[i], (AskError, TryAgainError)):  # MovedError is an AskError
            replies[i:i + step] = _send_alone(client, commands[i // step], durability)
    return replies


def _refresh_slot_map(client: Any) -> None:
    """A node is gone (a killed master): re-read the slot map now, as the client does for a
    single command, so the next call goes to the promoted replica. Nothing is resent."""
    try:
        client.nodes_manager.initialize()
    except (redis.RedisError, RedisClusterException):
        pass  # the cluster is unreachable as a whole: the next call tries again


def _send_alone(client: Any, argv: tuple[Any, ...], durability: Durability) -> list[Any]:
    try:
        reply = client.execute_command(*argv)
    except ResponseError as exc:
        return [exc, 0] if durability.replicas else [exc]
    if not durability.replicas:
        return [reply]
    # WAIT covers the writes of the connection it is sent on, and the client picked this one
    # itself: the command ran, but its replication cannot be confirmed.
    return [reply, StorageUnavailable("Redis applied the write after a redirection (a failover or a slot "
                                      "migration) but its replication is unconfirmed (wait_replicas)")]


def _first_key(argv: tuple[Any, ...]) -> Any:
    """The first key of an ``EVALSHA sha numkeys key...`` (every script rdq sends has one)."""
    return argv[3]
