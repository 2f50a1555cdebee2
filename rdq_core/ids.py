"""Sortable task ids (ULID: 48-bit millisecond time + 80 random bits, Crockford base32)."""

from __future__ import annotations

import os
import threading
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_task_id() -> str:
    return _encode((int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big"))


_sequence_lock = threading.Lock()
_last_sequential = 0


def new_sequential_id() -> str:
    """A ULID that sorts after every one this process made before, even within one millisecond
    or when the clock steps back (the random part counts up instead): for records kept in the
    order they were written, such as audit entries, whose store instant may tie."""
    global _last_sequential
    with _sequence_lock:
        value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
        if value <= _last_sequential:
            value = _last_sequential + 1
        _last_sequential = value
    return _encode(value)


def _encode(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))
