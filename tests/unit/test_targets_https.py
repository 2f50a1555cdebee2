"""HTTPS targets end to end: a real store, the real ``Client`` and ``Worker``, a TLS receiver with
a certificate authority of its own. Each test asserts what the receiver got and the task's final
state and attempt history."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rdq_core import verify_signature
from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import Outcome, Task, TaskStatus
from rdq_core.engine.retry import policy_book_from_config
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage
from rdq_core.targets import InvalidSignature, bind_targets, parse_targets
from rdq_core.hosts.process.worker import Worker, WorkerConfig

from .target_receivers import TRICKLE, Answer, Authority, Receiver, make_authority

SECRET = "whsec_current"
QUEUE = "hooks"


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def receiver(authority: Authority):
    server = Receiver(authority)
    yield server
    server.close()


@pytest.fixture
def other_receiver(authority: Authority):
    """A second origin: nothing a task carries may ever make the worker call it."""
    server = Receiver(authority)
    yield server
    server.close()


def binding(url: str, authority: Authority, **extra: Any) -> dict[str, Any]:
    return {"https": url, "secret": SECRET, "ca_file": str(authority.ca_file), "timeout_seconds": 5, **extra}


def run(storage: Storage, bindings: dict[str, Any], *tasks: dict[str, Any], max_attempts: int = 3) -> list[Task]:
    """Bind, enqueue ``tasks`` (each: handler, payload, options), run a real Worker (no backoff)
    until every task is SUCCEEDED or DEAD, and return the tasks as stored."""
    registry = HandlerRegistry()
    bind_targets(parse_targets(bindings), into=registry)
    client = Client(storage)
    ids = [client.enqueue(QUEUE, t["handler"], t.get("payload"), **t.get("options", {})).id for t in tasks]
    return run_until_settled(storage, registry, ids, max_attempts)


def run_until_settled(storage: Storage, registry: HandlerRegistry, ids: list[str], max_attempts: int = 3,
                      within: float = 30.0) -> list[Task]:
    policies = policy_book_from_config({QUEUE: {"max_attempts": max_attempts,
                                                "backoff": {"initial_seconds": 0, "jitter": 0}}})
    worker = Worker(storage, WorkerConfig(queues=[QUEUE], idle_poll_seconds=0.05), policies=policies,
                    registry=registry)
    client = Client(storage)
    deadline = time.monotonic() + within
    while True:
        worker.run_once()  # one batch, settled before it returns
        tasks = [client.get(task_id) for task_id in ids]
        if all(t.status in (TaskStatus.SUCCEEDED, TaskStatus.DEAD) for t in tasks):
            return tasks
        assert time.monotonic() < deadline, [(t.id, t.status, outcomes(t)) for t in tasks]


def outcomes(task: Task) -> list[Outcome]:
    return [attempt.outcome for attempt in task.attempts]


# -- success, and what arrives -------------------------------------------------------------------
def test_a_2xx_succeeds_with_the_body_as_result_and_the_request_is_signed_and_carries_the_envelope(
        storage, receiver, authority):
    receiver.route("/hook", Answer(200, {"sent": True}))
    (task,) = run(storage, {"notify": binding(receiver.url("/hook"), authority)},
                  {"handler": "notify", "payload": {"to": "ada@example.com"},
                   "options": {"headers": {"tenant": "acme"}, "id": "task-1"}})
    assert task.status is TaskStatus.SUCCEEDED and task.result == {"sent": True}
    assert outcomes(task) == [Outcome.SUCCESS]

    (request,) = receiver.received("/hook")
    verify_signature(request.headers, request.body, SECRET)  # raises if it does not verify
    sent = request.envelope()
    assert {k: sent[k] for k in ("version", "task_id", "queue", "handler", "attempt", "redrive_count", "payload",
                                 "headers")} == {
        "version": 1, "task_id": "task-1", "queue": QUEUE, "handler": "notify", "attempt": 1, "redrive_count": 0,
        "payload": {"to": "ada@example.com"}, "headers": {"tenant": "acme"}}
    assert 0 < sent["timeout_seconds"] <= 5
    assert request.headers["Idempotency-Key"] == "task-1:0:1"
    assert request.headers["Rdq-Task-Id"] == "task-1" and request.headers["Content-Type"] == "application/json"


def test_the_trace_context_travels_in_the_envelope_and_as_w3c_headers(storage, receiver, authority):
    receiver.route("/hook", Answer(204))
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    registry = HandlerRegistry()
    bind_targets(parse_targets({"notify": binding(receiver.url("/hook"), authority)}), into=registry)
    task = Client(storage).enqueue(QUEUE, "notify", {}, traceparent=traceparent, tracestate="vendor=1")
    (done,) = run_until_settled(storage, registry, [task.id])
    assert done.status is TaskStatus.SUCCEEDED
    (request,) = receiver.received("/hook")
    sent = request.envelope()["trace"]["traceparent"]
    # Without OpenTelemetry the stored context itself; with it, a child span of the same trace.
    assert sent.split("-")[1] == traceparent.split("-")[1]
    assert request.headers["traceparent"] == sent


def test_a_text_body_is_kept_as_text_and_bounded(storage, receiver, authority):
    receiver.route("/text", Answer(200, b"ok " * 100, {"Content-Type": "text/plain"}))
    receiver.route("/big-json", Answer(200, {"blob": "x" * 5000}))
    text, big = run(storage, {
        "text": binding(receiver.url("/text"), authority, max_result_bytes=10),
        "big": binding(receiver.url("/big-json"), authority, max_result_bytes=100)},
        {"handler": "text"}, {"handler": "big"})
    assert text.status is TaskStatus.SUCCEEDED and text.result == "ok ok ok o"
    # Cut short, the JSON would not parse: its first bytes are kept as text.
    assert big.status is TaskStatus.SUCCEEDED and big.result == '{"blob": "' + "x" * 90


# -- every status class ---------------------------------------------------------------------------
@pytest.mark.parametrize(("answers", "extra", "status", "history", "error_type"), [
    # 5xx and 408: retried with the queue's policy, then dead.
    ([Answer(500, {"e": 1})], {}, TaskStatus.DEAD, [Outcome.RETRYABLE_FAILURE] * 3, "TargetHttpError"),
    ([Answer(502), Answer(200, {"ok": 1})], {}, TaskStatus.SUCCEEDED,
     [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS], None),
    ([Answer(408), Answer(200)], {}, TaskStatus.SUCCEEDED, [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS], None),
    # 429 and 503 with Retry-After: snoozed, no retry spent; without it: an ordinary retry.
    ([Answer(429, headers={"Retry-After": "0"}), Answer(200)], {}, TaskStatus.SUCCEEDED,
     [Outcome.SNOOZED, Outcome.SUCCESS], None),
    ([Answer(503, headers={"Retry-After": "Thu, 01 Jan 1970 00:00:00 GMT"}), Answer(200)], {}, TaskStatus.SUCCEEDED,
     [Outcome.SNOOZED, Outcome.SUCCESS], None),
    ([Answer(429), Answer(200)], {}, TaskStatus.SUCCEEDED, [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS], None),
    # Other 4xx: dead at once, unless the binding retries them.
    ([Answer(404, {"error": "no such user"})], {}, TaskStatus.DEAD, [Outcome.PERMANENT_FAILURE], "TargetRejected"),
    ([Answer(409), Answer(201)], {"retry_statuses": [409]}, TaskStatus.SUCCEEDED,
     [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS], None),
    ([Answer(400)], {"on_4xx": "retry"}, TaskStatus.DEAD, [Outcome.RETRYABLE_FAILURE] * 3, "TargetHttpError"),
    # A redirect that is not a same-origin 307/308 is never followed.
    ([Answer(302, headers={"Location": "/elsewhere"})], {}, TaskStatus.DEAD, [Outcome.PERMANENT_FAILURE],
     "TargetRedirectRefused"),
], ids=["500-dead", "502-then-ok", "408-then-ok", "429-retry-after", "503-retry-after-date", "429-bare",
        "404-dead", "409-retried", "400-on_4xx-retry", "302-refused"])
def test_each_status_class_maps_to_its_outcome(storage, receiver, authority, answers, extra, status, history,
                                               error_type):
    receiver.route("/hook", *answers)
    (task,) = run(storage, {"notify": binding(receiver.url("/hook"), authority, **extra)}, {"handler": "notify"})
    assert task.status is status
    assert outcomes(task) == history
    assert task.attempt_count == sum(o is not Outcome.SNOOZED for o in history)
    assert len(receiver.received("/hook")) == len(history)
    if error_type is not None:
        assert task.last_error is not None and task.last_error.type.endswith(error_type)
        # The history names the target, the HTTP status and the latency.
        assert f"notify -> {receiver.url('/hook')}: HTTP {answers[-1].status} after " in task.last_error.message
        assert " ms" in task.last_error.message


# -- time ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [Answer(200, delay=30), TRICKLE], ids=["silent", "trickling"])
def test_a_receiver_slower_than_the_timeout_is_a_failed_attempt_ended_on_time(storage, receiver, authority, answer):
    receiver.route("/slow", answer)
    began = time.monotonic()
    (task,) = run(storage, {"slow": binding(receiver.url("/slow"), authority, timeout_seconds=0.8)},
                  {"handler": "slow"}, max_attempts=1)
    took = time.monotonic() - began
    assert task.status is TaskStatus.DEAD and outcomes(task) == [Outcome.RETRYABLE_FAILURE]
    assert task.last_error is not None and task.last_error.type.endswith("TargetTimeout")
    assert "no answer within the time budget" in task.last_error.message
    assert took < 3.0, took  # the call ended at its budget, not when the receiver finished


def test_an_untrusted_certificate_is_refused_and_retried(storage, receiver, authority):
    receiver.route("/hook", Answer(200))
    bindings = {"notify": {"https": receiver.url("/hook"), "secret": SECRET, "timeout_seconds": 5}}  # system CAs
    (task,) = run(storage, bindings, {"handler": "notify"}, max_attempts=2)
    assert task.status is TaskStatus.DEAD and outcomes(task) == [Outcome.RETRYABLE_FAILURE] * 2
    assert task.last_error is not None and task.last_error.type.endswith("TargetUnreachable")
    assert "TLS certificate not trusted" in task.last_error.message
    assert receiver.received("/hook") == []


# -- redirects -------------------------------------------------------------------------------------
def test_a_same_origin_307_is_followed_and_a_redirect_to_another_origin_is_not(
        storage, receiver, other_receiver, authority):
    receiver.route("/moved", Answer(308, headers={"Location": "/new"}))
    receiver.route("/new", Answer(200, {"at": "new"}))
    receiver.route("/away", Answer(307, headers={"Location": other_receiver.url("/catch")}))
    other_receiver.route("/catch", Answer(200))
    moved, away = run(storage, {"moved": binding(receiver.url("/moved"), authority),
                                "away": binding(receiver.url("/away"), authority)},
                      {"handler": "moved"}, {"handler": "away"})
    assert moved.status is TaskStatus.SUCCEEDED and moved.result == {"at": "new"}
    assert away.status is TaskStatus.DEAD and outcomes(away) == [Outcome.PERMANENT_FAILURE]
    assert away.last_error is not None and away.last_error.type.endswith("TargetRedirectRefused")
    assert other_receiver.requests == []


# -- the SSRF rule -----------------------------------------------------------------------------------
def test_nothing_a_producer_writes_makes_the_worker_call_an_address_the_operator_did_not_bind(
        storage, receiver, other_receiver, authority):
    """Payload, headers and handler name are data: the only address called is the bound one."""
    receiver.route("/hook", Answer(200))
    other_receiver.route("/steal", Answer(200))
    elsewhere = other_receiver.url("/steal")
    hostile = {"url": elsewhere, "https": elsewhere, "lambda": "arn:aws:lambda:us-east-1:123456789012:function:x",
               "target": {"https": elsewhere}}
    bound, unbound = run(storage, {"notify": binding(receiver.url("/hook"), authority)},
                         {"handler": "notify", "payload": hostile,
                          "options": {"headers": {"url": elsewhere, "host": f"127.0.0.1:{other_receiver.port}",
                                                  "location": elsewhere}}},
                         {"handler": "other", "payload": hostile})
    assert bound.status is TaskStatus.SUCCEEDED
    (request,) = receiver.received("/hook")
    assert request.envelope()["payload"] == hostile  # delivered as data, to the bound address only
    assert request.headers["Host"] == f"127.0.0.1:{receiver.port}"
    # A name nobody bound is an unknown handler, dead at once; it reaches nothing.
    assert unbound.status is TaskStatus.DEAD and unbound.last_error is not None
    assert unbound.last_error.type == "rdq.UnknownHandler"
    assert other_receiver.requests == []
    # A URL is not even a handler name a producer could enqueue.
    with pytest.raises(ValueError):
        Client(storage).enqueue(QUEUE, elsewhere, {})


# -- signatures -------------------------------------------------------------------------------------
def test_verify_signature_rejects_a_changed_body_a_wrong_secret_a_stale_or_missing_signature(
        storage, receiver, authority):
    receiver.route("/hook", Answer(200))
    run(storage, {"notify": binding(receiver.url("/hook"), authority)}, {"handler": "notify", "payload": {"n": 1}})
    (request,) = receiver.received("/hook")
    verify_signature(request.headers, request.body, [SECRET])
    with pytest.raises(InvalidSignature, match="no signature matches"):
        verify_signature(request.headers, request.body.replace(b'"n":1', b'"n":2'), SECRET)
    with pytest.raises(InvalidSignature, match="no signature matches"):
        verify_signature(request.headers, request.body, "whsec_wrong")
    with pytest.raises(InvalidSignature, match="away from now"):
        verify_signature(request.headers, request.body, SECRET, now=time.time() + 600)
    with pytest.raises(InvalidSignature, match="no Rdq-Signature header"):
        verify_signature({"Content-Type": "application/json"}, request.body, SECRET)
    lowered = {key.lower(): value for key, value in request.headers.items()}
    verify_signature(lowered, request.body, SECRET)  # header names in any case


def test_two_secrets_while_rotating_each_receiver_verifies_with_either(storage, receiver, authority):
    receiver.route("/hook", Answer(200))
    old, new = "whsec_old", "whsec_new"
    run(storage, {"notify": binding(receiver.url("/hook"), authority, secret=[old, new])}, {"handler": "notify"})
    (request,) = receiver.received("/hook")
    assert request.headers["Rdq-Signature"].count("v1=") == 2
    verify_signature(request.headers, request.body, old)  # a receiver not yet moved
    verify_signature(request.headers, request.body, new)  # a receiver already moved
    verify_signature(request.headers, request.body, [new, "whsec_next"])
    with pytest.raises(InvalidSignature):
        verify_signature(request.headers, request.body, ["whsec_next"])


def test_a_secret_from_the_environment_is_read_when_the_request_is_signed(storage, receiver, authority, monkeypatch):
    receiver.route("/hook", Answer(200))
    monkeypatch.setenv("NOTIFY_SIGNING_SECRET", "whsec_from_env")
    (task,) = run(storage, {"notify": binding(receiver.url("/hook"), authority, secret="env:NOTIFY_SIGNING_SECRET")},
                  {"handler": "notify"})
    assert task.status is TaskStatus.SUCCEEDED
    (request,) = receiver.received("/hook")
    verify_signature(request.headers, request.body, "whsec_from_env")


# -- PostgreSQL ------------------------------------------------------------------------------------
def test_a_target_on_postgres_retries_then_succeeds_with_its_history(fresh_pg_url, receiver, authority):
    storage = open_storage(fresh_pg_url)
    storage.migrate()
    try:
        receiver.route("/hook", Answer(503), Answer(429, headers={"Retry-After": "0"}), Answer(200, {"done": 1}))
        (task,) = run(storage, {"notify": binding(receiver.url("/hook"), authority)}, {"handler": "notify"})
        assert task.status is TaskStatus.SUCCEEDED and task.result == {"done": 1}
        assert outcomes(task) == [Outcome.RETRYABLE_FAILURE, Outcome.SNOOZED, Outcome.SUCCESS]
        assert task.attempt_count == 2
        keys = [r.headers["Idempotency-Key"] for r in receiver.received("/hook")]
        # One key per delivery: the snoozed run was attempt 2, and so is the run after it.
        assert keys == [f"{task.id}:0:1", f"{task.id}:0:2", f"{task.id}:0:2"]
    finally:
        storage.close()


# -- flow control ----------------------------------------------------------------------------------
@pytest.mark.parametrize("max_in_flight", [1, None], ids=["limited", "unlimited"])
def test_the_queues_flow_control_bounds_calls_to_a_target_like_any_handler(storage, receiver, authority,
                                                                           max_in_flight):
    """``max_in_flight`` (Cloud Tasks' maxConcurrentDispatches) holds across a worker's three claim
    loops: the receiver never sees more calls at once; without it, it does."""
    receiver.route("/hook", Answer(200, delay=0.3))
    registry = HandlerRegistry()
    bind_targets(parse_targets({"notify": binding(receiver.url("/hook"), authority)}), into=registry)
    client = Client(storage)
    ids = [client.enqueue(QUEUE, "notify", {"n": n}).id for n in range(6)]
    policy: dict[str, Any] = {} if max_in_flight is None else {"max_in_flight": max_in_flight}
    worker = Worker(storage, WorkerConfig(queues=[QUEUE], batch_size=1, concurrency=3, idle_poll_seconds=0.05),
                    policies=policy_book_from_config({QUEUE: policy} if policy else None), registry=registry)
    running = threading.Thread(target=worker.run_forever, daemon=True)
    running.start()
    try:
        wait_until(lambda: all(client.get(i).status is TaskStatus.SUCCEEDED for i in ids), timeout=30,
                   what="every task to succeed")
    finally:
        worker.stop()
        running.join(15)
    assert receiver.peak == 1 if max_in_flight == 1 else receiver.peak > 1


@pytest.mark.parametrize("rate_limit", ["4/s", None], ids=["limited", "unlimited"])
def test_the_queues_rate_limit_spaces_calls_to_a_target_like_any_handler(storage, receiver, authority, rate_limit):
    """``rate_limit`` (Cloud Tasks' maxDispatchesPerSecond) on the tasks' ``rate_key``: no second
    sees more than 4 calls at the receiver; without it, all 8 arrive within one."""
    receiver.route("/hook", Answer(200))
    registry = HandlerRegistry()
    bind_targets(parse_targets({"notify": binding(receiver.url("/hook"), authority)}), into=registry)
    client = Client(storage)
    ids = [client.enqueue(QUEUE, "notify", {"n": n}, rate_key="hooks.example.com").id for n in range(8)]
    policy = {QUEUE: {"rate_limit": rate_limit}} if rate_limit else None
    worker = Worker(storage, WorkerConfig(queues=[QUEUE], batch_size=5, idle_poll_seconds=0.05),
                    policies=policy_book_from_config(policy), registry=registry)
    running = threading.Thread(target=worker.run_forever, daemon=True)
    running.start()
    try:
        wait_until(lambda: all(client.get(i).status is TaskStatus.SUCCEEDED for i in ids), timeout=30,
                   what="every task to succeed")
    finally:
        worker.stop()
        running.join(15)
    arrivals = sorted(r.at for r in receiver.received("/hook"))
    assert len(arrivals) == 8
    # Any 5 consecutive arrivals span at least a second (a little less: the TLS handshake before
    # each request varies); unlimited, they all fit in one.
    spans = [arrivals[i + 4] - arrivals[i] for i in range(len(arrivals) - 4)]
    if rate_limit:
        assert min(spans) >= 0.85, spans
    else:
        assert arrivals[-1] - arrivals[0] < 1.0, arrivals
