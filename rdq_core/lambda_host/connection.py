"""The storage connection shared by every invocation of a warm Lambda container.

The URL comes from, in order: ``RDQ_STORAGE_URL``; a Secrets Manager secret
(``RDQ_STORAGE_URL_SECRET``: an ARN or name whose value is the URL, JSON ``{"url": ...}``, or
the JSON of a database secret, ``{"username": ..., "password": ...}`` as RDS manages it, whose
credentials go into ``RDQ_STORAGE_ENDPOINT`` or the secret's own ``host``/``port``/``dbname``);
an SSM parameter (``RDQ_STORAGE_URL_PARAMETER``, SecureString allowed). Secret and parameter are
fetched through Powertools Parameters and cached for ``RDQ_STORAGE_URL_CACHE_SECONDS`` (300), so a
warm container does not call Secrets Manager per invocation yet picks up a rotated URL. The SDK
clients behind them are rdq's (``rdq_core.aws_clients``: seconds, not minutes, and one attempt),
so an unreachable endpoint fails the cold start fast instead of hanging it.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from ..aws_clients import aws_client
from ..errors import ConfigurationError
from ..storage import DEFAULT_SQLITE_URL, open_storage
from ..storage.spi import Storage
from .settings import Settings

_lock = threading.Lock()
_open: tuple[str, Storage] | None = None
_providers: dict[str, Any] = {}


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
        return _url_from_secret_value(_provider("secrets").get(secret, max_age=max_age))
    parameter = os.environ.get("RDQ_STORAGE_URL_PARAMETER")
    if parameter:
        return str(_provider("ssm").get(parameter, decrypt=True, max_age=max_age)).strip()
    return DEFAULT_SQLITE_URL


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
    if previous is not None:
        previous[1].close()
