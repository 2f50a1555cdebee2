"""Large payloads with the local-directory store (what ``rdq dev`` uses): references, thresholds,
the long-running worker (``rdq worker``) resolving and hash-checking, results, and purge."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from rdq_core.engine import payload_uploads, payloads
from rdq_core.client import Client
from rdq_core.compliance.support import wait_until
from rdq_core.errors import InvalidInput, TaskConflict
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.model import TaskStatus
from rdq_core.engine.payloads import LocalPayloadStore, PayloadRef
from rdq_core.validation import headers as valid_headers
from rdq_core.hosts.process.worker import Worker, WorkerConfig

SHA = "a" * 64


@pytest.fixture
def store(tmp_path, monkeypatch):
    for name in ("RDQ_PAYLOAD_BUCKET", "RDQ_PAYLOAD_DIR", "RDQ_PAYLOAD_THRESHOLD_BYTES", "RDQ_PAYLOAD_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    local = LocalPayloadStore(tmp_path / "objects")
    payloads.configure(local)  # the worker's store (the process's, as RDQ_PAYLOAD_DIR would make it)
    yield local
    payloads.reset()


@pytest.fixture
def client(storage, store):
    return Client(storage, payload_store=store)


def _files(store: LocalPayloadStore) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())


def _run(storage, registry, until, queues=("q",)):
    worker = Worker(storage, WorkerConfig(queues=list(queues), lease_seconds=5, idle_poll_seconds=0.05), registry=registry)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        wait_until(until, timeout=20, what="the tasks to finish")
    finally:
        worker.stop()
        thread.join(10)


# -- references --------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    {"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": 1},  # a field missing
    {"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": 1, "sha256": SHA, "extra": 1},
    {"bucket": "b", "key": "payloads/q/../../etc/passwd", "size": 1, "sha256": SHA},
    {"bucket": "b", "key": "payloads/q/" + "0" * 31, "size": 1, "sha256": SHA},
    {"bucket": "b", "key": "other/q/" + "0" * 32, "size": 1, "sha256": SHA},
    {"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": True, "sha256": SHA},
    {"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": -1, "sha256": SHA},
    {"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": 1, "sha256": SHA.upper()},
    {"bucket": "", "key": "payloads/q/" + "0" * 32, "size": 1, "sha256": SHA},
    "not an object",
])
def test_a_malformed_reference_is_invalid_input(data):
    with pytest.raises(InvalidInput):
        PayloadRef.from_dict(data)


def test_a_reference_round_trips_through_its_header_and_sizes_may_be_whole_floats():
    ref = PayloadRef.from_dict({"bucket": "b", "key": "payloads/q/" + "0" * 32, "size": 3.0, "sha256": SHA})
    assert ref.size == 3 and type(ref.size) is int
    assert PayloadRef.from_header(ref.to_header()) == ref


def test_callers_cannot_set_the_reserved_header():
    with pytest.raises(InvalidInput) as refused:
        valid_headers({"rdq.payload_ref": "{}"})
    assert refused.value.field == "headers"


def test_the_local_store_refuses_keys_it_never_issues(store):
    with pytest.raises(InvalidInput):
        store.read("payloads/q/../../secret")
    assert store.read("payloads/q/" + "0" * 32) is None


# -- producing ---------------------------------------------------------------------------------
def test_only_payloads_over_the_threshold_are_offloaded(client, store, monkeypatch):
    inline = client.enqueue("q", "h", {"t": "x" * 1000})
    assert inline.payload == {"t": "x" * 1000} and _files(store) == []
    monkeypatch.setenv("RDQ_PAYLOAD_THRESHOLD_BYTES", "500")
    offloaded = client.enqueue("q", "h", {"t": "x" * 1000})
    assert offloaded.payload is None and len(_files(store)) == 1
    ref = payloads.payload_ref(offloaded)
    assert ref is not None and ref.bucket == "local" and ref.size == len('{"t":""}') + 1000
    # The threshold can only lower the inline limit, never raise it.
    monkeypatch.setenv("RDQ_PAYLOAD_THRESHOLD_BYTES", str(10**9))
    assert payloads.threshold_bytes() == 256 * 1024


def test_without_a_store_the_inline_limit_holds(storage, monkeypatch):
    for name in ("RDQ_PAYLOAD_BUCKET", "RDQ_PAYLOAD_DIR"):
        monkeypatch.delenv(name, raising=False)
    payloads.reset()
    try:
        with pytest.raises(InvalidInput) as refused:
            Client(storage).enqueue("q", "h", {"t": "x" * 300_000})
        assert refused.value.field == "payload"
    finally:
        payloads.reset()


def test_a_task_refused_by_validation_uploads_nothing(client, store):
    with pytest.raises(InvalidInput):
        client.enqueue("q", "h", {"t": "x" * 300_000}, max_attempts=0)
    with pytest.raises(InvalidInput):
        client.enqueue_many("q", [{"handler": "h", "payload": {"t": "x" * 300_000}}, {"handler": "BAD NAME"}])
    assert _files(store) == []


def test_a_conflict_on_another_queue_deletes_the_upload(client, store):
    client.enqueue("q", "h", {"t": "x" * 300_000}, id="taken")
    with pytest.raises(TaskConflict):
        client.enqueue("other", "h", {"t": "y" * 300_000}, id="taken")
    assert len(_files(store)) == 1


def test_an_http_reference_must_be_issued_for_the_queue_and_uploaded(store):
    offer = payload_uploads.upload_offer(store, "q", 10, SHA, "t1")
    ref = offer["payload_ref"]
    assert offer["upload"]["url"].startswith("file://") and ref["key"].startswith("payloads/q/t1/")
    with pytest.raises(TaskConflict, match="upload it first"):
        payload_uploads.checked_upload(store, "q", ref, "t1")
    store.write(ref["key"], b"0123456789")
    assert payload_uploads.checked_upload(store, "q", ref, "t1").size == 10
    with pytest.raises(TaskConflict, match="queue 'other'"):
        payload_uploads.checked_upload(store, "other", ref, "t1")
    with pytest.raises(TaskConflict, match="task 't2'"):
        payload_uploads.checked_upload(store, "q", ref, "t2")
    with pytest.raises(TaskConflict, match="not 11"):
        payload_uploads.checked_upload(store, "q", {**ref, "size": 11}, "t1")
    with pytest.raises(InvalidInput):
        payload_uploads.upload_offer(store, "q", 0, SHA, "t1")
    with pytest.raises(InvalidInput, match="task_id"):
        payload_uploads.upload_offer(store, "q", 10, SHA, None)


# -- the long-running worker ---------------------------------------------------------------------
def test_rdq_worker_hands_the_handler_the_payload_and_stores_a_large_result(storage, client, store):
    seen: list[int] = []
    registry = HandlerRegistry()
    registry.register("measure", lambda payload, ctx: seen.append(len(payload["t"])) or {"rows": ["r" * 100] * 800})
    big = client.enqueue("q", "measure", {"t": "x" * 300_000}, id="big")

    _run(storage, registry, lambda: storage.get("big").status is TaskStatus.SUCCEEDED)
    assert seen == [300_000]
    task = client.get("big")
    ref = payloads.result_ref(task.result)
    assert ref is not None and ref.key.startswith("results/q/big/")
    assert client.get("big", resolve=True).result == {"rows": ["r" * 100] * 800}
    assert client.get("big", resolve=True).payload == {"t": "x" * 300_000}
    assert payloads.payload_ref(big) is not None


def test_a_hash_mismatch_dead_letters_with_a_clear_error(storage, client, store):
    registry = HandlerRegistry()
    registry.register("never", lambda payload, ctx: pytest.fail("the handler must not run on a changed payload"))
    task = client.enqueue("q", "never", {"t": "x" * 300_000}, id="tampered", max_attempts=5)
    ref = payloads.payload_ref(task)
    assert ref is not None
    changed = json.dumps({"t": "y" * 300_000}, separators=(",", ":")).encode()
    assert len(changed) == ref.size and hashlib.sha256(changed).hexdigest() != ref.sha256
    (store.root / ref.key).write_bytes(changed)

    _run(storage, registry, lambda: storage.get("tampered").status is TaskStatus.DEAD)
    dead = storage.get("tampered")
    assert dead.attempt_count == 1 and dead.last_error.type == "rdq_core.engine.payloads.PayloadIntegrityError"
    assert ref.key in dead.last_error.message and ref.sha256 in dead.last_error.message
    with pytest.raises(payloads.PayloadIntegrityError):
        client.get("tampered", resolve=True)


# -- deleting ----------------------------------------------------------------------------------
def test_purge_by_filter_deletes_only_the_matching_dead_tasks_objects(storage, client, store):
    registry = HandlerRegistry()

    def fail(payload, ctx):
        raise (ValueError if payload["kind"] == "value" else KeyError)("no")

    registry.register("fail", fail)
    for n in range(3):
        client.enqueue("q", "fail", {"kind": "value", "t": "x" * 300_000}, id=f"v{n}", max_attempts=1)
    client.enqueue("q", "fail", {"kind": "key", "t": "x" * 300_000}, id="k0", max_attempts=1)
    _run(storage, registry, lambda: client.stats("q").dead == 4)
    assert len(_files(store)) == 4

    assert client.purge_dead("q", error_type="ValueError") == 3
    remaining = _files(store)
    assert len(remaining) == 1 and remaining[0] == payloads.payload_ref(client.get("k0")).key
    assert client.purge_dead("q", all=True) == 1 and _files(store) == []


def test_rdq_enqueue_sends_a_large_payload_file_through_the_store(tmp_path, store, capsys):
    from rdq_core.hosts import cli

    payload_file = tmp_path / "big.json"
    payload_file.write_text(json.dumps({"t": "x" * 300_000}))
    url = f"sqlite:///{tmp_path}/cli.db"
    assert cli.main(["--storage", url, "migrate"]) == 0
    capsys.readouterr()
    assert cli.main(["--storage", url, "enqueue", "q", "h", "--payload", f"@{payload_file}", "--id", "from-cli",
                     "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["created"] is True and shown["payload"] is None
    ref = PayloadRef.from_header(shown["headers"]["rdq.payload_ref"])
    assert _files(store) == [ref.key]
    # Repeating it enqueues nothing and leaves no second object behind.
    assert cli.main(["--storage", url, "enqueue", "q", "h", "--payload", f"@{payload_file}", "--id", "from-cli"]) == 0
    assert _files(store) == [ref.key]


def test_a_worker_without_the_store_fails_the_attempt_but_does_not_dead_letter(storage, client, store):
    client.enqueue("q", "h", {"t": "x" * 300_000}, id="needs-store", max_attempts=3)
    payloads.configure(None)  # this worker process was started without RDQ_PAYLOAD_BUCKET/DIR
    registry = HandlerRegistry()
    registry.register("h", lambda payload, ctx: pytest.fail("the handler must not run without its payload"))
    _run(storage, registry, lambda: storage.get("needs-store").attempt_count >= 1)
    task = storage.get("needs-store")
    assert task.status is TaskStatus.PENDING and task.last_error.type == "rdq_core.errors.ConfigurationError"
    assert "RDQ_PAYLOAD_BUCKET" in task.last_error.message
