"""A bound handler name becomes an ordinary entry of the handler registry.

The engine cannot tell a target from a Python handler: the same claim, lease, timeout
(``timeout_seconds`` of the binding), retry policy, dead-lettering, history and flow control
apply. A name bound to a target and also registered by a Python module is a
``ConfigurationError``, and so is a name bound again to another target. Binding the same
configuration again is a no-op.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from ..engine.handlers import HandlerRegistry, TaskContext, registry
from .config import HttpsTarget, LambdaTarget, Target


class TargetHandler:
    """The function registered under a bound name: it calls the target with the task's envelope."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._caller: Any = None
        self._lock = threading.Lock()

    def __call__(self, payload: Any, ctx: TaskContext) -> Any:
        caller = self._caller
        if caller is None:
            with self._lock:
                # Made on first use: http.client, ssl and boto3 stay out of a worker's cold start.
                if self._caller is None:
                    self._caller = _caller(self.target)
                caller = self._caller
        return caller(payload, ctx)

    def __repr__(self) -> str:
        return f"<target {self.target.handler} -> {self.target.describe()}>"


def _caller(target: Target) -> Any:
    if isinstance(target, HttpsTarget):
        from .https import HttpsCaller

        return HttpsCaller(target)
    assert isinstance(target, LambdaTarget)
    from .lambda_invoke import LambdaCaller

    return LambdaCaller(target)


def bind_targets(targets: Mapping[str, Target], into: HandlerRegistry = registry) -> list[str]:
    """Register each binding as a handler; the names bound. A name already bound to the same
    target keeps its handler (and the caller's connections and cached secrets)."""
    for name, target in targets.items():
        existing = into.get(name)
        if existing is not None and isinstance(existing.func, TargetHandler) and existing.func.target == target:
            continue
        into.register(name, TargetHandler(target), target.timeout_seconds)
    return sorted(targets)
