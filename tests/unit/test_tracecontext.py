"""Trace context at enqueue: the W3C parsing, the X-Ray conversion, and what a Python enqueue
stores (an explicit argument, a ``use`` block, the current OpenTelemetry span, or nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from rdq_core import Client
from rdq_core.engine import tracecontext
from rdq_core.errors import InvalidInput
from rdq_core.engine.handlers import TaskContext
from rdq_core.validation import TRACEPARENT_HEADER, TRACESTATE_HEADER

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize("value", [
    VALID,
    f"00-{TRACE_ID}-{PARENT_ID}-00",
    f" \t{VALID} ",  # an HTTP header's optional whitespace
    f"01-{TRACE_ID}-{PARENT_ID}-01",  # a later version: its first four fields
    f"cc-{TRACE_ID}-{PARENT_ID}-01-what-comes-later",
])
def test_valid_traceparents_are_read_and_stored_as_version_00(value):
    parsed = tracecontext.parse_traceparent(value)
    assert parsed is not None
    assert (parsed.trace_id, parsed.parent_id) == (TRACE_ID, PARENT_ID)
    assert parsed.header.startswith(f"00-{TRACE_ID}-{PARENT_ID}-")


@pytest.mark.parametrize("value", [
    None, 42, "", "garbage",
    VALID.upper(),  # uppercase hex is not the format
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 is exactly 55 characters
    f"00-{TRACE_ID}-{PARENT_ID}-1",
    f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01",
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is forbidden
    f"01-{TRACE_ID}-{PARENT_ID}-01x",  # a later version must continue with "-"
    f"00_{TRACE_ID}_{PARENT_ID}_01",
    f"00-{TRACE_ID}-{PARENT_ID}-0g",
    f"00-{TRACE_ID}-{PARENT_ID}-01\x00",
])
def test_invalid_traceparents_are_refused(value):
    assert tracecontext.parse_traceparent(value) is None


def test_tracestate_is_checked_member_by_member():
    assert tracecontext.clean_tracestate("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE") == "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    assert tracecontext.clean_tracestate("tenant@vendor=x,,a=1") == "tenant@vendor=x,a=1"
    for bad in ("", "novalue", "Upper=1", "a=1,a=2", "a=has,comma", "a= ", "a=x=y", "1abc=x", "a=\x7f",
                ",".join(f"k{n}=v" for n in range(33))):
        assert tracecontext.clean_tracestate(bad) is None, bad
    # Over 512 characters: members over 128 characters go first, then members from the end.
    long = ",".join(["big=" + "x" * 200] + [f"k{n}=" + "v" * 40 for n in range(20)])
    trimmed = tracecontext.clean_tracestate(long)
    assert trimmed is not None and len(trimmed) <= 512 and "big=" not in trimmed and trimmed.startswith("k0=")


def test_x_ray_header_converts_to_a_traceparent_and_back():
    parent = tracecontext.from_xray_header("Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1")
    assert parent is not None and parent.header == "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01"
    assert parent.xray_trace_id == "1-5759e988-bd862e3fe1be46a994272793"
    unsampled = tracecontext.from_xray_header("Self=1-abc;Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8")
    assert unsampled is not None and not unsampled.sampled
    for bad in (None, "Root=1-5759e988-bd862e3fe1be46a994272793",
                "Root=2-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8",
                "Root=1-5759e988-bd862e3f;Parent=53995c3f42cd8ad8", "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=xyz"):
        assert tracecontext.from_xray_header(bad) is None, bad


def test_request_headers_prefer_traceparent_then_x_ray_and_never_raise():
    def getter(headers):
        return lambda name: {k.lower(): v for k, v in headers.items()}.get(name)

    xray = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
    assert tracecontext.request_headers(getter({"Traceparent": VALID, "X-Amzn-Trace-Id": xray})) == {TRACEPARENT_HEADER: VALID}
    assert tracecontext.request_headers(getter({"traceparent": VALID, "tracestate": "a=1"})) == {
        TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "a=1"}
    # An invalid traceparent falls back to the X-Ray header; an invalid tracestate alone is dropped.
    assert tracecontext.request_headers(getter({"traceparent": "junk", "X-Amzn-Trace-Id": xray})) == {
        TRACEPARENT_HEADER: "00-5759e988bd862e3fe1be46a994272793-53995c3f42cd8ad8-01"}
    assert tracecontext.request_headers(getter({"traceparent": VALID, "tracestate": "A=1"})) == {TRACEPARENT_HEADER: VALID}
    assert tracecontext.request_headers(getter({"tracestate": "a=1"})) == {}

    def broken(name):
        raise RuntimeError("a header source that fails")

    assert tracecontext.request_headers(broken) == {}


def test_callers_still_cannot_set_the_reserved_headers(tmp_path):
    with Client(f"sqlite:///{tmp_path}/rdq.db") as client:
        with pytest.raises(InvalidInput):
            client.enqueue("q", "h", headers={TRACEPARENT_HEADER: VALID})


@pytest.fixture
def client(tmp_path):
    with Client(f"sqlite:///{tmp_path}/rdq.db") as c:
        yield c


def test_explicit_traceparent_is_stored_and_an_invalid_one_is_dropped_without_failing(client):
    task = client.enqueue("q", "h", id="t1", traceparent=VALID, tracestate="rojo=1", headers={"user": "x"})
    assert client.get(task.id).headers == {"user": "x", TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "rojo=1"}
    task = client.enqueue("q", "h", id="t2", traceparent="00-nope", tracestate="rojo=1")
    assert client.get(task.id).headers == {}, "an invalid traceparent is dropped with its tracestate; the enqueue succeeds"
    task = client.enqueue("q", "h", id="t3", traceparent=VALID, tracestate="no good")
    assert client.get(task.id).headers == {TRACEPARENT_HEADER: VALID}
    results = client.enqueue_many("q", [{"handler": "h", "id": "b1"}, {"handler": "h", "id": "b2"}], traceparent=VALID)
    assert [client.get(r.task.id).headers for r in results] == [{TRACEPARENT_HEADER: VALID}] * 2


def test_enqueue_inside_an_opentelemetry_span_carries_that_span(client, monkeypatch):
    provider = TracerProvider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    with provider.get_tracer("test").start_as_current_span("checkout") as span:
        task = client.enqueue("q", "h", id="in-span")
        inside = span.get_span_context()
    stored = client.get(task.id).headers[TRACEPARENT_HEADER]
    assert stored == f"00-{inside.trace_id:032x}-{inside.span_id:016x}-{int(inside.trace_flags):02x}"
    # An explicit argument wins over the current span; use(None) stores nothing even inside one.
    with provider.get_tracer("test").start_as_current_span("other"):
        assert client.get(client.enqueue("q", "h", id="explicit", traceparent=VALID).id).headers == {TRACEPARENT_HEADER: VALID}
        with tracecontext.use(None):
            assert client.get(client.enqueue("q", "h", id="none").id).headers == {}
    assert client.get(client.enqueue("q", "h", id="outside").id).headers == {}, "no span, no trace context"


def test_without_opentelemetry_a_use_block_is_the_explicit_context(client, monkeypatch):
    monkeypatch.delitem(sys.modules, "opentelemetry.trace")
    assert tracecontext.current_headers() == {}
    with tracecontext.use(VALID, "a=1"):
        task = client.enqueue("q", "h", id="in-use")
    assert client.get(task.id).headers == {TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "a=1"}
    assert client.get(client.enqueue("q", "h", id="after").id).headers == {}


def test_a_failing_tracing_library_never_fails_an_enqueue(client, monkeypatch):
    class Broken:
        def get_current_span(self):
            raise RuntimeError("tracer exploded")

    monkeypatch.setitem(sys.modules, "opentelemetry.trace", Broken())
    assert client.enqueue("q", "h", id="still-enqueued").id == "still-enqueued"
    assert client.get("still-enqueued").headers == {}


def test_task_context_exposes_the_stored_trace_context():
    ctx = TaskContext(task_id="t", queue="q", attempt=1, redrive_count=0, deadline=0.0, extend=lambda s: None,
                      headers={TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "a=1", "user": "x"})
    assert (ctx.traceparent, ctx.tracestate) == (VALID, "a=1")
    bare = TaskContext(task_id="t", queue="q", attempt=1, redrive_count=0, deadline=0.0, extend=lambda s: None, headers={})
    assert (bare.traceparent, bare.tracestate) == (None, None)


def test_attempt_span_ids_are_stable_distinct_and_never_zero():
    ids = {tracecontext.attempt_span_id(TRACE_ID, "t", r, a) for r in range(3) for a in range(1, 6)}
    assert len(ids) == 15 and 0 not in ids
    assert tracecontext.attempt_span_id(TRACE_ID, "t", 0, 2) == tracecontext.attempt_span_id(TRACE_ID, "t", 0, 2)


def test_enqueue_item_carries_the_trace_context_as_enqueue_does(client):
    with tracecontext.use(VALID):
        result = client.enqueue_item("q", {"handler": "h", "id": "item"})
    assert result.task.headers == {TRACEPARENT_HEADER: VALID}


def test_the_opentelemetry_api_without_a_tracer_provider_opens_no_span():
    """A library may import opentelemetry.trace on its own (redis-py does): with no tracer
    provider set, an attempt opens no span, and a traced task's handler still runs under the
    stored traceparent, which its own enqueues carry. (A fresh interpreter: a provider, once
    set, stays for the process.)"""
    code = textwrap.dedent('''
        import opentelemetry.trace
        from rdq_core.engine import tracecontext
        span = tracecontext.attempt_span
        assert span(task_id="t", queue="q", handler="h", attempt=1, redrive_count=0, headers={}) is tracecontext._UNTRACED
        tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        with span(task_id="t", queue="q", handler="h", attempt=2, redrive_count=0, headers={"rdq.traceparent": tp}) as got:
            assert got == tp, got
            assert tracecontext.enqueue_headers() == {"rdq.traceparent": tp}, tracecontext.enqueue_headers()
        print("ok")
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
