"""MongoDB backend over a real wire connection: what is about MongoDB itself -- collections and
indexes, the attempt rows a task carries until they are recorded (crash points between writes),
its per-document costs, URL timeouts -- plus the compliance kit, which
holds every promise all backends share.

Server: ``$RDQ_TEST_MONGO_URL`` if set (point it at a real MongoDB to run the same tests there),
else an ``nx-27017`` the session starts (``tests/conftest.py``, through
``rdq_testing.servers``). Each test gets its own database, dropped afterwards. When no
server can be had the tests fail under CI and are skipped elsewhere.
"""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

pymongo = pytest.importorskip("pymongo")

from rdq_core.compliance import Capabilities, PerTask, StorageCompliance  # noqa: E402 - after importorskip
from rdq_testing.servers import mongo_url_with_database  # noqa: E402 - after importorskip
from rdq_core.compliance.support import wait_until  # noqa: E402 - after importorskip
from rdq_core.errors import StorageUnavailable  # noqa: E402 - after importorskip
from rdq_core.events import EventSettings  # noqa: E402 - after importorskip
from rdq_core.model import DeadFilter, ErrorInfo, NewTask, Outcome, Settlement, TaskFilter, TaskStatus  # noqa: E402 - after importorskip
from rdq_core.storage import open_storage  # noqa: E402 - after importorskip
from rdq_core.storage.mongo import MongoStorage  # noqa: E402 - after importorskip


class TestMongoCompliance(StorageCompliance):
    # Each call opens with a server handshake ("hello"). claim: the queue's paused flag (an _id
    # probe: findAndModify cannot read another collection), then one findAndModify per task, as
    # MongoDB has no atomic multi-document claim; settle: read, bulk update, record the rows;
    # stats: one count per status, the oldest due task, and the paused queues (the core asks).
    capabilities = Capabilities(
        round_trips={"enqueue": 2, "claim": PerTask(2, 1), "extend": 2, "release": 2, "settle": 4,
                     "find_expired": 2, "get": 2, "list_dead": 1, "stats": 8, "redrive": 2},
        # With lifecycle events on, the events ride on the task documents and are then moved to the
        # outbox: settle finds, inserts and clears (3); redrive reads, writes, finds, inserts, clears
        # per chunk instead of one update_many (4).
        event_round_trips={"settle": 3, "redrive": 4},
        unreachable_url="mongodb://127.0.0.1:{port}/rdq?serverSelectionTimeoutMS=300",
    )

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
    store = MongoStorage(mongo_url_with_database(mongo_server_url, ""))
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


@pytest.mark.parametrize("point", ["settle:committed", "events:moved"])
def test_events_left_on_a_task_by_a_settle_that_died_are_moved_by_the_next_take(storage, crash_at, point):
    """The settle's events ride on the task document; a death before they are copied to the
    outbox, or after the copy but before the task is cleared, loses none and doubles none."""
    storage.configure_events(EventSettings(enabled=True))
    [task_id] = _enqueue(storage, 1)
    [claimed] = storage.claim("q", 1, 30)
    crash_at(point)
    with pytest.raises(SimulatedCrash):
        storage.settle([Settlement(task_id, claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("E", "gone"))])
    crash_at()
    assert storage.get(task_id).status is TaskStatus.DEAD, "the change committed"
    assert storage._tasks.find_one({"_id": task_id})["pending_events"], "its event is on the task"
    incarnation = storage._tasks.find_one({"_id": task_id})["incarnation"]
    assert [e.id for e in storage.take_events(10, lease_seconds=30)] == [f"{task_id}:dead:1:{incarnation}"]
    assert "pending_events" not in storage._tasks.find_one({"_id": task_id}), "moved, then cleared"
    assert storage._outbox.count_documents({}) == 1


def test_a_redrive_that_died_before_moving_its_events_loses_none(storage, crash_at):
    storage.configure_events(EventSettings(enabled=True))
    ids = _enqueue(storage, 3)
    for claimed in storage.claim("q", 3, 30):
        storage.settle([Settlement(claimed.task.id, claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD)])
    storage.ack_events([e.id for e in storage.take_events(10, lease_seconds=30)])
    crash_at("redrive:committed")
    with pytest.raises(SimulatedCrash):
        storage.redrive("q", DeadFilter())
    crash_at()
    taken = storage.take_events(10, lease_seconds=30)
    incarnations = {d["_id"]: d["incarnation"] for d in storage._tasks.find({"_id": {"$in": ids}})}
    assert sorted(e.id for e in taken) == sorted(f"{i}:redriven:1:{incarnations[i]}" for i in ids)


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


# -- per-document costs ---------------------------------------------------------------------------

def test_repeated_ids_cost_one_read_back_of_the_existing_tasks(storage):
    """The kit measures fresh batches; a batch with ids that exist reads those tasks (and their
    history) back once, not once per id."""
    original = _task(id="order-42", payload={"v": 1})
    storage.enqueue([original])
    start = storage.round_trips
    results = storage.enqueue([_task(id="fresh"), _task(id="order-42", payload={"v": 2}),
                               _task(queue="other", id="order-42")])
    assert storage.round_trips - start <= 4  # hello, insert, read back the duplicates (+ their history)
    assert [(r.created, r.conflict) for r in results] == [(True, False), (False, False), (False, True)]


