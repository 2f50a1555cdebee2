"""``HttpClient`` carries the trace context as the ``traceparent`` request header to ``rdq dev``
(a subprocess on a loopback port), whose worker hands it to the handler."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from rdq_core.client import build_new_task
from rdq_core.compliance.support import wait_until
from rdq_core.http_client import BearerToken, HttpClient
from rdq_core.model import TaskStatus
from rdq_core.engine.tracecontext import stamped
from rdq_core.validation import TRACEPARENT_HEADER, TRACESTATE_HEADER
from tests.rdq_servers import DevServer, dev_server

TOKEN = "trace-token-3"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
HANDLERS = '''
from rdq_core import handler

@handler("echo-trace", timeout_seconds=2)
def echo_trace(payload, ctx):
    return {"traceparent": ctx.traceparent, "tracestate": ctx.tracestate}
'''


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    modules = tmp_path_factory.mktemp("trace-handlers")
    (modules / "trace_echo.py").write_text(HANDLERS)
    with dev_server(tmp_path_factory.mktemp("rdq-dev"), token=TOKEN, handlers="trace_echo", pythonpath=modules) as server:
        yield server


@pytest.fixture
def rdq(dev: DevServer) -> HttpClient:
    return HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)


def result_of(rdq: HttpClient, task_id: str) -> dict[str, str | None]:
    task = wait_until(lambda: (t := rdq.get(task_id)).status is TaskStatus.SUCCEEDED and t, 30, what=f"{task_id} succeeded")
    return task.result


def test_explicit_traceparent_reaches_the_handler_through_the_api(rdq):
    queue = f"trace{os.getpid()}a"
    task = rdq.enqueue(queue, "echo-trace", id=f"{queue}-1", traceparent=TRACEPARENT, tracestate="rojo=1",
                       headers={"user": "x"})
    assert task.headers == {"user": "x", TRACEPARENT_HEADER: TRACEPARENT, TRACESTATE_HEADER: "rojo=1"}
    assert result_of(rdq, task.id) == {"traceparent": TRACEPARENT, "tracestate": "rojo=1"}


def test_enqueue_inside_an_opentelemetry_span_sends_that_span(rdq, monkeypatch):
    provider = TracerProvider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    queue = f"trace{os.getpid()}b"
    with provider.get_tracer("test").start_as_current_span("producer") as span:
        rdq.enqueue_many(queue, [{"handler": "echo-trace", "id": f"{queue}-1"}, {"handler": "echo-trace", "id": f"{queue}-2"}])
        context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    assert [result_of(rdq, f"{queue}-{n}")["traceparent"] for n in (1, 2)] == [expected, expected]


def test_a_new_task_with_a_stored_context_is_sent_with_the_header_not_refused(rdq):
    queue = f"trace{os.getpid()}c"
    (new_task,) = stamped([build_new_task(queue, {"handler": "echo-trace", "id": f"{queue}-1", "headers": {"k": "v"}})],
                          {TRACEPARENT_HEADER: TRACEPARENT})
    result = rdq.enqueue_new(new_task)
    assert result.created and result.task.headers == {"k": "v", TRACEPARENT_HEADER: TRACEPARENT}


def test_an_invalid_explicit_traceparent_is_dropped_and_the_enqueue_succeeds(rdq):
    queue = f"trace{os.getpid()}d"
    task = rdq.enqueue(queue, "echo-trace", id=f"{queue}-1", traceparent="00-not-valid-01")
    assert task.headers == {}
    assert result_of(rdq, task.id) == {"traceparent": None, "tracestate": None}



def test_enqueue_item_carries_the_context_of_a_use_block(rdq):
    from rdq_core.engine import tracecontext

    queue = f"trace{os.getpid()}e"
    with tracecontext.use(TRACEPARENT, "a=1"):
        result = rdq.enqueue_item(queue, {"handler": "echo-trace", "id": f"{queue}-1"})
    assert result.task.headers == {TRACEPARENT_HEADER: TRACEPARENT, TRACESTATE_HEADER: "a=1"}
