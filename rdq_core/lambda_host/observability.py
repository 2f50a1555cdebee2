"""Powertools Logger, Metrics (CloudWatch EMF) and Tracer for the three functions.

* Logs are JSON lines. While a handler runs, every line carries ``task_id``, ``queue`` and
  ``attempt`` (the engine's own ``rdq.*`` loggers share the Powertools formatter, so their lines
  carry them too). Payloads and results are never logged.
* The engine reports through ``rdq_core.telemetry.Telemetry``; ``MetricsTelemetry`` forwards those
  counts to EMF under the names the template's alarms and dashboards use.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.metrics import MetricUnit, single_metric

from ..handlers import HandlerRegistry, HandlerSpec, TaskContext
from ..telemetry import Telemetry

SERVICE = os.environ.get("POWERTOOLS_SERVICE_NAME", "rdq")
NAMESPACE = os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "rdq")

# An invocation that touched no task has nothing to report; that is normal, not a warning.
warnings.filterwarnings("ignore", message="No application metrics to publish")

logger = Logger(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)


class _TracingOff:
    """Stands in for the Powertools Tracer when tracing is off: the X-Ray SDK (and the botocore
    it pulls in) costs ~0.3 s of every cold start, so it is imported only when tracing is on."""

    def capture_lambda_handler(self, *args: Any, **kwargs: Any) -> Any:
        if args and callable(args[0]):
            return args[0]
        return lambda handler: handler


def _tracing_enabled() -> bool:
    return os.environ.get("POWERTOOLS_TRACE_DISABLED", "").lower() not in ("1", "true")


if _tracing_enabled():
    from aws_lambda_powertools import Tracer

    tracer: Any = Tracer(service=SERVICE)
else:
    tracer = _TracingOff()

# The engine logs through stdlib loggers named ``rdq.*``; give them the Powertools formatter so
# they come out as the same JSON lines with the same appended task keys.
logging.getLogger("rdq").setLevel(logger.log_level)
copy_config_to_registered_loggers(source_logger=logger, include={"rdq"})

#: Engine telemetry name -> (EMF metric name, unit).
_METRIC_NAMES = {
    "claimed": ("Claimed", MetricUnit.Count),
    "succeeded": ("Succeeded", MetricUnit.Count),
    "retried": ("Retried", MetricUnit.Count),
    "dead_lettered": ("DeadLettered", MetricUnit.Count),
    "lease_expired": ("LeaseExpired", MetricUnit.Count),
    "released": ("Released", MetricUnit.Count),
    "too_long_for_worker": ("TooLongForWorker", MetricUnit.Count),
    "stale_settlements": ("StaleSettlements", MetricUnit.Count),
    "claim_latency_ms": ("ClaimLatency", MetricUnit.Milliseconds),
}


class MetricsTelemetry(Telemetry):
    """Engine telemetry that also lands in CloudWatch as EMF metrics."""

    def count(self, name: str, value: int = 1) -> None:
        super().count(name, value)
        if value:
            metric, unit = _METRIC_NAMES.get(name, (name, MetricUnit.Count))
            metrics.add_metric(name=metric, unit=unit, value=value)

    def timing_ms(self, name: str, value_ms: float) -> None:
        super().timing_ms(name, value_ms)
        metric, unit = _METRIC_NAMES.get(name, (name, MetricUnit.Milliseconds))
        metrics.add_metric(name=metric, unit=unit, value=value_ms)


def publish_queue_gauge(queue: str, name: str, value: float, unit: str = MetricUnit.Count) -> None:
    """A per-queue gauge (dimension ``queue``), flushed at once as its own EMF blob."""
    if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() in ("1", "true"):
        return  # single_metric does not honour the switch that Metrics does
    with single_metric(name=name, unit=unit, value=value, namespace=NAMESPACE, default_dimensions=metrics.default_dimensions) as metric:
        metric.add_dimension(name="service", value=SERVICE)
        metric.add_dimension(name="queue", value=queue)


class LoggedRegistry(HandlerRegistry):
    """A view of a handler registry whose handlers run with task keys on every log line.

    Wrapping here (rather than in the engine) keeps ``rdq_core`` free of Powertools; the runner
    only sees ordinary handler specs.
    """

    def __init__(self, inner: HandlerRegistry) -> None:
        super().__init__()
        self._inner = inner
        self._wrapped: dict[str, HandlerSpec] = {}

    def get(self, name: str) -> HandlerSpec | None:
        spec = self._inner.get(name)
        if spec is None:
            return None
        cached = self._wrapped.get(name)
        if cached is None or cached.timeout_seconds != spec.timeout_seconds or getattr(cached.func, "__wrapped__", None) is not spec.func:
            cached = HandlerSpec(spec.name, _with_task_keys(spec.func), spec.timeout_seconds)
            self._wrapped[name] = cached
        return cached

    def names(self) -> list[str]:
        return self._inner.names()


def _with_task_keys(func: Any) -> Any:
    def run(payload: Any, ctx: TaskContext) -> Any:
        logger.thread_safe_append_keys(task_id=ctx.task_id, queue=ctx.queue, attempt=ctx.attempt)
        try:
            logger.info("task started", extra={"redrive_count": ctx.redrive_count})
            try:
                result = func(payload, ctx)
            except BaseException as exc:
                logger.info("task failed", extra={"error_type": type(exc).__name__})
                raise
            logger.info("task finished")
            return result
        finally:
            logger.thread_safe_remove_keys(["task_id", "queue", "attempt"])

    run.__wrapped__ = func  # type: ignore[attr-defined]
    return run