def test_extend_and_settle_costs_that_depend_on_what_the_tasks_carry(storage):
    task_ids = _enqueue(storage, 50)
    claimed = storage.claim("q", 50, 30)
    start = storage.round_trips
    storage.extend_leases([c.ref for c in claimed], 1)  # no lease moves: read back what is stored
    assert storage.round_trips - start == 3

    storage.settle([_fail(c) for c in claimed])
    storage._tasks.update_many({"_id": {"$in": task_ids}}, {"$set": {"next_attempt_at_ms": 0}})
    claimed = storage.claim("q", 50, 30)
    start = storage.round_trips
    storage.settle([_fail(c) for c in claimed])
    # + one find: the rows the tasks carry are recorded, so they can leave the tasks
    assert storage.round_trips - start == 5


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


# -- operator features: listings, cancel by filter, pause ----------------------------------------

def _statuses(storage, task_ids):
    return {d["_id"]: d["status"] for d in storage._tasks.find({"_id": {"$in": list(task_ids)}}, {"status": 1})}


def test_a_paused_claim_costs_the_flag_probe_alone_and_writes_nothing(storage):
    task_ids = _enqueue(storage, 3)
    storage.set_paused("q", True)
    before = {d["_id"]: d for d in storage._tasks.find({})}
    start = storage.round_trips
    assert storage.claim("q", 3, 30) == []
    assert storage.round_trips - start == 1  # the flag's _id probe; the clock is not even read
    assert {d["_id"]: d for d in storage._tasks.find({})} == before
    storage.set_paused("q", False)
    start = storage.round_trips
    assert len(storage.claim("q", 3, 30)) == 3
    assert storage.round_trips - start == 2 + 3  # probe, the clock (hello), one findAndModify per task
    assert set(_statuses(storage, task_ids).values()) == {TaskStatus.IN_FLIGHT.value}


def test_the_pause_flag_is_one_document_per_queue(storage):
    storage.set_paused("q", True)
    storage.set_paused("q", True)
    storage.set_paused("q", False)
    storage.set_paused("other", True)
    assert list(storage._queue_flags.find({}, sort=[("_id", 1)])) == [
        {"_id": "other", "paused": True}, {"_id": "q", "paused": False}]
    assert storage.paused_queues() == {"other"}


def test_a_listing_without_history_never_reads_the_attempts_collection(storage):
    task_ids = _enqueue(storage, 3, max_attempts=5)
    for status in (TaskStatus.PENDING, TaskStatus.DEAD):  # attempt 1 recorded, attempt 2 carried
        storage._tasks.update_many({}, {"$set": {"next_attempt_at_ms": 0}})
        storage.settle([_fail(c, status=status) for c in storage.claim("q", 3, 30)])
    start = storage.round_trips
    listed = storage.list_tasks("q", status=TaskStatus.DEAD, limit=10).tasks
    assert storage.round_trips - start == 1
    assert sorted(t.id for t in listed) == sorted(task_ids) and all(t.attempts == () for t in listed)
    start = storage.round_trips
    dead = storage.list_dead("q", limit=10).tasks
    assert storage.round_trips - start == 2  # the DLQ reads the recorded rows too
    assert all([a.attempt_no for a in t.attempts] == [1, 2] for t in dead)


def test_a_keyset_position_between_two_milliseconds_and_one_on_a_tie(storage):
    from rdq_core.storage.core import Selection

    ids = _enqueue(storage, 4)
    storage._tasks.update_one({"_id": ids[0]}, {"$set": {"next_attempt_at_ms": 1_000}})
    storage._tasks.update_many({"_id": {"$in": ids[1:]}}, {"$set": {"next_attempt_at_ms": 2_000}})
    ties = sorted(ids[1:])

    def page(after):
        return [d["_id"] for d in storage._page(Selection("q", TaskStatus.PENDING, after=after), 10, False)]

    assert page((1_000_000, ids[0])) == ties
    assert page((999_999, "~")) == [ids[0], *ties]  # 0.999999 s: the task at 1.000 s is after it
    assert page((1_000_001, "")) == ties  # 1.000001 s: nothing at 1.000 s is after it
    assert page((2_000_000, ties[0])) == ties[1:]
    assert page((2_000_000, ties[-1])) == []


def test_cancel_selected_racing_claims_never_cancels_a_claimed_task(storage, fresh_mongo_url):
    """A claim loop runs in another client while the whole queue is cancelled: each task ends
    up claimed (IN_FLIGHT) or cancelled, never both, and the count is what was cancelled."""
    import threading

    task_ids = _enqueue(storage, 400)
    claimer = open_storage(fresh_mongo_url)
    claimed: list[str] = []

    def claim_all() -> None:
        while got := claimer.claim("q", 2, 60):
            claimed.extend(c.task.id for c in got)

    thread = threading.Thread(target=claim_all)
    thread.start()
    try:
        wait_until(lambda: len(claimed) >= 10, interval=0.001, what="the claim loop to be running")
        cancelled = storage.cancel_selected("q", TaskFilter())
    finally:
        thread.join(60)
        claimer.close()
    assert not thread.is_alive()
    assert 10 <= len(claimed) < len(task_ids), "the cancel ran while the claim loop still had tasks to take"
    statuses = _statuses(storage, task_ids)
    assert {statuses[i] for i in claimed} == {TaskStatus.IN_FLIGHT.value}, "a claimed task was cancelled"
    assert cancelled == sum(s == TaskStatus.CANCELLED.value for s in statuses.values())
    assert cancelled + len(claimed) == len(task_ids) and len(set(claimed)) == len(claimed)


