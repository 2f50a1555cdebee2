"""Trace context from the API request to the Lambda worker's handler, across retries.

The API function and the worker function run in-process on one SQLite store (the shipped
events); OpenTelemetry's SDK records the worker's spans in memory."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rdq_core import Client
from rdq_core.engine import tracecontext
from rdq_core.engine.handlers import TaskContext
from rdq_core.hosts.aws_lambda import connection, observability, worker
from rdq_core.validation import TRACEPARENT_HEADER, TRACESTATE_HEADER

from . import trace_handlers
from .conftest import load_event
from .test_api import call, request

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
ENQUEUER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{ENQUEUER_SPAN}-01"


@pytest.fixture
def spans(monkeypatch) -> InMemorySpanExporter:
    """An OpenTelemetry SDK provider for this test only (restored afterwards)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    return exporter


@pytest.fixture
def runs(store_url) -> list[tuple[str, int, str | None, str | None]]:
    trace_handlers.RUNS.clear()
    trace_handlers.CHILD_CLIENT.clear()
    yield trace_handlers.RUNS
    trace_handlers.CHILD_CLIENT.clear()


def enqueue(lambda_context, body: dict[str, Any], headers: dict[str, str], queue: str = "traced") -> tuple[int, Any]:
    status, _, answer = call(request("POST", f"/v1/queues/{queue}/tasks", body, headers=headers), lambda_context)
    return status, answer


def run_worker(lambda_context) -> dict[str, Any]:
    return worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 10))


