"""Opening a Redis client from an rdq URL: the key prefix, Cluster or not, and bounded calls.

``redis://host:port/db?prefix=rdq`` (``rediss://`` for TLS; ``&cluster=true`` for Redis
Cluster). Other query parameters go to redis-py (e.g. ``socket_timeout``) and win over the
defaults below.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...errors import ConfigurationError

log = logging.getLogger(__name__)

_PREFIX = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
#: Seconds to open a connection, and to wait for any reply (a script runs in milliseconds).
DEFAULT_CONNECT_TIMEOUT = 5
DEFAULT_SOCKET_TIMEOUT = 30
#: Seconds a pooled connection may sit idle before it is checked with a PING on reuse.
DEFAULT_HEALTH_CHECK_INTERVAL = 30
#: redis-py URL options that would make it resend a command after a timeout or error.
_RESEND_OPTIONS = ("retry_on_timeout", "retry_on_error")


def open_client(url: str) -> tuple[Any, str]:
    """``(client, key prefix)`` for ``url``; ``ConfigurationError`` for a malformed prefix."""
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    prefix = options.pop("prefix", "rdq")
    if not _PREFIX.match(prefix):
        raise ConfigurationError(f"invalid Redis key prefix {prefix!r}: use 1-64 of A-Z a-z 0-9 . _ : -")
    cluster = options.pop("cluster", "").lower() in ("1", "true", "yes")
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
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(client_url, **client_options), prefix
        return redis.Redis.from_url(client_url, **client_options), prefix
    except ValueError as exc:  # redis-py's word for a URL or option it cannot read
        raise ConfigurationError(f"invalid Redis URL: {exc}") from exc
