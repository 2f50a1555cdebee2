"""MongoDB backend tests over a real wire connection.

Server: ``$RDQ_TEST_MONGO_URL`` if set (point it at a real MongoDB to run the same tests there),
else an ``nx-27017`` started for this session on a free loopback port, with its own pid file and
log in a directory of its own, and verified to be the server answering there (its
``serverStatus`` PID is the one we started): never whatever else happens to listen on 27017 or
on the chosen port. Each test gets its own database, dropped afterwards. When no server can be
had the tests fail under CI and are skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

pymongo = pytest.importorskip("pymongo")

from rdq_core.errors import InvalidInput, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound  # noqa: E402
from rdq_core.model import (  # noqa: E402
    ClaimRef,
    DeadFilter,
    ErrorInfo,
    NewTask,
    Outcome,
    Settlement,
    TaskStatus,
)
from rdq_core.storage import open_storage  # noqa: E402
from rdq_core.storage.mongo import MongoStorage  # noqa: E402
from rdq_core.compliance.support import wait_until  # noqa: E402
from tests.loopback import ServerStartError, mongo_served_pid, start_owned_server, stop_process  # noqa: E402

SERVER_START_DEADLINE_S = 20.0


def _fail_or_skip(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _answers(url: str, timeout_ms: int = 500) -> bool:
    client = pymongo.MongoClient(url, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms)
    try:
        client.admin.command("ping")
        return True
    except pymongo.errors.PyMongoError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def mongo_server_url():
    configured = os.environ.get("RDQ_TEST_MONGO_URL")
    if configured:
        if not _answers(configured, timeout_ms=5000):
            _fail_or_skip(f"RDQ_TEST_MONGO_URL={configured} does not answer")
        yield configured
        return
    executable = shutil.which("nx-27017")
    if executable is None:
        _fail_or_skip("nx-27017 is not installed (pip install nx-27017), and RDQ_TEST_MONGO_URL is not set")
    workdir = Path(tempfile.mkdtemp(prefix="rdq-nx27017-"))
    log_path = workdir / "server.log"

    def start(port: int) -> subprocess.Popen:
        # Its own pid file: nx-27017 refuses to start while its default one names a live process.
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [executable, "--host", "127.0.0.1", "-p", str(port), "--db", "memory",
                 "--log-file", str(workdir / f"nx-{port}.log"), "--pid-file", str(workdir / f"nx-{port}.pid")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
            )

    try:
        server, port = start_owned_server(start, mongo_served_pid, "nx-27017", log_path.read_text,
                                          timeout=SERVER_START_DEADLINE_S)
    except ServerStartError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        _fail_or_skip(str(exc))
    try:
        yield f"mongodb://127.0.0.1:{port}/"
    finally:
        stop_process(server)
        shutil.rmtree(workdir, ignore_errors=True)


def _with_database(server_url: str, database: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@pytest.fixture
def fresh_mongo_url(mongo_server_url):
    """A URL naming a database no one has used; dropped after the test."""
    database = "rdq_test_" + uuid.uuid4().hex[:12]
    yield _with_database(mongo_server_url, database)
    client = pymongo.MongoClient(mongo_server_url, serverSelectionTimeoutMS=5000)
    try:
        client.drop_database(database)
    finally:
        client.close()


try:
    from rdq_core.compliance import StorageCompliance
except ImportError:  # the kit is optional for this module; the backend's own tests still run
    StorageCompliance = None

if StorageCompliance is not None:

    class TestMongoCompliance(StorageCompliance):
        @pytest.fixture
        def storage_url(self, fresh_mongo_url):
            yield fresh_mongo_url


@pytest.fixture
def storage(fresh_mongo_url):
    store = open_storage(fresh_mongo_url)
    assert isinstance(store, MongoStorage)
    store.migrate()
    yield store
    store.close()


# -- helpers ------------------------------------------------------------------------------------

def _task(queue="q", handler="noop", payload=None, **fields):
    return NewTask(id=fields.pop("id", None) or uuid.uuid4().hex, queue=queue, handler=handler,
                   payload=payload, **fields)


def _enqueue(storage, n, queue="q", **fields):
    tasks = [_task(queue, payload={"n": i}, **fields) for i in range(n)]
    for start in range(0, n, 500):
        storage.enqueue(tasks[start:start + 500])
    return [t.id for t in tasks]


def _fail(claimed, status=TaskStatus.PENDING, outcome=Outcome.RETRYABLE_FAILURE, error_type="boom.Error"):
    return Settlement(claimed.task.id, claimed.claim_token, outcome, status,
                      error=ErrorInfo(error_type, "failed on purpose"))


# -- schema -------------------------------------------------------------------------------------

def test_migrate_is_idempotent_and_open_storage_picks_mongo(storage, fresh_mongo_url):
    storage.migrate()
    storage.migrate()
    second = open_storage(fresh_mongo_url)
    second.migrate()
    second.close()
    assert storage._db.name == urlsplit(fresh_mongo_url).path.lstrip("/")
    assert {"tasks", "attempts", "schema"} <= set(storage._db.list_collection_names())


def test_default_database_is_rdq(mongo_server_url):
    store = MongoStorage(_with_database(mongo_server_url, ""))
    try:
        assert store._db.name == "rdq"
    finally:
        store.close()


def test_unique_index_rejects_duplicate_attempt_rows(storage):
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([_fail(claimed)])
    row = storage._attempts.find_one({"task_id": task_id}, {"_id": 0})
    assert row["attempt_no"] == 1
    with pytest.raises(pymongo.errors.DuplicateKeyError):
        storage._attempts.insert_one(dict(row, outcome="SUCCESS"))


# -- claims -------------------------------------------------------------------------------------

def test_concurrent_claims_never_hand_out_a_task_twice(fresh_mongo_url, storage):
    task_ids = _enqueue(storage, 400)
    claimed_ids: list[str] = []
    claimed_lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer():
        store = open_storage(fresh_mongo_url)  # own client: a separate set of connections
        try:
            while True:
                batch = store.claim("q", 7, 60)
                if not batch:
                    return
                with claimed_lock:
                    claimed_ids.extend(c.task.id for c in batch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    duplicates = [task_id for task_id, n in Counter(claimed_ids).items() if n > 1]
    assert duplicates == []
    assert sorted(claimed_ids) == sorted(task_ids)
    assert storage.stats("q").in_flight == 400


def test_claim_respects_due_time_order_and_queue(storage):
    later = _task(delay_seconds=3600)
    first, second = _task(), _task()
    storage.enqueue([later, first])
    storage.enqueue([second, _task(queue="other")])
    claimed = storage.claim("q", 10, 30)
    assert [c.task.id for c in claimed] == [first.id, second.id]
    for c in claimed:
        assert c.task.status is TaskStatus.IN_FLIGHT
        assert c.lease_expires_at > c.claimed_at
        assert len(c.claim_token) == 32
    assert len({c.claim_token for c in claimed}) == 2


def test_claim_uses_the_server_clock(storage):
    before = storage.now()
    storage.enqueue([_task()])
    [claimed] = storage.claim("q", 1, 10)
    after = storage.now()
    assert before <= claimed.claimed_at <= after
    assert abs((claimed.lease_expires_at - claimed.claimed_at).total_seconds() - 10) < 0.002


# -- fencing ------------------------------------------------------------------------------------

def test_stale_token_changes_nothing_and_valid_items_still_apply(storage):
    _enqueue(storage, 2)
    first, second = storage.claim("q", 2, 30)
    before = storage.get(second.task.id)
    with pytest.raises(StaleClaim) as refused:
        storage.settle([
            Settlement(first.task.id, first.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"ok": 1}),
            Settlement(second.task.id, "0" * 32, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
        ])
    assert refused.value.task_ids == (second.task.id,)
    assert storage.get(first.task.id).status is TaskStatus.SUCCEEDED
    assert storage.get(second.task.id) == before

    # The spent token of the settled task is stale for every later write.
    with pytest.raises(StaleClaim):
        storage.settle([Settlement(first.task.id, first.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    with pytest.raises(StaleClaim):
        storage.extend_leases([first.ref], 30)
    with pytest.raises(StaleClaim):
        storage.release([first.ref])
    assert [a.attempt_no for a in storage.get(first.task.id).attempts] == [1]

    with pytest.raises(StaleClaim) as refused:
        storage.extend_leases([second.ref, ClaimRef(second.task.id, "f" * 32)], 120)
    assert storage.get(second.task.id).lease_expires_at > second.lease_expires_at


def test_release_returns_task_without_spending_an_attempt(storage):
    [task_id] = _enqueue(storage, 1)
    original_due = storage.get(task_id).next_attempt_at
    [claimed] = storage.claim("q", 1, 30)
    storage.release([claimed.ref])
    task = storage.get(task_id)
    assert (task.status, task.attempt_count, task.attempts, task.next_attempt_at) == (
        TaskStatus.PENDING, 0, (), original_due)
    with pytest.raises(StaleClaim):
        storage.release([claimed.ref])
    [again] = storage.claim("q", 1, 30)
    assert again.claim_token != claimed.claim_token


def test_lease_expired_settle_refused_until_lease_expires_by_server_clock(storage):
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 0.5)
    assert storage.find_expired_leases(10) == []
    with pytest.raises(StaleClaim):
        storage.settle([_fail(claimed, outcome=Outcome.LEASE_EXPIRED)])
    assert storage.get(task_id).status is TaskStatus.IN_FLIGHT
    wait_until(lambda: storage.find_expired_leases(10), what="lease expiry")
    [expired] = storage.find_expired_leases(10, queue="q")
    assert expired.claim_token == claimed.claim_token
    storage.settle([_fail(expired, outcome=Outcome.LEASE_EXPIRED)])
    task = storage.get(task_id)
    assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.LEASE_EXPIRED)]
    assert task.status is TaskStatus.PENDING and task.attempt_count == 1


def test_racing_reapers_record_one_lease_expired_attempt(fresh_mongo_url, storage):
    [task_id] = _enqueue(storage, 1)
    storage.claim("q", 1, 0.2)
    wait_until(lambda: storage.find_expired_leases(1), what="lease expiry")
    [expired] = storage.find_expired_leases(1)
    outcomes: list[str] = []

    def reap():
        store = open_storage(fresh_mongo_url)
        try:
            store.settle([_fail(expired, outcome=Outcome.LEASE_EXPIRED)])
            outcomes.append("applied")
        except StaleClaim:
            outcomes.append("refused")
        finally:
            store.close()

    threads = [threading.Thread(target=reap) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["applied"] + ["refused"] * 5
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1]
    assert storage._attempts.count_documents({"task_id": task_id}) == 1


# -- history ------------------------------------------------------------------------------------

def test_redrive_then_lease_expiry_numbers_after_all_earlier_attempts(storage):
    [task_id] = _enqueue(storage, 1, max_attempts=2)
    for status in (TaskStatus.PENDING, TaskStatus.DEAD):
        [claimed] = storage.claim("q", 1, 30)
        storage.settle([_fail(claimed, status=status)])
        storage._tasks.update_one({"_id": task_id}, {"$set": {"next_attempt_at": storage.now()}})
    assert storage.redrive("q", DeadFilter(ids=(task_id,))) == 1
    redriven = storage.get(task_id)
    assert (redriven.status, redriven.attempt_count, redriven.redrive_count) == (TaskStatus.PENDING, 0, 1)
    assert len(redriven.attempts) == 2

    storage.claim("q", 1, 0.2)
    wait_until(lambda: storage.find_expired_leases(1), what="lease expiry")
    [expired] = storage.find_expired_leases(1)
    storage.settle([_fail(expired, outcome=Outcome.LEASE_EXPIRED)])
    task = storage.get(task_id)
    assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
        (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.RETRYABLE_FAILURE), (3, Outcome.LEASE_EXPIRED)]
    assert task.attempt_count == 1


class SimulatedCrash(BaseException):
    """The process dies at a crash point: nothing after it runs, no handler catches it."""


@pytest.fixture
def crash_at(monkeypatch):
    """``crash_at("settle:committed")`` makes every later call die at that point of mongo.py
    (between two of its writes), like a process killed there; ``crash_at()`` disarms."""
    from rdq_core.storage.mongo import backend as mongo

    def arm(*points: str) -> None:
        def hook(name: str) -> None:
            if name in points:
                raise SimulatedCrash(name)

        monkeypatch.setattr(mongo, "_crash_hook", hook if points else None)

    yield arm
    monkeypatch.setattr(mongo, "_crash_hook", None)


def _due_now(storage, task_id):
    storage._tasks.update_one({"_id": task_id}, {"$set": {"next_attempt_at_ms": 0}})


def _recorded_numbers(storage, task_id):
    return sorted(r["attempt_no"] for r in storage._attempts.find({"task_id": task_id}))


def test_settle_that_died_before_inserting_its_attempt_row_is_healed(storage, crash_at):
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    crash_at("settle:committed")
    with pytest.raises(SimulatedCrash):
        storage.settle([_fail(claimed)])
    crash_at()
    assert _recorded_numbers(storage, task_id) == []
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1]  # committed on the task

    _due_now(storage, task_id)
    [again] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, again.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    rows = list(storage._attempts.find({"task_id": task_id}, sort=[("attempt_no", 1)]))
    assert [(r["attempt_no"], r["outcome"]) for r in rows] == [(1, "RETRYABLE_FAILURE"), (2, "SUCCESS")]


def test_two_settles_in_a_row_dying_between_their_writes_lose_no_attempt(storage, crash_at):
    """The [2, 3] loss: the task kept only its *last* unrecorded attempt, so a second settle
    dying before its insert dropped attempt 2 for good (history [1, 3], attempt_count 3)."""
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([_fail(claimed)])  # attempt 1, recorded normally
    crash_at("settle:committed")
    for _ in range(2):  # attempts 2 and 3: committed on the task, then the process dies
        _due_now(storage, task_id)
        [claimed] = storage.claim("q", 1, 30)
        with pytest.raises(SimulatedCrash):
            storage.settle([_fail(claimed)])
    crash_at()
    task = storage.get(task_id)
    assert task.attempt_count == 3
    assert [a.attempt_no for a in task.attempts] == [1, 2, 3]

    _due_now(storage, task_id)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert _recorded_numbers(storage, task_id) == [1, 2, 3, 4]
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1, 2, 3, 4]
    # Only the newest row is still carried (it leaves once a later settle sees it recorded).
    assert [r["attempt_no"] for r in storage._tasks.find_one({"_id": task_id})["pending_attempts"]] == [4]


def test_history_survives_a_crash_at_every_settle_through_reaper_dead_letter_and_redrive(storage, crash_at):
    """Every settle dies after its commit -- worker failures, a reaper's LEASE_EXPIRED, the
    dead-lettering one -- and reads, redrive and the next settles still see 1..n."""
    [task_id] = _enqueue(storage, 1, max_attempts=3)
    crash_at("settle:committed")
    outcomes = []
    for step in range(3):
        _due_now(storage, task_id)
        if step == 1:  # a lease that expires, settled by the reaper
            storage.claim("q", 1, 0.1)
            [claimed] = wait_until(lambda: storage.find_expired_leases(1), what="lease expiry")
            settlement = _fail(claimed, outcome=Outcome.LEASE_EXPIRED)
        else:
            [claimed] = storage.claim("q", 1, 30)
            settlement = _fail(claimed, status=TaskStatus.DEAD if step == 2 else TaskStatus.PENDING)
        with pytest.raises(SimulatedCrash):
            storage.settle([settlement])
        outcomes.append(settlement.outcome)
    crash_at()
    expected = list(enumerate(outcomes, start=1))
    # Each settle recorded the row its predecessor left before committing its own.
    assert _recorded_numbers(storage, task_id) == [1, 2]
    assert [r["attempt_no"] for r in storage._tasks.find_one({"_id": task_id})["pending_attempts"]] == [3]
    [dead] = storage.list_dead("q", limit=5).tasks
    assert [(a.attempt_no, a.outcome) for a in dead.attempts] == expected
    assert storage.redrive("q", DeadFilter(ids=(task_id,))) == 1
    assert [(a.attempt_no, a.outcome) for a in storage.get(task_id).attempts] == expected
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert _recorded_numbers(storage, task_id) == [1, 2, 3, 4]
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1, 2, 3, 4]


def test_rows_the_attempts_collection_refuses_stay_on_the_task_until_it_takes_them(storage, monkeypatch):
    """While inserts into attempts fail, settles still commit (the commit decides), and every
    row waits on the task -- several of them -- until an insert works again."""
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([_fail(claimed)])
    real = storage._attempts

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def insert_many(self, *args, **kwargs):
            raise pymongo.errors.AutoReconnect("attempts unwritable")

    monkeypatch.setattr(storage, "_attempts", Refusing())
    for _ in range(2):
        _due_now(storage, task_id)
        [claimed] = storage.claim("q", 1, 30)
        storage.settle([_fail(claimed)])  # committed; its row cannot be recorded yet
    doc = storage._tasks.find_one({"_id": task_id})
    assert [r["attempt_no"] for r in doc["pending_attempts"]] == [2, 3]
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1, 2, 3]
    monkeypatch.setattr(storage, "_attempts", real)
    _due_now(storage, task_id)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert _recorded_numbers(storage, task_id) == [1, 2, 3, 4]
    assert [r["attempt_no"] for r in storage._tasks.find_one({"_id": task_id})["pending_attempts"]] == [4]


def test_a_purge_that_dies_between_its_deletes_leaves_nothing_a_new_task_would_inherit(storage, crash_at):
    """Rows a half-done purge leaves behind belong to the purged task: a task enqueued later
    under the same id shows none of them, numbers from 1, and records its own rows."""
    [task_id] = _enqueue(storage, 1, id="reused")
    for status in (TaskStatus.PENDING, TaskStatus.DEAD):
        _due_now(storage, task_id)
        [claimed] = storage.claim("q", 1, 30)
        storage.settle([_fail(claimed, status=status)])
    crash_at("purge_dead:tasks_deleted")
    with pytest.raises(SimulatedCrash):
        storage.purge_dead("q", DeadFilter())
    crash_at()
    assert storage.get(task_id) is None and _recorded_numbers(storage, task_id) == [1, 2]  # orphans

    [again] = storage.enqueue([_task(id="reused")])
    assert again.created and again.task.attempts == ()
    assert storage.get(task_id).attempts == ()
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    task = storage.get(task_id)
    assert [(a.attempt_no, a.outcome) for a in task.attempts] == [(1, Outcome.SUCCESS)]
    assert _recorded_numbers(storage, task_id) == [1, 2]  # ours replaced orphan 1; orphan 2 is inert
    incarnation = storage._tasks.find_one({"_id": task_id})["incarnation"]
    assert storage._attempts.find_one({"task_id": task_id, "attempt_no": 1})["incarnation"] == incarnation

    # Retention: the same, and a full pass removes what is left of the task itself.
    crash_at("purge_succeeded:tasks_deleted")
    with pytest.raises(SimulatedCrash):
        storage.purge_succeeded(0, 10)
    crash_at()
    assert storage.get(task_id) is None
    storage.enqueue([_task(id="reused")])
    assert storage.get(task_id).attempts == ()


def test_schema_1_documents_with_last_attempt_are_read_and_healed(storage):
    """Tasks written before pending_attempts kept one unrecorded row in last_attempt."""
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([_fail(claimed)])
    row = storage._attempts.find_one({"task_id": task_id}, {"_id": 0})
    storage._attempts.delete_many({"task_id": task_id})
    legacy_row = {k: v for k, v in row.items() if k != "incarnation"}
    storage._tasks.update_one({"_id": task_id}, {"$set": {"last_attempt": legacy_row},
                                                  "$unset": {"pending_attempts": "", "incarnation": ""}})
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1]
    _due_now(storage, task_id)
    [claimed] = storage.claim("q", 1, 30)
    storage.settle([Settlement(task_id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert _recorded_numbers(storage, task_id) == [1, 2]
    doc = storage._tasks.find_one({"_id": task_id})
    assert "last_attempt" not in doc and [r["attempt_no"] for r in doc["pending_attempts"]] == [2]
    assert [a.attempt_no for a in storage.get(task_id).attempts] == [1, 2]


# -- payloads and input -------------------------------------------------------------------------

def test_any_json_round_trips_and_never_becomes_an_operator(storage):
    payload = {"$set": {"status": "SUCCEEDED"}, "a.b": [1, {"$gt": ""}], "": None, "ü": 1.5}
    headers = {"x.trace": "1", "$where": "true"}
    task = _task(payload=payload, headers=headers)
    [created] = storage.enqueue([task])
    assert created.task.payload == payload
    fetched = storage.get(task.id)
    assert (fetched.payload, dict(fetched.headers)) == (payload, headers)
    [claimed] = storage.claim("q", 1, 30)
    result = {"$inc": {"attempt_count": 100}, "k.v": ["$$NOW"]}
    storage.settle([Settlement(task.id, claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=result)])
    done = storage.get(task.id)
    assert done.result == result and done.attempt_count == 1
    for scalar in ("text", 3, None, [1, 2]):
        other = _task(payload=scalar)
        storage.enqueue([other])
        assert storage.get(other.id).payload == scalar


def test_operator_shaped_ids_are_rejected(storage):
    _enqueue(storage, 1)
    with pytest.raises(InvalidInput):
        storage.get({"$gt": ""})
    with pytest.raises(InvalidInput):
        storage.settle([Settlement({"$ne": None}, {"$ne": None}, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    with pytest.raises(InvalidInput):
        storage.redrive("q", DeadFilter(ids=({"$exists": True},)))


# -- enqueue ------------------------------------------------------------------------------------

def test_enqueue_is_idempotent_per_id_and_conflicts_across_queues(storage):
    original = _task(id="order-42", payload={"v": 1})
    [first] = storage.enqueue([original])
    assert first.created and not first.conflict
    [claimed] = storage.claim("q", 1, 30)

    fresh = _task(id="fresh")
    repeat = _task(id="order-42", payload={"v": 2})
    elsewhere = _task(queue="other", id="order-42")
    twice = _task(id="fresh")
    start = storage.round_trips
    results = storage.enqueue([fresh, repeat, elsewhere, twice])
    assert storage.round_trips - start <= 4  # hello, insert, read back the duplicates (+ their history)
    assert [(r.task.id, r.created, r.conflict) for r in results] == [
        ("fresh", True, False), ("order-42", False, False), ("order-42", False, True), ("fresh", False, False)]
    assert results[1].task.payload == {"v": 1} and results[1].task.status is TaskStatus.IN_FLIGHT
    assert results[2].task.queue == "q"
    assert storage.get("order-42").payload == {"v": 1}
    assert storage.list_queues() == ["q"]
    storage.settle([Settlement("order-42", claimed.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])


def test_enqueue_connection_argument_is_refused(storage):
    with pytest.raises(TypeError):
        storage.enqueue([_task()], connection=object())


def test_delay_and_run_at(storage):
    delayed = _task(delay_seconds=3600)
    scheduled = _task(run_at=storage.now())
    storage.enqueue([delayed, scheduled])
    assert [c.task.id for c in storage.claim("q", 10, 30)] == [scheduled.id]
    assert (storage.get(delayed.id).next_attempt_at - storage.now()).total_seconds() > 3500


# -- round trips --------------------------------------------------------------------------------

def test_round_trips_are_constant_per_batch(storage):
    task_ids = _enqueue(storage, 50)
    start = storage.round_trips
    _enqueue(storage, 500)
    assert storage.round_trips - start == 2  # hello + insert_many

    start = storage.round_trips
    claimed = storage.claim("q", 50, 30)
    assert len(claimed) == 50 and storage.round_trips - start == 51  # hello + one findAndModify each

    start = storage.round_trips
    storage.extend_leases([c.ref for c in claimed], 60)
    assert storage.round_trips - start == 2

    start = storage.round_trips
    storage.extend_leases([c.ref for c in claimed], 1)  # no lease moves: read back what is stored
    assert storage.round_trips - start == 3

    start = storage.round_trips
    storage.settle([_fail(c) for c in claimed])
    # hello, read tasks, bulk update, insert attempts (first attempts: nothing carried to check)
    assert storage.round_trips - start == 4
    assert {t for t in task_ids} == {c.task.id for c in claimed}

    storage._tasks.update_many({"_id": {"$in": task_ids}}, {"$set": {"next_attempt_at_ms": 0}})
    claimed = storage.claim("q", 50, 30)
    start = storage.round_trips
    storage.settle([_fail(c) for c in claimed])
    # + one find: the rows the tasks carry are recorded, so they can leave the tasks
    assert storage.round_trips - start == 5


# -- operator side ------------------------------------------------------------------------------

def test_dlq_paging_is_stable_under_concurrent_dead_lettering(storage):
    def kill(n, handler="noop", error_type="boom.Error"):
        ids = _enqueue(storage, n, handler=handler, max_attempts=1)
        claimed = storage.claim("q", n, 30)
        storage.settle([_fail(c, status=TaskStatus.DEAD, outcome=Outcome.PERMANENT_FAILURE, error_type=error_type)
                        for c in claimed])
        return ids

    early = kill(25)
    seen: list[str] = []
    cursor = None
    while True:
        page = storage.list_dead("q", limit=7, cursor=cursor)
        seen += [t.id for t in page.tasks]
        kill(3, handler="other", error_type="late.Error")  # die while the operator pages
        cursor = page.next_cursor
        if cursor is None:
            break
    assert set(early) <= set(seen) and len(seen) == len(set(seen))
    assert all(t.attempts and t.status is TaskStatus.DEAD for t in storage.list_dead("q", limit=3).tasks)

    late = storage.list_dead("q", limit=500, filter=DeadFilter(error_type="late.Error")).tasks
    assert late and {t.handler for t in late} == {"other"}
    by_handler = storage.list_dead("q", limit=500, filter=DeadFilter(handler="noop")).tasks
    assert {t.id for t in by_handler} == set(early)
    with pytest.raises(InvalidInput):
        storage.list_dead("q", limit=5, cursor="not-a-cursor")
    with pytest.raises(InvalidInput):
        storage.list_dead("other", limit=5, cursor=storage.list_dead("q", limit=1).next_cursor)

    assert storage.redrive("q", DeadFilter(ids=tuple(early[:5]))) == 5
    assert storage.redrive("q", DeadFilter(ids=tuple(early[:5]))) == 0
    assert storage.purge_dead("q", DeadFilter(error_type="late.Error")) == len(late)
    assert storage._attempts.count_documents({"task_id": {"$in": [t.id for t in late]}}) == 0
    stats = storage.stats("q")
    assert (stats.pending, stats.dead) == (5, 20)
    assert storage.purge_dead("q", DeadFilter()) == 20
    assert storage.get(early[0]).attempts  # redriven tasks keep their history


def test_cancel(storage):
    [task_id, other] = _enqueue(storage, 2)
    assert storage.cancel(task_id).status is TaskStatus.CANCELLED
    with pytest.raises(TaskConflict):
        storage.cancel(task_id)
    with pytest.raises(TaskNotFound):
        storage.cancel("missing")
    assert [c.task.id for c in storage.claim("q", 5, 30)] == [other]


def test_stats_and_retention(storage):
    _enqueue(storage, 3)
    _enqueue(storage, 1, delay_seconds=3600)
    done, failed, _ = storage.claim("q", 3, 30)
    storage.settle([Settlement(done.task.id, done.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                    _fail(failed, status=TaskStatus.DEAD, outcome=Outcome.PERMANENT_FAILURE)])
    [cancelled] = _enqueue(storage, 1, queue="q")
    storage.cancel(cancelled)
    stats = storage.stats("q")
    assert (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled) == (1, 1, 1, 1, 1)
    assert stats.oldest_pending_age_seconds == 0.0  # the only pending task is not due yet
    _enqueue(storage, 1, run_at=storage.now().replace(year=2000))
    assert storage.stats("q").oldest_pending_age_seconds > 3600

    assert storage.purge_succeeded(3600, 100) == 0
    time.sleep(0.05)
    assert storage.purge_succeeded(0.01, 1) == 1
    assert storage.purge_succeeded(0.01, 100) == 1
    assert storage.get(done.task.id) is None and storage.get(cancelled) is None
    assert storage._attempts.count_documents({"task_id": done.task.id}) == 0
    assert storage.get(failed.task.id).status is TaskStatus.DEAD


def test_unreachable_server_raises_storage_unavailable():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    store = MongoStorage(f"mongodb://127.0.0.1:{port}/rdq?serverSelectionTimeoutMS=300")
    try:
        with pytest.raises(StorageUnavailable):
            store.claim("q", 1, 30)
        with pytest.raises(StorageUnavailable):
            store.now()
    finally:
        store.close()


# -- every call is bounded in time --------------------------------------------------------------

def _with_query(url: str, port: int, **query: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, "&".join(f"{k}={v}" for k, v in query.items()), ""))


def test_a_half_open_connection_raises_storage_unavailable_within_the_socket_timeout(fresh_mongo_url):
    from tests.backends.stall_proxy import StallingProxy

    upstream = urlsplit(fresh_mongo_url)
    with StallingProxy(upstream.hostname or "127.0.0.1", upstream.port or 27017) as proxy:
        store = MongoStorage(_with_query(fresh_mongo_url, proxy.port, socketTimeoutMS="500",
                                         connectTimeoutMS="500", serverSelectionTimeoutMS="1000"))
        try:
            store.migrate()
            _enqueue(store, 2)
            [held] = store.claim("q", 1, 60)
            proxy.stall()  # pooled connections stay open; nothing answers any more
            for call in (lambda: store.claim("q", 1, 60), lambda: store.settle([_fail(held)]),
                         lambda: store.get(held.task.id)):
                started = time.monotonic()
                with pytest.raises(StorageUnavailable):
                    call()
                assert time.monotonic() - started < 5
        finally:
            proxy.close()
            store.close()


def test_timeouts_default_and_yield_to_the_url(fresh_mongo_url):
    store = MongoStorage(fresh_mongo_url)
    try:
        options = store._client.options
        assert (options.pool_options.socket_timeout, options.pool_options.connect_timeout) == (30.0, 10.0)
        assert options.server_selection_timeout == 10.0
    finally:
        store.close()
    store = MongoStorage(fresh_mongo_url.rstrip("/") + "?sockettimeoutms=1500&connectTimeoutMS=2500")
    try:
        options = store._client.options
        assert (options.pool_options.socket_timeout, options.pool_options.connect_timeout) == (1.5, 2.5)
    finally:
        store.close()
