"""The signature on every request to an HTTPS target, and how a receiver checks it.

Header (one per request)::

    Rdq-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>]

Each ``v1`` is the lowercase hex HMAC-SHA256, keyed with one of the target's secrets (its UTF-8
bytes), of the bytes ``<t>.<body>``: the decimal timestamp, one ``.``, then the raw request body
exactly as received. A target with two secrets (a rotation in progress) sends two ``v1`` values,
one per secret; a receiver accepts the request when any ``v1`` equals the HMAC under any secret it
holds, and when ``t`` is within its tolerance of its own clock (default 300 s), which bounds the
replay of a captured request. Rotation therefore never drops a request: add the new secret to the
binding (both are sent), move the receivers to the new one, then remove the old.

``verify_signature`` is that check for Python receivers; ``docs/targets.md`` has a test vector
for any other language.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Iterable, Mapping

from .errors import InvalidSignature

SIGNATURE_HEADER = "Rdq-Signature"
SCHEME = "v1"
#: How far a signed timestamp may be from the receiver's clock, either way.
DEFAULT_TOLERANCE_SECONDS = 300.0


def signature(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """The ``v1`` value for ``body`` signed at ``timestamp`` with ``secret``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def signature_header(secrets: Iterable[str | bytes], timestamp: int, body: bytes) -> str:
    """The ``Rdq-Signature`` value: the timestamp, then one ``v1`` per secret."""
    return ",".join([f"t={timestamp}", *(f"{SCHEME}={signature(s, timestamp, body)}" for s in secrets)])


def verify_signature(headers: Mapping[str, str], body: bytes, secrets: str | bytes | Iterable[str | bytes], *,
                     tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS, now: float | None = None) -> None:
    """Check that ``body`` came from rdq: return quietly, or raise ``InvalidSignature`` saying why.

    ``headers``: the request's headers (any mapping; the name is matched case-insensitively).
    ``body``: the raw bytes as received, before any JSON parsing. ``secrets``: one secret or
    several (during a rotation, both the old and the new)."""
    if isinstance(secrets, (str, bytes)):
        secrets = [secrets]
    keys = [s for s in secrets if s]
    if not keys:
        raise InvalidSignature("no secret to verify with")
    value = _header(headers, SIGNATURE_HEADER)
    if value is None:
        raise InvalidSignature(f"no {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    offered: list[str] = []
    for part in value.split(","):
        name, _, item = part.strip().partition("=")
        if name == "t" and item.isdigit() and len(item) <= 12:
            timestamp = int(item)
        elif name == SCHEME and item:
            offered.append(item)
    if timestamp is None or not offered:
        raise InvalidSignature(f"{SIGNATURE_HEADER} must carry t=<unix seconds> and at least one {SCHEME}=<hex>")
    age = (time.time() if now is None else now) - timestamp
    if abs(age) > tolerance_seconds:
        raise InvalidSignature(f"signature timestamp is {age:.0f}s away from now (tolerance {tolerance_seconds:g}s)")
    expected = [signature(key, timestamp, body).encode() for key in keys]
    # compare_digest on every pair: the time taken does not say how much of a guess was right.
    if not any(hmac.compare_digest(want, got.encode("utf-8", "surrogateescape"))
               for want in expected for got in offered):
        raise InvalidSignature("no signature matches the body under any of the given secrets")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    lowered = name.lower()
    for key, item in headers.items():
        if key.lower() == lowered:
            return item
    return None
