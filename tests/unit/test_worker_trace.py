"""The long-running ``rdq worker`` host (handlers on helper threads) restores the trace context
too: the handler runs under a span of the enqueuer's trace, and a retry links to the attempt
before it."""

from __future__ import annotations

import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import TaskStatus
from rdq_core.hosts.process.worker import Worker, WorkerConfig

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def test_rdq_worker_runs_each_attempt_in_the_enqueuers_trace_with_links(storage, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    seen: list[tuple[int, str | None, int]] = []

    def flaky(payload, ctx):
        seen.append((ctx.attempt, ctx.traceparent, threading.get_ident()))
        if ctx.attempt < 2:
            raise RuntimeError("first attempt fails")
        return "ok"

    registry = HandlerRegistry()
    registry.register("flaky", flaky, timeout_seconds=5)
    task = Client(storage).enqueue("tw", "flaky", traceparent=TRACEPARENT, backoff={"initial_seconds": 0, "jitter": 0})
    worker = Worker(storage, WorkerConfig(queues=["tw"], idle_poll_seconds=0.05), registry=registry)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        wait_until(lambda: storage.get(task.id).status is TaskStatus.SUCCEEDED, timeout=20, what="the retried task to succeed")
    finally:
        worker.stop()
        thread.join(10)
    assert [attempt for attempt, _, _ in seen] == [1, 2]
    assert all(tp.split("-")[1] == TRACE_ID for _, tp, _ in seen)
    assert threading.get_ident() not in {ident for _, _, ident in seen}, "handlers ran on the worker's own threads"
    first, second = sorted((s for s in exporter.get_finished_spans() if s.name == "run flaky"),
                           key=lambda s: s.attributes["rdq.attempt"])
    assert [f"{s.context.span_id:016x}" for s in (first, second)] == [tp.split("-")[2] for _, tp, _ in seen]
    (link,) = second.links
    assert link.context.span_id == first.context.span_id
