"""What ``rdq dev`` sets before the Lambda host modules are imported, and where it may listen."""

from __future__ import annotations

import ipaddress
import os

from ...errors import ConfigurationError


def configure_environment(storage_url: str, handler_modules: list[str] | None) -> None:
    # Set before the Lambda host modules are imported: Powertools reads its settings at import.
    os.environ["RDQ_STORAGE_URL"] = storage_url
    os.environ["RDQ_HANDLERS"] = ",".join(handler_modules or ["rdq_core.examples"])
    os.environ.setdefault("RDQ_WORKER_FUNCTION", "rdq-dev-worker")
    os.environ.setdefault("RDQ_WAKE_DEBOUNCE_SECONDS", "0.2")
    os.environ.setdefault("RDQ_MAX_WORKER_CONCURRENCY", "2")
    os.environ.setdefault("RDQ_AUTH_MODE", "none")
    # Large payloads (rdq_core/engine/payloads.py): without a bucket, a directory next to the store stands
    # in for it (same references; the API's upload and download URLs are file: URLs into it).
    if not os.environ.get("RDQ_PAYLOAD_BUCKET"):
        database = storage_url.split("?")[0][len("sqlite:///"):] if storage_url.startswith("sqlite:///") else ""
        home = os.path.dirname(os.path.abspath(database)) if database and database != ":memory:" else os.getcwd()
        os.environ.setdefault("RDQ_PAYLOAD_DIR", os.path.join(home, "rdq-payloads"))
    # Each reaper tick advances bulk operations until the next tick is due: a running operation
    # keeps its rate, and reaping keeps its cadence.
    os.environ.setdefault("RDQ_OPERATION_SECONDS", os.environ.get("RDQ_DEV_REAPER_EVERY_SECONDS", "5"))
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "rdq-dev")
    os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
    # Nothing reads EMF here: record no metrics, so no blob is ever printed (not even
    # Powertools' automatic flush at 100 values, which ignores its own switch).
    os.environ["POWERTOOLS_METRICS_DISABLED"] = "true"
    # The handlers' logs go through this process's logging (rdq_core.engine.logs), not Powertools
    # JSON; and Powertools must not attach its duplicate-suppressing filter to our handler.
    os.environ["RDQ_LOCAL_LOGGING"] = "true"
    os.environ["POWERTOOLS_LOG_DEDUPLICATION_DISABLED"] = "true"
    os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # Lifecycle events (rdq_core/events.py) are on: without a bus the reaper logs each one and
    # GET /v1/events shows them.
    os.environ.setdefault("RDQ_EVENTS", "on")


def check_host(host: str) -> None:
    """The dev API has no TLS; without a token it must stay on the loopback interface."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not os.environ.get("RDQ_API_TOKEN"):
        raise ConfigurationError(f"refusing to serve the dev API on {host} without RDQ_API_TOKEN; use 127.0.0.1 or set a token")
