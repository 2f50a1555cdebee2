"""The storage connection shared by every invocation of a warm Lambda container.

The URL comes from, in order: ``RDQ_STORAGE_URL``; a Secrets Manager secret
(``RDQ_STORAGE_URL_SECRET``: an ARN or name whose value is the URL, or JSON ``{"url": ...}``);
an SSM parameter (``RDQ_STORAGE_URL_PARAMETER``, SecureString allowed). Secret and parameter are
fetched through Powertools Parameters and cached for ``RDQ_STORAGE_URL_CACHE_SECONDS`` (300), so a
warm container does not call Secrets Manager per invocation yet picks up a rotated URL.
"""

from __future__ import annotations

import json
import os
import threading

from ..errors import ConfigurationError
from ..storage import DEFAULT_SQLITE_URL, open_storage
from ..storage.spi import Storage
from .settings import Settings

_lock = threading.Lock()
_open: tuple[str, Storage] | None = None


def resolve_storage_url() -> str:
    direct = os.environ.get("RDQ_STORAGE_URL")
    if direct:
        return direct
    max_age = int(os.environ.get("RDQ_STORAGE_URL_CACHE_SECONDS", "300"))
    secret = os.environ.get("RDQ_STORAGE_URL_SECRET")
    if secret:
        from aws_lambda_powertools.utilities import parameters

        return _url_from_secret_value(parameters.get_secret(secret, max_age=max_age))
    parameter = os.environ.get("RDQ_STORAGE_URL_PARAMETER")
    if parameter:
        from aws_lambda_powertools.utilities import parameters

        return str(parameters.get_parameter(parameter, decrypt=True, max_age=max_age)).strip()
    return DEFAULT_SQLITE_URL


def _url_from_secret_value(value: object) -> str:
    if isinstance(value, bytes):
        value = value.decode()
    text = str(value).strip()
    if text.startswith("{"):
        data = json.loads(text)
        url = data.get("url") or data.get("storage_url")
        if not url:
            raise ConfigurationError("the storage secret is JSON without a 'url' key")
        return str(url)
    return text


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
    if previous is not None:
        previous[1].close()
