"""Configuration of the Lambda functions, read from their environment (set by template.yaml)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import ConfigurationError
from ...engine.retry import PolicyBook, policy_book_from_config

if TYPE_CHECKING:
    from ...targets import Target


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _number(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def _names(name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in os.environ.get(name, "").split(",") if part.strip())


#: The most handlers one worker invocation runs at once (the template's ``HandlerConcurrency`` bound).
MAX_HANDLER_CONCURRENCY = 64


@dataclass(frozen=True)
class Settings:
    #: Handler modules the worker imports (``RDQ_HANDLERS``, comma-separated).
    handler_modules: tuple[str, ...] = ()
    #: Queues the worker serves; empty means every queue the store knows (``list_queues``).
    queues: tuple[str, ...] = ()
    policies_json: str = ""
    #: Handler names bound to a Lambda function or an HTTPS endpoint (``RDQ_TARGETS``, the
    #: ``Targets`` parameter; ``rdq_core.targets``).
    targets_json: str = ""
    batch_size: int = 10
    #: Handlers one invocation runs at once (``RDQ_HANDLER_CONCURRENCY``, the ``HandlerConcurrency``
    #: parameter): as many claim loops on threads of their own, sharing ``batch_size`` between them.
    handler_concurrency: int = 1
    #: Added to the invocation's remaining time to size a lease: the lease must outlive the
    #: invocation, so a live Lambda is never overtaken by the reaper.
    lease_grace_seconds: float = 30.0
    #: Kept free at the end of an invocation to settle and release before Lambda stops us.
    settle_reserve_seconds: float = 2.0
    #: The worker function's timeout (``RDQ_WORKER_TIMEOUT_SECONDS``, set by the template);
    #: 0: taken from the invocation's first remaining-time reading, rounded up.
    worker_timeout_seconds: float = 0.0
    #: The most worker invocations that run at once, held by worker slots in the store
    #: (``RDQ_MAX_WORKER_CONCURRENCY``, the ``MaxWorkerConcurrency`` parameter).
    max_worker_concurrency: int = 4
    worker_function: str = ""
    #: The name the worker slots are kept under (``RDQ_WORKER_FLEET``; by default the worker
    #: function's name): the API and every worker of one deployment must name the same fleet.
    worker_fleet: str = "worker"
    #: Close the store connections left idle when a worker invocation ends
    #: (``RDQ_CLOSE_IDLE_CONNECTIONS``), so a frozen environment holds none.
    close_idle_connections: bool = True
    wake_worker: bool = True
    wake_debounce_seconds: float = 5.0
    reaper_batch_size: int = 100
    #: Seconds of each reaper invocation spent advancing bulk operations (after reaping), so an
    #: operation never delays the next scheduled reaping (``RDQ_OPERATION_SECONDS``).
    operation_seconds: float = 40.0
    #: Seconds of each reaper invocation kept for delivering lifecycle events (``RDQ_EVENT_SECONDS``;
    #: only when a bus is configured, see ``rdq_core/events.py``).
    event_seconds: float = 10.0
    #: Seconds of each reaper invocation spent on retention at most (``RDQ_RETENTION_SECONDS``), in
    #: chunks of ``RETENTION_CHUNK`` tasks: a backlog of old tasks is worked off over several ticks
    #: and never holds the reaper until the next tick finds it busy.
    retention_seconds: float = 10.0
    max_body_bytes: int = 1024 * 1024
    #: The bytes a list page's items may take in the Lambda response (``RDQ_RESPONSE_BUDGET_BYTES``;
    #: Lambda's limit is 6 MB): a page ends early, with a cursor, before it passes this.
    response_budget_bytes: int = 4_000_000
    #: Optional bearer token checked by the API handler itself (``rdq dev``; a deployed API
    #: authenticates at API Gateway with IAM or an API key instead).
    api_token: str = ""
    auth_mode: str = "iam"
    auto_migrate: bool = False

    @classmethod
    def from_env(cls) -> "Settings":
        settings = cls(
            handler_modules=_names("RDQ_HANDLERS"),
            queues=_names("RDQ_QUEUES"),
            policies_json=os.environ.get("RDQ_QUEUE_POLICIES", ""),
            targets_json=os.environ.get("RDQ_TARGETS", ""),
            batch_size=int(_number("RDQ_BATCH_SIZE", 10)),
            handler_concurrency=min(MAX_HANDLER_CONCURRENCY, max(1, int(_number("RDQ_HANDLER_CONCURRENCY", 1)))),
            lease_grace_seconds=_number("RDQ_LEASE_GRACE_SECONDS", 30.0),
            settle_reserve_seconds=_number("RDQ_SETTLE_RESERVE_SECONDS", 2.0),
            worker_timeout_seconds=_number("RDQ_WORKER_TIMEOUT_SECONDS", 0.0),
            max_worker_concurrency=max(1, int(_number("RDQ_MAX_WORKER_CONCURRENCY", 4))),
            worker_function=os.environ.get("RDQ_WORKER_FUNCTION", ""),
            worker_fleet=os.environ.get("RDQ_WORKER_FLEET", "").strip()
            or os.environ.get("RDQ_WORKER_FUNCTION", "").strip() or "worker",
            close_idle_connections=_flag("RDQ_CLOSE_IDLE_CONNECTIONS", True),
            wake_worker=_flag("RDQ_WAKE_WORKER", True),
            wake_debounce_seconds=_number("RDQ_WAKE_DEBOUNCE_SECONDS", 5.0),
            reaper_batch_size=int(_number("RDQ_REAPER_BATCH_SIZE", 100)),
            operation_seconds=_number("RDQ_OPERATION_SECONDS", 40.0),
            event_seconds=_number("RDQ_EVENT_SECONDS", 10.0),
            retention_seconds=_number("RDQ_RETENTION_SECONDS", 10.0),
            max_body_bytes=int(_number("RDQ_MAX_BODY_BYTES", 1024 * 1024)),
            response_budget_bytes=int(_number("RDQ_RESPONSE_BUDGET_BYTES", 4_000_000)),
            api_token=os.environ.get("RDQ_API_TOKEN", ""),
            auth_mode=os.environ.get("RDQ_AUTH_MODE", "iam"),
            auto_migrate=_flag("RDQ_AUTO_MIGRATE", False),
        )
        # Parsed here, as the function starts: a bad policy (a misspelled key) fails the start
        # with its own message instead of waiting for the first invocation that has work.
        settings.policy_book()
        settings.targets()
        return settings

    def targets(self) -> dict[str, Target]:
        if not self.targets_json.strip():
            return {}  # no bindings: their parser is not even imported
        from ...targets import targets_from_json

        return targets_from_json(self.targets_json)

    def policy_book(self) -> PolicyBook:
        try:
            config = json.loads(self.policies_json) if self.policies_json else None
        except ValueError as exc:
            raise ConfigurationError(f"RDQ_QUEUE_POLICIES is not valid JSON: {exc}") from None
        return policy_book_from_config(config)
