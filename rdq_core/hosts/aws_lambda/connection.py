"""The storage connection shared by every invocation of a warm Lambda container.

The URL comes from, in order: ``RDQ_STORAGE_URL``; a Secrets Manager secret
(``RDQ_STORAGE_URL_SECRET``: an ARN or name whose value is the URL, JSON ``{"url": ...}``, or
the JSON of a database secret, ``{"username": ..., "password": ...}`` as RDS manages it, whose
credentials go into ``RDQ_STORAGE_ENDPOINT`` or the secret's own ``host``/``port``/``dbname``);
an SSM parameter (``RDQ_STORAGE_URL_PARAMETER``, SecureString allowed). Secret and parameter are
fetched through Powertools Parameters and cached for ``RDQ_STORAGE_URL_CACHE_SECONDS`` (300), so a
warm container does not call Secrets Manager per invocation yet picks up a rotated URL. The SDK
clients behind them are rdq's (``rdq_core.aws.clients``: seconds, not minutes, and one attempt),
so an unreachable endpoint fails the cold start fast instead of hanging it.

A refresh that fails after a good value (a Secrets Manager or SSM blip, an unreadable rotated
value) does not fail the invocation: the last good URL, and the connection open on it, stay in
use, a WARNING is logged, and the refresh is tried again after a backoff (5 s, doubling, at most
the cache age) rather than on every invocation. Only a first resolution that fails raises.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote, urlsplit, urlunsplit

from ...aws.clients import aws_client
from ...errors import ConfigurationError
from ...storage import DEFAULT_SQLITE_URL, open_storage
from ...storage.spi import Storage
from .settings import Settings

_lock = threading.Lock()
_open: tuple[str, Storage] | None = None
_providers: dict[str, Any] = {}

log = logging.getLogger("rdq.lambda_host.connection")

#: The first wait before a failed refresh is tried again; it doubles per failure, up to the cache age.
REFRESH_BACKOFF_SECONDS = 5.0
#: The clock of the refresh backoff (monotonic; tests replace it).
_clock: Callable[[], float] = time.monotonic


@dataclass
class _LastGood:
    """The last URL a secret or parameter gave, and when its failed refresh may be tried again."""

    url: str
    failures: int = 0
    retry_at: float = 0.0


_last_good: dict[str, _LastGood] = {}


def _provider(kind: str) -> Any:
    """Powertools' provider for ``secrets`` or ``ssm`` over an rdq client, kept for the container
    (it holds the cache)."""
    with _lock:
        if kind not in _providers:
            from aws_lambda_powertools.utilities import parameters

            if kind == "secrets":
                _providers[kind] = parameters.SecretsProvider(boto3_client=aws_client("secretsmanager"))
            else:
                _providers[kind] = parameters.SSMProvider(boto3_client=aws_client("ssm"))
        return _providers[kind]


def resolve_storage_url() -> str:
    direct = os.environ.get("RDQ_STORAGE_URL")
    if direct:
        return direct
    max_age = int(os.environ.get("RDQ_STORAGE_URL_CACHE_SECONDS", "300"))
    secret = os.environ.get("RDQ_STORAGE_URL_SECRET")
    if secret:
        return _refreshed(f"secret {secret}", max_age, lambda: _url_from_secret_value(
            _provider("secrets").get(secret, max_age=max_age)))
    parameter = os.environ.get("RDQ_STORAGE_URL_PARAMETER")
    if parameter:
        return _refreshed(f"parameter {parameter}", max_age, lambda: str(
            _provider("ssm").get(parameter, decrypt=True, max_age=max_age)).strip())
    return DEFAULT_SQLITE_URL


def _refreshed(source: str, max_age: int, fetch: Callable[[], str]) -> str:
    """``fetch()`` (Powertools answers from its cache while it is fresh), or the last good URL of
    ``source`` when a refresh fails. A live connection keeps working through a secrets outage;
    the backoff keeps a failing endpoint from costing every invocation its timeout."""
    with _lock:
        known = _last_good.get(source)
    if known is not None and known.failures and _clock() < known.retry_at:
        return known.url
    try:
        url = fetch()
    except Exception as exc:  # any failure of a refresh: the SDK, Powertools, a bad rotated value
        if known is None:
            raise  # nothing to fall back on: the cold start fails with the real error
        with _lock:
            known.failures += 1
            wait = min(REFRESH_BACKOFF_SECONDS * 2 ** (known.failures - 1), max(float(max_age), REFRESH_BACKOFF_SECONDS))
            known.retry_at = _clock() + wait
        # Never the value or the error's text: either may carry the URL and its password.
        log.warning("storage URL refresh failed; the last good URL stays in use",
                    extra={"source": source, "error_type": type(exc).__name__, "failures": known.failures,
                           "retry_in_seconds": wait})
        return known.url
    with _lock:
        if known is not None and known.failures:
            log.info("storage URL refresh recovered", extra={"source": source, "failures": known.failures})
        _last_good[source] = _LastGood(url)
    return url


def _url_from_secret_value(value: object) -> str:
    if isinstance(value, bytes):
        value = value.decode()
    text = str(value).strip()
    if text.startswith("{"):
        data = json.loads(text)
        url = data.get("url") or data.get("storage_url")
        if url:
            return str(url)
        if data.get("username") and data.get("password"):
            return _url_with_credentials(data)
        raise ConfigurationError("the storage secret is JSON without a 'url' key, nor 'username' and 'password'")
    return text


#: The URL scheme of a database secret's ``engine`` (the JSON RDS and its rotation functions write).
_ENGINE_SCHEMES = {"postgres": "postgresql", "postgresql": "postgresql", "aurora-postgresql": "postgresql"}


def _url_with_credentials(secret: dict[str, Any]) -> str:
    """A database secret's credentials inside ``RDQ_STORAGE_ENDPOINT`` (a URL without them, such as
    ``postgresql://db.xyz.rds.amazonaws.com:5432/rdq?sslmode=verify-full``), or inside a URL made of
    the secret's own ``engine``, ``host``, ``port`` and ``dbname`` (RDS-managed master secrets hold
    only username and password: they need the endpoint)."""
    endpoint = os.environ.get("RDQ_STORAGE_ENDPOINT", "").strip()
    if not endpoint:
        if not secret.get("host"):
            raise ConfigurationError("the storage secret holds username and password but no host: "
                                     "set the StorageEndpoint parameter (RDQ_STORAGE_ENDPOINT)")
        scheme = _ENGINE_SCHEMES.get(str(secret.get("engine") or "postgres"))
        if scheme is None:
            raise ConfigurationError(f"the storage secret's engine {secret.get('engine')!r} is not PostgreSQL: "
                                     "store the URL in the secret instead")
        port = f":{secret['port']}" if secret.get("port") else ""
        endpoint = f"{scheme}://{secret['host']}{port}/{secret.get('dbname') or 'postgres'}"
    parts = urlsplit(endpoint)
    if not parts.scheme or not parts.hostname:
        raise ConfigurationError("RDQ_STORAGE_ENDPOINT must be a URL such as postgresql://host:5432/db")
    host = parts.netloc.rpartition("@")[2]
    credentials = f"{quote(str(secret['username']), safe='')}:{quote(str(secret['password']), safe='')}"
    return urlunsplit(parts._replace(netloc=f"{credentials}@{host}"))


def shared_storage(settings: Settings | None = None) -> Storage:
    """The storage for this container, opened once and reused while the URL stays the same."""
    global _open
    settings = settings or Settings.from_env()
    url = resolve_storage_url()
    with _lock:
        if _open is not None and _open[0] == url:
            return _open[1]
        previous = _open
        storage = open_storage(url)
        if settings.auto_migrate:
            storage.migrate()
        _open = (url, storage)
    if previous is not None:
        previous[1].close()
    return storage


def close_shared_storage() -> None:
    global _open
    with _lock:
        previous, _open = _open, None
        _providers.clear()
        _last_good.clear()
    if previous is not None:
        previous[1].close()