# -- engine documents ----------------------------------------------------------------------------

def test_each_document_call_is_one_command_and_a_page_costs_one_find(storage):
    def cost(call):
        start = storage.round_trips
        result = call()
        return storage.round_trips - start, result

    assert cost(lambda: storage.put_document("op", "a", {"n": 1}, expected_version=None))[0] == 1
    assert cost(lambda: storage.put_document("op", "a", {"n": 1}, expected_version=None)) == (1, None)
    assert cost(lambda: storage.put_document("op", "a", {"n": 2}, expected_version=1))[0] == 1
    assert cost(lambda: storage.put_document("op", "a", {"n": 3}, expected_version=1)) == (1, None)
    assert cost(lambda: storage.get_document("op", "a"))[0] == 1
    assert cost(lambda: storage.delete_document("op", "a", expected_version=1)) == (1, False)
    for n in range(30):
        storage.put_document("op", f"k{n:02d}", {}, expected_version=None)
    trips, page = cost(lambda: storage.list_documents("op", limit=25, after="k02"))
    assert trips == 1 and [d.key for d in page] == [f"k{n:02d}" for n in range(3, 28)]
    assert cost(lambda: storage.delete_document("op", "a", expected_version=2)) == (1, True)


def test_documents_are_one_per_kind_and_key_with_the_body_as_stored_text(storage):
    storage.put_document("op", "a", {"$where": "x", "a.b": [1, 2]}, expected_version=None)
    storage.put_document("lock", "a", {}, expected_version=None)
    stored = storage._documents.find_one({"kind": "op", "key": "a"})
    assert stored["version"] == 1 and isinstance(stored["body"], str)
    assert storage.get_document("op", "a").body == {"$where": "x", "a.b": [1, 2]}
    with pytest.raises(pymongo.errors.DuplicateKeyError):  # the unique (kind, key) index
        storage._documents.insert_one({"_id": "another id", "kind": "op", "key": "a", "version": 1, "body": "{}"})


# -- flow control: slot documents -------------------------------------------------------------

def test_an_over_limit_task_is_handed_back_at_once_without_an_attempt(storage):
    from rdq_core.flow import FlowPolicy

    storage.enqueue([_task(id=f"k{i}", concurrency_key="serial") for i in range(3)] + [_task(id="free")])
    flow = FlowPolicy(concurrency_limit=1)
    claimed = storage.claim("q", 10, 60, flow)
    assert sorted(c.task.id for c in claimed) == ["free", "k0"]
    for task_id in ("k1", "k2"):
        task = storage.get(task_id)
        assert (task.status, task.attempt_count, task.attempts) == (TaskStatus.PENDING, 0, ())
    start = storage.round_trips
    assert storage.claim("q", 10, 60, flow) == []  # the key is full: one hand-back, then left out
    assert storage.round_trips - start <= 8


def test_a_slot_freed_after_the_claim_read_the_clock_moves_its_start_past_the_predecessor(storage):
    from rdq_core.flow import FlowPolicy
    from rdq_core.storage.mongo.flow_claim import FlowClaim

    storage.enqueue([_task(id="a", concurrency_key="k"), _task(id="b", concurrency_key="k")])
    flow = FlowPolicy(concurrency_limit=1)
    (first,) = storage.claim("q", 1, 60, flow)
    # A claim that read the clock before the first one settled.
    stale_now = int(first.claimed_at.timestamp() * 1000)
    time.sleep(0.02)
    storage.settle([Settlement(first.task.id, first.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    finished = storage.get("a").attempts[-1].finished_at
    claim = FlowClaim(storage._tasks, storage._flow_slots, "q", 1, stale_now, 60_000, flow, None)
    (doc,) = claim.run()
    assert doc["_id"] == "b"
    assert doc["claimed_at_ms"] > int(finished.timestamp() * 1000)


def test_tasks_stored_before_schema_5_are_claimed_under_aging_and_fair_groups(storage):
    from rdq_core.flow import FlowPolicy

    storage.enqueue([_task(id="old0"), _task(id="old1"), _task(id="new", priority=5, group="g")])
    storage._tasks.update_many({"_id": {"$in": ["old0", "old1"]}}, {"$unset": {"priority": "", "group": ""}})
    assert [c.task.id for c in storage.claim("q", 1, 60, FlowPolicy(priority_aging_seconds=60))] == ["old0"]
    assert sorted(c.task.id for c in storage.claim("q", 5, 60, FlowPolicy(fair_groups=True))) == ["new", "old1"]
