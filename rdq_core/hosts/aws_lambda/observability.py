"""Powertools Logger, Metrics (CloudWatch EMF) and Tracer for the three functions.

* Deployed, logs are Powertools JSON lines. While a handler runs, every line carries ``task_id``,
  ``queue`` and ``attempt`` (the engine's own ``rdq.*`` loggers share the Powertools formatter, so
  their lines carry them too); the engine writes one ``rdq.task`` line per outcome. Payloads and
  results are never logged.
* The engine reports through ``rdq_core.engine.telemetry.Telemetry``; ``MetricsTelemetry`` forwards those
  counts to EMF under the names the template's alarms and dashboards use.
* Under ``rdq dev`` (``RDQ_LOCAL_LOGGING=true``, set by ``rdq_core.hosts.dev`` before this module is
  imported) the Powertools logger writes nothing itself: its records, and the engine's, go to the
  process's own logging set up by ``rdq_core.engine.logs.configure_logging`` (readable text on a
  terminal, JSON lines otherwise), with the task keys on a handler's own lines. No metric is
  recorded while metrics are disabled (``POWERTOOLS_METRICS_DISABLED``, which ``rdq dev`` sets),
  so no EMF blob is ever printed locally.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.metrics import MetricUnit, single_metric

from ...engine.handlers import HandlerRegistry, HandlerSpec, TaskContext
from ...engine.logs import task_log_keys
from ...engine.telemetry import Telemetry
from ...engine.tracecontext import parse_traceparent

SERVICE = os.environ.get("POWERTOOLS_SERVICE_NAME", "rdq")
NAMESPACE = os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "rdq")
#: Set by ``rdq dev``: log through the process's own logging instead of Powertools JSON.
LOCAL_LOGGING_ENV = "RDQ_LOCAL_LOGGING"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


LOCAL_LOGGING = _truthy(os.environ.get(LOCAL_LOGGING_ENV))

# An invocation that touched no task has nothing to report; that is normal, not a warning.
warnings.filterwarnings("ignore", message="No application metrics to publish")

if LOCAL_LOGGING:
    # The Powertools logger keeps its API (append_keys, inject_lambda_context) but has no output
    # of its own: its records propagate to the root logger that rdq_core.engine.logs configured, at
    # the level configured there.
    logger = Logger(service=SERVICE, logger_handler=logging.NullHandler())
    logger.setLevel(logging.NOTSET)
else:
    logger = Logger(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)


def metrics_enabled() -> bool:
    """False when Powertools metrics are switched off (``POWERTOOLS_METRICS_DISABLED``, or
    ``POWERTOOLS_DEV`` without it), as Powertools decides. Then nothing is recorded at all:
    Powertools skips the flush of a disabled ``Metrics`` but not the automatic flush at 100
    values of one metric, which would print an EMF blob anyway."""
    disabled = os.environ.get("POWERTOOLS_METRICS_DISABLED")
    if disabled is not None:
        return not _truthy(disabled)
    return not _truthy(os.environ.get("POWERTOOLS_DEV"))


def add_metric(name: str, unit: MetricUnit, value: float) -> None:
    """``metrics.add_metric`` unless metrics are disabled."""
    if metrics_enabled():
        metrics.add_metric(name=name, unit=unit, value=value)


def log_invocation(message: str, summary: dict[str, Any], busy: bool) -> None:
    """A function's end-of-invocation summary: INFO in CloudWatch when it did something; under
    ``rdq dev`` always DEBUG (the per-task ``rdq.task`` lines already say what happened)."""
    (logger.info if busy and not LOCAL_LOGGING else logger.debug)(message, extra={"summary": summary})


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

if not LOCAL_LOGGING:
    # The engine logs through stdlib loggers named ``rdq.*``; give them the Powertools formatter
    # so they come out as the same JSON lines with the same appended task keys.
    logging.getLogger("rdq").setLevel(logger.log_level)
    copy_config_to_registered_loggers(source_logger=logger, include={"rdq"})

#: Engine telemetry name -> (EMF metric name, unit).
_METRIC_NAMES = {
    "claimed": ("Claimed", MetricUnit.Count),
    "succeeded": ("Succeeded", MetricUnit.Count),
    "retried": ("Retried", MetricUnit.Count),
    "snoozed": ("Snoozed", MetricUnit.Count),
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
            add_metric(metric, unit, value)

    def timing_ms(self, name: str, value_ms: float) -> None:
        super().timing_ms(name, value_ms)
        metric, unit = _METRIC_NAMES.get(name, (name, MetricUnit.Milliseconds))
        add_metric(metric, unit, value_ms)


def publish_queue_gauge(queue: str, name: str, value: float, unit: MetricUnit = MetricUnit.Count) -> None:
    """A per-queue gauge (dimension ``queue``), flushed at once as its own EMF blob."""
    if not metrics_enabled():
        return  # single_metric does not honour the switch that Metrics does
    with single_metric(
        name=name, unit=unit, value=value, namespace=NAMESPACE, default_dimensions=metrics.default_dimensions
    ) as metric:
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
        if (cached is None or cached.timeout_seconds != spec.timeout_seconds
                or getattr(cached.func, "__wrapped__", None) is not spec.func):
            cached = HandlerSpec(spec.name, _with_task_keys(spec.func, spec.name), spec.timeout_seconds)
            self._wrapped[name] = cached
        return cached

    def names(self) -> list[str]:
        return self._inner.names()


def _with_task_keys(func: Any, handler: str = "") -> Any:
    # No "task finished" line: the engine writes one ``rdq.task`` line per outcome (with the
    # task, handler, try, outcome, duration and error type); this only puts the task keys on
    # the lines the handler itself logs while it runs (and, with tracing on, the X-Ray subsegment).
    def run(payload: Any, ctx: TaskContext) -> Any:
        keys = {"task_id": ctx.task_id, "queue": ctx.queue, "attempt": ctx.attempt}
        logger.thread_safe_append_keys(**keys)
        try:
            with task_log_keys(**keys), _xray_subsegment(ctx, handler):
                logger.debug("task started", extra={"redrive_count": ctx.redrive_count})
                return func(payload, ctx)
        finally:
            logger.thread_safe_remove_keys(list(keys))

    run.__wrapped__ = func  # type: ignore[attr-defined]  # the marker _wrapped compares against
    return run


# -- X-Ray: the task's trace id (rdq_core.engine.tracecontext) -------------------------------------------
def _xray_subsegment(ctx: TaskContext, handler: str) -> AbstractContextManager[Any]:
    """With tracing on (``EnableTracing``), the handler runs in an X-Ray subsegment ``## rdq
    <handler>`` of the invocation's trace, annotated with the task and, when the task carries a
    trace context, ``rdq_trace_id``: its W3C trace id in X-Ray's spelling, so the X-Ray console
    finds every run of one enqueue (``annotation.rdq_trace_id = "1-…"``). An X-Ray trace is one
    invocation: a worker runs many tasks of many traces, so the task's trace cannot be the
    invocation's own. A failure here never fails the task."""
    if isinstance(tracer, _TracingOff):
        return _NO_SUBSEGMENT
    stack = ExitStack()
    try:
        subsegment = stack.enter_context(tracer.provider.in_subsegment(name=f"## rdq {handler or ctx.queue}"))
        annotate_xray(subsegment, ctx)
    except Exception:  # the X-Ray SDK refusing (no segment, a full buffer) is logged, not raised
        logger.debug("could not open the task's X-Ray subsegment", exc_info=True)
    return stack


_NO_SUBSEGMENT: AbstractContextManager[Any] = nullcontext()


def annotate_xray(subsegment: Any, ctx: TaskContext) -> None:
    """The task's X-Ray annotations (indexed, searchable) and its ``traceparent`` as metadata."""
    subsegment.put_annotation("rdq_task_id", ctx.task_id)
    subsegment.put_annotation("rdq_queue", ctx.queue)
    subsegment.put_annotation("rdq_attempt", ctx.attempt)
    parent = parse_traceparent(ctx.traceparent)
    if parent is not None:
        subsegment.put_annotation("rdq_trace_id", parent.xray_trace_id)
        subsegment.put_metadata("traceparent", parent.header, "rdq")
