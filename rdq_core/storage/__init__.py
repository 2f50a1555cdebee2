"""Storage backends behind one SPI. ``open_storage(url)`` picks the backend by URL scheme.

| scheme | backend | URL example |
| --- | --- | --- |
| ``sqlite`` | ``rdq_core.storage.sqlite`` | ``sqlite:///rdq.db`` (relative), ``sqlite:////abs/rdq.db`` |
| ``postgresql``, ``postgres`` | ``rdq_core.storage.postgres`` | ``postgresql://user@host/db`` |
| ``redis``, ``rediss`` | ``rdq_core.storage.redis`` | ``redis://host:6379/0?prefix=rdq`` |
| ``mongodb``, ``mongodb+srv`` | ``rdq_core.storage.mongo`` | ``mongodb://host:27017/rdq`` |
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Callable
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from ..errors import ConfigurationError, InvalidInput
from .spi import Storage

DEFAULT_SQLITE_URL = "sqlite:///rdq.db"

_BACKENDS = {
    "sqlite": "rdq_core.storage.sqlite:SQLiteStorage",
    "postgresql": "rdq_core.storage.postgres:PostgresStorage",
    "postgres": "rdq_core.storage.postgres:PostgresStorage",
    "redis": "rdq_core.storage.redis:RedisStorage",
    "rediss": "rdq_core.storage.redis:RedisStorage",
    "mongodb": "rdq_core.storage.mongo:MongoStorage",
    "mongodb+srv": "rdq_core.storage.mongo:MongoStorage",
}


def register_backend(scheme: str, target: str) -> None:
    """Make ``open_storage`` serve ``scheme`` with a third-party backend (``"module:Class"``)."""
    _BACKENDS[scheme.lower()] = target


#: Query parameters that carry a credential (compared lower-case, without ``_`` and ``-``): both
#: libpq (``password``, ``sslpassword``) and redis-py (``password``) read them from the URL.
_SECRET_PARAMETERS = frozenset({
    "password", "passwd", "pwd", "pass", "sslpassword", "secret", "token", "key", "accesskey", "secretkey",
    "apikey", "sessiontoken", "awssessiontoken", "clientsecret", "authtoken", "accesstoken",
    "authmechanismproperties",  # MongoDB: may hold AWS_SESSION_TOKEN:...
})
_SECRET_SUFFIXES = ("password", "passwd", "secret", "token")


def _is_secret_parameter(name: str) -> bool:
    bare = unquote_plus(name).lower().replace("_", "").replace("-", "")
    return bare in _SECRET_PARAMETERS or bare.endswith(_SECRET_SUFFIXES)


def redact_url(url: str) -> str:
    """``url`` with every credential replaced by ``***``: the password of its userinfo and the
    value of any credential-bearing query parameter (``?password=``, ``sslpassword``, ``token``,
    ...). For banners, logs and errors: every place that shows a storage URL goes through here."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # Unparseable (e.g. an unclosed "[" in the host): nothing in it can be shown safely.
        return f"{url.split(':', 1)[0][:20]}://***" if "://" in url else "***"
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = "&".join(
        f"{name}=***" if sep and _is_secret_parameter(name) else f"{name}{sep}{value}"
        for name, sep, value in (item.partition("=") for item in parts.query.split("&"))
    ) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def default_storage_url() -> str:
    return os.environ.get("RDQ_STORAGE_URL") or DEFAULT_SQLITE_URL


def open_storage(url: str | None = None) -> Storage:
    """Open the backend named by ``url`` (default: ``$RDQ_STORAGE_URL``, else ``sqlite:///rdq.db``).

    Backends are imported lazily so a Lambda package only needs the driver it uses.
    """
    url = url or default_storage_url()
    scheme = urlsplit(url).scheme.lower()
    target = _BACKENDS.get(scheme)
    if target is None:
        raise InvalidInput(f"unsupported storage URL scheme {scheme!r}; expected one of {sorted(_BACKENDS)}", "storage_url")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _DRIVERS:
            raise
        raise ConfigurationError(missing_driver_message(scheme, missing)) from None
    backend: Callable[[str], Storage] = getattr(module, class_name)
    return backend(url)


#: The driver each backend imports, and the extra of the rdq package that installs it.
_DRIVERS = {"psycopg": "postgres", "redis": "redis", "pymongo": "mongo"}


def missing_driver_message(scheme: str, driver: str) -> str:
    """What to install for a backend whose driver is not importable: from a clone of the
    repository (rdq_core next to its pyproject.toml) the editable install, else the package's extra."""
    extra = _DRIVERS[driver]
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "rdq_core").is_dir():
        where = "." if Path.cwd().resolve() == checkout else str(checkout)
        command = f"python -m pip install -e '{where}[{extra}]'"
    else:
        command = f"python -m pip install 'rdq[{extra}]'"
    return f"{scheme}:// storage needs the {driver} driver, which is not installed: {command}"


__all__ = ["Storage", "open_storage", "register_backend", "default_storage_url", "redact_url", "DEFAULT_SQLITE_URL",
           "missing_driver_message"]
