"""A target's signing secrets, resolved when a request is signed and kept for a few minutes.

``env:`` reads the process environment; ``ssm:`` and ``secretsmanager:`` call AWS through rdq's
bounded clients (``rdq_core.aws.clients``). A fetched value is kept ``max_age_seconds`` (300), so
a warm worker does not call AWS per task yet picks up a rotated value; a refresh that fails after
a good value keeps the good one (a WARNING), and one with no good value yet fails the attempt,
which is retried like any failure to reach the target.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

from ..aws.clients import aws_client
from .config import SecretRef
from .errors import TargetError

log = logging.getLogger("rdq.targets")

DEFAULT_MAX_AGE_SECONDS = 300.0


class SecretSource:
    """The current values of one target's secret references."""

    def __init__(self, refs: Sequence[SecretRef], *, max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.refs = tuple(refs)
        self.max_age_seconds = max_age_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._cached: dict[SecretRef, tuple[float, str]] = {}

    def values(self) -> list[str]:
        return [self._value(ref) for ref in self.refs]

    def _value(self, ref: SecretRef) -> str:
        if ref.kind == "literal":
            return ref.name
        if ref.kind == "env":
            value = os.environ.get(ref.name, "")
            if not value:
                raise TargetError(f"signing secret {ref.describe()} is not set in this process's environment")
            return value
        with self._lock:
            cached = self._cached.get(ref)
        if cached is not None and self.clock() - cached[0] < self.max_age_seconds:
            return cached[1]
        try:
            value = _fetch(ref)
        except Exception as exc:  # noqa: BLE001 - any failure of AWS or of the value itself
            if cached is None:
                raise TargetError(f"signing secret {ref.describe()} could not be read: {type(exc).__name__}: "
                                  f"{exc}") from None
            log.warning("refreshing signing secret %s failed (%s); the last good value stays in use",
                        ref.describe(), type(exc).__name__)
            value = cached[1]
        with self._lock:
            self._cached[ref] = (self.clock(), value)
        return value


def _fetch(ref: SecretRef) -> str:
    if ref.kind == "ssm":
        answer = aws_client("ssm").get_parameter(Name=ref.name, WithDecryption=True)
        value = str(answer["Parameter"]["Value"])
    else:
        value = str(aws_client("secretsmanager").get_secret_value(SecretId=ref.name).get("SecretString") or "")
    value = value.strip()
    if not value:
        raise ValueError("the value is empty")
    return value
