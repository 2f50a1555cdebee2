"""Large payloads over HTTP: the presigned transfers of objects in the payload store, and the
checks a ``file:`` URL from ``rdq dev`` must pass before this machine's file is read or written."""

from __future__ import annotations

import http.client
import os
import ssl
import urllib.parse
import urllib.request
from typing import Mapping

from ..engine.payloads import PayloadRef
from ..errors import ApiUnavailable, ConfigurationError
from .auth import is_loopback
from .transport import ApiEndpoint

#: The name ``rdq dev`` gives its payload directory (next to its store).
DEV_PAYLOAD_DIR = "rdq-payloads"


def local_object_path(endpoint: ApiEndpoint, url: str, ref: PayloadRef, payload_dir: str | None) -> str:
    """The file a ``file:`` URL from the API at ``endpoint`` names, once it is safe to read or
    write: the API is ``rdq dev`` on this machine (http on a loopback address), and the file is
    the object ``ref`` names inside its payload directory -- ``payload_dir`` (``RDQ_PAYLOAD_DIR``)
    when set, else a directory named ``rdq-payloads``, as ``rdq dev`` names its own -- with no
    symbolic link or ``..`` leading elsewhere. Anything else is ``ConfigurationError``, and
    nothing is read or written: a server must not choose which of the caller's files to write."""
    refused = f"rdq API at {endpoint.api} answered a file: URL for a payload object"
    if endpoint.scheme != "http" or not is_loopback(endpoint.host):
        raise ConfigurationError(f"{refused}; only rdq dev on a loopback address may, not this API")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ConfigurationError(f"{refused} that names another host, a query or a fragment")
    path = urllib.request.url2pathname(parts.path)
    suffix = os.sep + ref.key.replace("/", os.sep)
    if not os.path.isabs(path) or not path.endswith(suffix) or ".." in path.split(os.sep):
        raise ConfigurationError(f"{refused} that is not the object {ref.key!r}")
    root = path[: -len(suffix)]
    expected = payload_dir or os.environ.get("RDQ_PAYLOAD_DIR", "").strip()
    real_root = os.path.realpath(root)
    if expected:
        if real_root != os.path.realpath(expected):
            raise ConfigurationError(f"{refused} outside the payload directory {expected!r}")
    elif os.path.basename(root) != DEV_PAYLOAD_DIR:
        raise ConfigurationError(f"{refused} outside a {DEV_PAYLOAD_DIR!r} directory; set payload_dir "
                                 "(RDQ_PAYLOAD_DIR) to rdq dev's payload directory")
    if os.path.realpath(path) != os.path.join(real_root, ref.key.replace("/", os.sep)):
        raise ConfigurationError(f"{refused} whose path leads out of the payload directory (a symbolic link)")
    return path


def local_transfer(method: str, path: str, data: bytes) -> bytes:
    """A PUT or GET of a checked path in ``rdq dev``'s payload directory; the last component is
    never followed if it is a symbolic link (it could be made one after the check)."""
    try:
        if method == "PUT":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            return b""
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ApiUnavailable(f"payload store: {method} of a local object failed ({exc.strerror})") from None


def presigned_transfer(method: str, url: str, headers: Mapping[str, str], data: bytes, timeout: float) -> bytes:
    """One presigned PUT or GET (no rdq credentials: the URL carries its own signature)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiUnavailable("payload store: the API answered an object URL that is not http(s) or file")
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=ssl.create_default_context())
        if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout))
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request(method, target, body=data if method == "PUT" else None,
                           headers={**headers, **({"Content-Length": str(len(data))} if method == "PUT" else {})})
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise ApiUnavailable(f"payload store at {parts.hostname}: {method} failed ({type(exc).__name__})") from None
    finally:
        connection.close()
    if response.status >= 300:
        raise ApiUnavailable(f"payload store at {parts.hostname} answered {response.status} to the presigned {method}")
    return body