def test_api_traceparent_reaches_the_handler_under_a_fresh_span_of_the_same_trace(runs, spans, lambda_context):
    status, task = enqueue(lambda_context, {"handler": "trace-probe", "id": "p1"},
                           {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"})
    assert status == 201
    assert task["headers"] == {TRACEPARENT_HEADER: TRACEPARENT, TRACESTATE_HEADER: "congo=t61rcWkgMzE"}

    assert run_worker(lambda_context)["outcomes"] == {"SUCCESS": 1}

    ((task_id, attempt, seen, current),) = runs
    assert (task_id, attempt) == ("p1", 1)
    assert seen == current, "ctx.traceparent is the span the handler runs in"
    version, trace_id, parent_id, flags = seen.split("-")
    assert trace_id == TRACE_ID and parent_id != ENQUEUER_SPAN and flags == "01"
    (span,) = [s for s in spans.get_finished_spans() if s.name == "run trace-probe"]
    assert f"{span.context.span_id:016x}" == parent_id
    assert span.parent is not None and f"{span.parent.span_id:016x}" == ENQUEUER_SPAN and span.parent.is_remote
    assert span.kind is trace.SpanKind.CONSUMER and span.links == ()
    assert span.context.trace_state.get("congo") == "t61rcWkgMzE", "the tracestate travels to the span"
    assert span.attributes["messaging.message.id"] == "p1" and span.attributes["rdq.attempt"] == 1
    assert span.attributes["messaging.destination.name"] == "traced"


def test_retries_keep_the_trace_id_and_link_each_attempt_to_the_one_before(runs, spans, lambda_context):
    status, _ = enqueue(lambda_context, {"handler": "trace-flaky", "id": "f1", "payload": {"succeed_on": 3},
                                         "backoff": {"initial_seconds": 0, "jitter": 0}}, {"traceparent": TRACEPARENT})
    assert status == 201
    store = Client(connection.shared_storage())
    deadline = time.monotonic() + 20
    while store.get("f1").status.value != "SUCCEEDED":
        assert time.monotonic() < deadline, "the task did not succeed on its third attempt in time"
        run_worker(lambda_context)

    assert [(r[0], r[1]) for r in runs] == [("f1", 1), ("f1", 2), ("f1", 3)]
    assert {r[2].split("-")[1] for r in runs} == {TRACE_ID}, "every attempt is in the enqueuer's trace"
    attempt_spans = sorted((s for s in spans.get_finished_spans() if s.name == "run trace-flaky"),
                           key=lambda s: s.attributes["rdq.attempt"])
    assert [s.attributes["rdq.attempt"] for s in attempt_spans] == [1, 2, 3]
    assert len({s.context.span_id for s in attempt_spans}) == 3
    for span in attempt_spans:
        assert span.context.trace_id == int(TRACE_ID, 16)
        assert f"{span.parent.span_id:016x}" == ENQUEUER_SPAN, "each attempt is a child of the enqueue"
    assert attempt_spans[0].links == ()
    for previous, span in zip(attempt_spans, attempt_spans[1:], strict=False):
        (link,) = span.links
        assert link.context.trace_id == previous.context.trace_id
        assert link.context.span_id == previous.context.span_id, "the link names the previous attempt's real span"
        assert link.attributes["rdq.link"] == "previous_attempt"
    assert attempt_spans[0].status.status_code is trace.StatusCode.ERROR, "a failed attempt's span records its error"
    assert attempt_spans[0].events and attempt_spans[0].events[0].name == "exception"


def test_without_opentelemetry_the_handler_gets_the_stored_context_and_its_child_tasks_carry_it(
        runs, lambda_context, monkeypatch):
    monkeypatch.delitem(sys.modules, "opentelemetry.trace")
    trace_handlers.CHILD_CLIENT.append(Client(connection.shared_storage()))
    status, _ = enqueue(lambda_context, {"handler": "trace-probe", "id": "plain", "payload": {"child": True}},
                        {"traceparent": TRACEPARENT})
    assert status == 201
    run_worker(lambda_context)
    run_worker(lambda_context)
    assert sorted((r[0], r[2], r[3]) for r in runs) == [("plain", TRACEPARENT, None), ("plain-child", TRACEPARENT, None)]
    child = Client(connection.shared_storage()).get("plain-child")
    assert child.headers == {TRACEPARENT_HEADER: TRACEPARENT}, "a task enqueued by the handler continues the trace"


def test_x_ray_trace_header_is_converted_when_there_is_no_traceparent(runs, lambda_context):
    status, task = enqueue(lambda_context, {"handler": "trace-probe", "id": "xr"},
                           {"X-Amzn-Trace-Id": "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"})
    assert status == 201
    assert task["headers"] == {TRACEPARENT_HEADER: "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01"}


def test_api_gateway_root_only_header_takes_its_parent_from_the_functions_own_trace_header(runs, lambda_context, monkeypatch):
    root = "Root=1-5759e988-bd862e3fe1be46a994272793"
    monkeypatch.setenv("_X_AMZN_TRACE_ID", f"{root};Parent=1111222233334444;Sampled=0;Lineage=a:1")
    status, task = enqueue(lambda_context, {"handler": "trace-probe"}, {"X-Amzn-Trace-Id": root})
    assert status == 201
    assert task["headers"] == {TRACEPARENT_HEADER: "00-5759e988bd862e3fe1be46a994272793-1111222233334444-00"}
    # The function's own header belongs to another trace: the request's root alone is no parent.
    monkeypatch.setenv("_X_AMZN_TRACE_ID", "Root=1-00000001-000000000000000000000001;Parent=1111222233334444;Sampled=1")
    status, task = enqueue(lambda_context, {"handler": "trace-probe"}, {"X-Amzn-Trace-Id": root})
    assert status == 201 and task["headers"] == {}


@pytest.mark.parametrize("headers", [
    {"traceparent": TRACEPARENT.upper()},
    {"traceparent": f"00-{'0' * 32}-{ENQUEUER_SPAN}-01"},
    {"traceparent": "x" * 5000},
    {"traceparent": TRACEPARENT + "-extra", "tracestate": "a=1"},
    {"tracestate": "a=1"},
    {"X-Amzn-Trace-Id": "Root=1-5759e988-bd862e3fe1be46a994272793"},
])
def test_invalid_trace_headers_are_dropped_and_the_enqueue_succeeds(runs, lambda_context, headers):
    status, task = enqueue(lambda_context, {"handler": "trace-probe", "headers": {"user": "kept"}}, headers)
    assert status == 201
    assert task["headers"] == {"user": "kept"}
    status, _, batch = call(request("POST", "/v1/queues/traced/tasks:batch", {"tasks": [{"handler": "trace-probe"}]},
                                    headers=headers), lambda_context)
    assert status == 200 and batch["created"] == 1
    stored = Client(connection.shared_storage()).get(batch["results"][0]["id"])
    assert stored.headers == {}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(traceparent=st.one_of(st.none(), st.text(max_size=80), st.from_regex(r"[0-9a-f-]{50,60}", fullmatch=True)),
       tracestate=st.one_of(st.none(), st.text(max_size=80)),
       xray=st.one_of(st.none(), st.text(max_size=80)))
def test_any_trace_header_values_never_fail_an_enqueue_and_only_valid_ones_are_stored(
        store_url, lambda_context, traceparent, tracestate, xray):
    headers = {name: value for name, value in
               (("traceparent", traceparent), ("tracestate", tracestate), ("X-Amzn-Trace-Id", xray)) if value is not None}
    status, task = enqueue(lambda_context, {"handler": "trace-probe"}, headers)
    assert status == 201
    stored = {k: v for k, v in task["headers"].items() if k.startswith("rdq.")}
    assert set(stored) <= {TRACEPARENT_HEADER, TRACESTATE_HEADER}
    if stored:
        assert tracecontext.parse_traceparent(stored[TRACEPARENT_HEADER]).header == stored[TRACEPARENT_HEADER]
        if TRACESTATE_HEADER in stored:
            assert tracecontext.clean_tracestate(stored[TRACESTATE_HEADER]) == stored[TRACESTATE_HEADER]


def test_batch_enqueue_stamps_every_task_and_body_headers_cannot_forge_the_reserved_name(runs, lambda_context):
    status, _, batch = call(request("POST", "/v1/queues/traced/tasks:batch",
                                    {"tasks": [{"handler": "trace-probe", "id": "b1"}, {"handler": "trace-probe", "id": "b2"}]},
                                    headers={"traceparent": TRACEPARENT}), lambda_context)
    assert status == 200
    store = Client(connection.shared_storage())
    assert [store.get(i).headers for i in ("b1", "b2")] == [{TRACEPARENT_HEADER: TRACEPARENT}] * 2
    status, problem = enqueue(lambda_context, {"handler": "trace-probe", "headers": {TRACEPARENT_HEADER: TRACEPARENT}}, {})
    assert status == 422 and problem["field"] == "headers"


class FakeSubsegment:
    def __init__(self) -> None:
        self.annotations: dict[str, Any] = {}
        self.metadata: dict[tuple[str, str], Any] = {}

    def put_annotation(self, key: str, value: Any) -> None:
        self.annotations[key] = value

    def put_metadata(self, key: str, value: Any, namespace: str = "default") -> None:
        self.metadata[(namespace, key)] = value


class FakeXRay:
    """Stands in for the Powertools Tracer's provider: records the subsegments opened."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, FakeSubsegment]] = []

    @property
    def provider(self) -> "FakeXRay":
        return self

    def in_subsegment(self, name: str) -> Any:
        import contextlib

        subsegment = FakeSubsegment()
        self.opened.append((name, subsegment))
        return contextlib.nullcontext(subsegment)


def test_with_x_ray_on_each_run_is_a_subsegment_annotated_with_the_tasks_trace_id(runs, lambda_context, monkeypatch):
    xray = FakeXRay()
    monkeypatch.setattr(observability, "tracer", xray)
    monkeypatch.delitem(sys.modules, "opentelemetry.trace")
    enqueue(lambda_context, {"handler": "trace-probe", "id": "xray-1"}, {"traceparent": TRACEPARENT})
    enqueue(lambda_context, {"handler": "trace-probe", "id": "xray-2"}, {})
    assert run_worker(lambda_context)["outcomes"] == {"SUCCESS": 2}
    by_task = {sub.annotations["rdq_task_id"]: (name, sub) for name, sub in xray.opened}
    name, traced = by_task["xray-1"]
    assert name == "## rdq trace-probe"
    assert traced.annotations == {"rdq_task_id": "xray-1", "rdq_queue": "traced", "rdq_attempt": 1,
                                  "rdq_trace_id": f"1-{TRACE_ID[:8]}-{TRACE_ID[8:]}"}
    assert traced.metadata == {("rdq", "traceparent"): TRACEPARENT}
    _, untraced = by_task["xray-2"]
    assert "rdq_trace_id" not in untraced.annotations


def test_an_x_ray_failure_does_not_fail_the_task(runs, lambda_context, monkeypatch):
    class Refusing(FakeXRay):
        def in_subsegment(self, name: str) -> Any:
            raise RuntimeError("no segment in context")

    monkeypatch.setattr(observability, "tracer", Refusing())
    enqueue(lambda_context, {"handler": "trace-probe", "id": "xray-broken"}, {"traceparent": TRACEPARENT})
    assert run_worker(lambda_context)["outcomes"] == {"SUCCESS": 1}


def test_annotate_xray_skips_an_invalid_stored_value():
    ctx = TaskContext(task_id="t", queue="q", attempt=2, redrive_count=0, deadline=0.0, extend=lambda s: None,
                      headers={TRACEPARENT_HEADER: "not-a-traceparent"})
    subsegment = FakeSubsegment()
    observability.annotate_xray(subsegment, ctx)
    assert subsegment.annotations == {"rdq_task_id": "t", "rdq_queue": "q", "rdq_attempt": 2}
