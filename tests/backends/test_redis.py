"""Redis backend: key layout, script guarantees and round-trip budgets, plus the compliance kit.

Needs a Redis server (``RDQ_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``). The server
may be shared: every test works under its own key prefix ``rdq-test-<uuid>`` and deletes exactly
the keys under that prefix afterwards. Nothing here flushes a database.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

redis = pytest.importorskip("redis")

from rdq_core.errors import InvalidCursor, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound  # noqa: E402
from rdq_core.model import ClaimRef, DeadFilter, ErrorInfo, NewTask, Outcome, Settlement, TaskStatus  # noqa: E402
from rdq_core.storage import open_storage  # noqa: E402
from rdq_core.storage.redis import RedisStorage  # noqa: E402
from rdq_core.storage.spi import to_micros  # noqa: E402

BASE_URL = os.environ.get("RDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def url_with_prefix(url: str, prefix: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["prefix"] = prefix
    return urlunsplit(parts._replace(query=urlencode(query)))


@pytest.fixture(scope="session")
def redis_client():
    """A plain client on the test server, for looking under the hood (never for flushing)."""
    client = redis.Redis.from_url(BASE_URL, decode_responses=True, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        message = f"Redis is not reachable at {BASE_URL} (set RDQ_TEST_REDIS_URL): {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    yield client
    client.close()


def keys_under(client, prefix: str) -> list[str]:
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))


@pytest.fixture
def key_prefix(redis_client):
    prefix = f"rdq-test-{uuid.uuid4().hex}"
    yield prefix
    stale = keys_under(redis_client, prefix)
    for start in range(0, len(stale), 500):
        redis_client.delete(*stale[start:start + 500])


@pytest.fixture
def storage_url(key_prefix):
    """A fresh, empty store for one test: its own key prefix on the shared server."""
    yield url_with_prefix(BASE_URL, key_prefix)


@pytest.fixture
def storage(storage_url):
    store = RedisStorage(storage_url)
    store.migrate()
    yield store
    store.close()


def new_tasks(count: int, queue: str = "q", prefix: str = "t", **fields) -> list[NewTask]:
    return [NewTask(id=f"{prefix}{i:05d}", queue=queue, handler="h", payload={"n": i}, **fields) for i in range(count)]


def settle_one(storage, claimed, outcome: Outcome, status: TaskStatus, **fields) -> None:
    storage.settle([Settlement(claimed.task.id, claimed.claim_token, outcome, status, **fields)])


def dead_letter_all(storage, queue: str = "q", error_type: str = "Boom") -> list[str]:
    claimed = storage.claim(queue, 1000, 60)
    storage.settle(
        [
            Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo(error_type))
            for c in claimed
        ]
    )
    return [c.task.id for c in claimed]


# -- the compliance kit ---------------------------------------------------------------------------

try:
    from rdq_core.compliance import StorageCompliance
except ImportError:  # the kit is optional for running this file's own tests
    StorageCompliance = None

if StorageCompliance is not None:

    class TestRedisCompliance(StorageCompliance):
        @pytest.fixture
        def storage_url(self, key_prefix):
            yield url_with_prefix(BASE_URL, key_prefix)


# -- URL and key layout -------------------------------------------------------------------------------

def test_open_storage_routes_the_redis_schemes(storage_url, key_prefix):
    store = open_storage(storage_url)
    try:
        assert isinstance(store, RedisStorage) and store.prefix == key_prefix
    finally:
        store.close()


def test_prefix_defaults_to_rdq_and_rejects_hash_tag_characters():
    assert RedisStorage("redis://127.0.0.1:6379/0").prefix == "rdq"
    with pytest.raises(ValueError):
        RedisStorage("redis://127.0.0.1:6379/0?prefix=a{b}")


def test_all_keys_of_a_queue_share_its_hash_tag(storage, redis_client, key_prefix):
    storage.enqueue(new_tasks(2, queue="emails"))
    (c,) = storage.claim("emails", 1, 60)
    settle_one(storage, c, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo("Boom"))
    keys = keys_under(redis_client, key_prefix)
    queue_keys = [k for k in keys if "{emails}" in k]
    global_keys = [k for k in keys if k not in queue_keys]
    assert sorted(queue_keys) == sorted(
        [
            f"{key_prefix}:{{emails}}:due",
            f"{key_prefix}:{{emails}}:dead",
            f"{key_prefix}:{{emails}}:task:t00000",
            f"{key_prefix}:{{emails}}:task:t00001",
            f"{key_prefix}:{{emails}}:attempts:t00000",
        ]
    )
    assert global_keys == [f"{key_prefix}:{{{key_prefix}:global}}:ids", f"{key_prefix}:{{{key_prefix}:global}}:queues"]
    assert {hash_tag(k) for k in queue_keys} == {"emails"}


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes to pick its slot."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1:end] if start >= 0 and end > start + 1 else key


# -- claims -----------------------------------------------------------------------------------------

def test_concurrent_claims_never_return_a_task_twice(storage, storage_url):
    total = 8 * 400
    for start in range(0, total, 500):
        storage.enqueue(new_tasks(min(500, total - start), prefix=f"b{start}-"))
    claimers = 8
    stores = [storage] * 4 + [RedisStorage(storage_url) for _ in range(4)]  # shared and separate clients
    barrier = threading.Barrier(claimers)
    claimed_ids: list[str] = []
    tokens: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claim_until_empty(store):
        barrier.wait()
        try:
            while True:
                batch = store.claim("q", 7, 60)
                if not batch:
                    return
                with lock:
                    claimed_ids.extend(c.task.id for c in batch)
                    tokens.extend(c.claim_token for c in batch)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim_until_empty, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store in stores[4:]:
        store.close()
    assert errors == []
    assert [task_id for task_id, n in Counter(claimed_ids).items() if n > 1] == []
    assert len(claimed_ids) == total
    assert len(set(tokens)) == total
    stats = storage.stats("q")
    assert (stats.pending, stats.in_flight) == (0, total)


def test_claim_uses_the_server_clock_for_due_ness(storage):
    now = storage.now()
    storage.enqueue(
        [
            NewTask(id="past", queue="q", handler="h", run_at=now - timedelta(seconds=5)),
            NewTask(id="future", queue="q", handler="h", run_at=now + timedelta(hours=1)),
        ]
    )
    assert [c.task.id for c in storage.claim("q", 10, 60)] == ["past"]
    assert storage.get("future").next_attempt_at == now + timedelta(hours=1)


# -- fencing ------------------------------------------------------------------------------------------

def test_stale_tokens_change_nothing_on_any_write(storage):
    storage.enqueue(new_tasks(1))
    (first,) = storage.claim("q", 1, 0)
    (expired,) = storage.find_expired_leases(10)
    settle_one(storage, expired, Outcome.LEASE_EXPIRED, TaskStatus.PENDING, error=ErrorInfo("LeaseExpired"))
    (second,) = storage.claim("q", 1, 60)
    before = storage.get("t00000")
    forged = ClaimRef("t00000", "q|forged.1")
    for ref in (first.ref, forged, ClaimRef("t00000", "no-queue-in-it")):
        with pytest.raises(StaleClaim) as refused:
            storage.settle([Settlement(ref.task_id, ref.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
        assert refused.value.task_ids == ("t00000",)
        with pytest.raises(StaleClaim):
            storage.extend_leases([ref], 600)
        with pytest.raises(StaleClaim):
            storage.release([ref])
    assert storage.get("t00000") == before
    settle_one(storage, second, Outcome.SUCCESS, TaskStatus.SUCCEEDED)


def test_batch_settle_applies_valid_items_then_raises_for_the_rest(storage):
    storage.enqueue(new_tasks(3))
    a, b, c = storage.claim("q", 3, 60)
    with pytest.raises(StaleClaim) as refused:
        storage.settle(
            [
                Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                Settlement(b.task.id, "q|wrong.1", Outcome.SUCCESS, TaskStatus.SUCCEEDED),
                Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
            ]
        )
    assert refused.value.task_ids == (b.task.id,)
    assert [storage.get(t.task.id).status for t in (a, b, c)] == [
        TaskStatus.SUCCEEDED, TaskStatus.IN_FLIGHT, TaskStatus.SUCCEEDED,
    ]


def test_lease_expired_is_refused_until_the_lease_is_over_by_server_time(storage):
    storage.enqueue(new_tasks(1))
    (held,) = storage.claim("q", 1, 0.3)
    with pytest.raises(StaleClaim):
        settle_one(storage, held, Outcome.LEASE_EXPIRED, TaskStatus.PENDING)
    task = storage.get("t00000")
    assert task.status is TaskStatus.IN_FLIGHT and task.attempts == () and task.attempt_count == 0
    time.sleep(0.35)
    (expired,) = storage.find_expired_leases(10)
    settle_one(storage, expired, Outcome.LEASE_EXPIRED, TaskStatus.PENDING, error=ErrorInfo("LeaseExpired"))
    assert [a.outcome for a in storage.get("t00000").attempts] == [Outcome.LEASE_EXPIRED]


def test_extend_moves_the_lease_in_the_inflight_zset(storage, redis_client, key_prefix):
    storage.enqueue(new_tasks(1))
    (held,) = storage.claim("q", 1, 0)
    assert len(storage.find_expired_leases(10)) == 1
    extended = storage.extend_leases([held.ref], 60)
    assert storage.find_expired_leases(10) == []
    score = redis_client.zscore(f"{key_prefix}:{{q}}:inflight", "t00000")
    assert score == to_micros(extended["t00000"]) == to_micros(storage.get("t00000").lease_expires_at)


# -- history -------------------------------------------------------------------------------------------

def test_redrive_claim_lease_expiry_numbers_the_attempt_after_all_history(storage):
    storage.enqueue(new_tasks(1, max_attempts=2))
    for status in (TaskStatus.PENDING, TaskStatus.DEAD):
        (c,) = storage.claim("q", 1, 60)
        settle_one(storage, c, Outcome.RETRYABLE_FAILURE, status, error=ErrorInfo("Boom"))
    assert storage.redrive("q", DeadFilter()) == 1
    redriven = storage.get("t00000")
    assert (redriven.status, redriven.attempt_count, redriven.redrive_count, redriven.dead_at) == (
        TaskStatus.PENDING, 0, 1, None,
    )
    (c,) = storage.claim("q", 1, 0)
    (expired,) = storage.find_expired_leases(10, queue="q")
    settle_one(storage, expired, Outcome.LEASE_EXPIRED, TaskStatus.PENDING, error=ErrorInfo("LeaseExpired"))
    task = storage.get("t00000")
    assert [(a.attempt_no, a.outcome) for a in task.attempts] == [
        (1, Outcome.RETRYABLE_FAILURE), (2, Outcome.RETRYABLE_FAILURE), (3, Outcome.LEASE_EXPIRED),
    ]
    assert task.attempt_count == 1
    assert task.attempts[2].started_at == c.claimed_at


def test_attempt_numbers_are_hash_fields_so_they_cannot_repeat(storage, redis_client, key_prefix):
    storage.enqueue(new_tasks(1))
    for _ in range(3):
        (c,) = storage.claim("q", 1, 60)
        settle_one(storage, c, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=ErrorInfo("Boom"))
    assert sorted(redis_client.hkeys(f"{key_prefix}:{{q}}:attempts:t00000"), key=int) == ["1", "2", "3"]


# -- enqueue ---------------------------------------------------------------------------------------------

def test_enqueue_is_idempotent_and_detects_cross_queue_conflicts(storage):
    (first,) = storage.enqueue([NewTask(id="x", queue="q", handler="h", payload={"v": 1})])
    results = storage.enqueue(
        [
            NewTask(id="x", queue="q", handler="h", payload={"v": 2}),
            NewTask(id="x", queue="other", handler="h"),
            NewTask(id="y", queue="q", handler="h"),
            NewTask(id="y", queue="q", handler="h"),
            NewTask(id="y", queue="other", handler="h"),
        ]
    )
    assert first.created
    assert [(r.created, r.conflict) for r in results] == [
        (False, False), (False, True), (True, False), (False, False), (False, True),
    ]
    assert results[0].task == first.task
    assert results[1].task.queue == "q" and results[1].task.payload == {"v": 1}
    assert storage.list_queues() == ["q"]


def test_enqueue_takes_over_an_id_reserved_by_an_enqueue_that_died(storage, redis_client, key_prefix):
    # What an enqueue leaves behind when it dies between reserving the id and creating the task.
    redis_client.hset(f"{key_prefix}:{{{key_prefix}:global}}:ids", "orphan", "elsewhere")
    (result,) = storage.enqueue([NewTask(id="orphan", queue="q", handler="h")])
    assert (result.created, result.conflict, result.task.queue) == (True, False, "q")
    assert storage.get("orphan").queue == "q"


def test_enqueue_rejects_a_callers_connection(storage):
    with pytest.raises(TypeError):
        storage.enqueue(new_tasks(1), connection=object())


# -- round trips ------------------------------------------------------------------------------------------

def test_round_trips_per_batch(storage):
    def trips(action):
        before = storage.round_trips
        value = action()
        return storage.round_trips - before, value

    assert trips(lambda: storage.enqueue(new_tasks(100) + new_tasks(50, queue="other", prefix="o")))[0] == 2
    n, claimed = trips(lambda: storage.claim("q", 100, 60))
    assert (n, len(claimed)) == (1, 100)
    (other,) = storage.claim("other", 1, 60)
    assert trips(lambda: storage.extend_leases([c.ref for c in claimed] + [other.ref], 120))[0] == 1
    assert trips(lambda: storage.release([c.ref for c in claimed[:10]]))[0] == 1
    settlements = [
        Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"i": i})
        if i % 2
        else Settlement(c.task.id, c.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                        retry_delay_seconds=5, error=ErrorInfo("Boom"))
        for i, c in enumerate(claimed[10:])
    ]
    assert trips(lambda: storage.settle(settlements))[0] == 1
    # A batch spanning two queues is still one round trip: a pipeline of one script per queue.
    (a,) = storage.claim("q", 1, 60)
    (b,) = storage.claim("other", 1, 60)
    assert trips(lambda: storage.settle([
        Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
        Settlement(b.task.id, b.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
        Settlement(other.task.id, other.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED),
    ]))[0] == 1
    assert trips(lambda: storage.find_expired_leases(100, queue="q"))[0] == 1
    assert trips(lambda: storage.find_expired_leases(100))[0] == 2  # registry + one pipeline
    assert trips(lambda: storage.stats("q"))[0] == 1
    assert trips(lambda: storage.get("t00011"))[0] == 2  # id index, then the task
    assert trips(lambda: storage.list_dead("q", limit=50))[0] == 1


# -- scripts ----------------------------------------------------------------------------------------------------

def test_scripts_reload_transparently_after_script_flush(storage, redis_client):
    storage.enqueue(new_tasks(4) + new_tasks(2, queue="other", prefix="o"))
    redis_client.script_flush()
    claimed = storage.claim("q", 4, 60)  # single script call: NOSCRIPT, load, resend
    assert len(claimed) == 4
    (other,) = storage.claim("other", 1, 60)
    redis_client.script_flush()
    before = storage.round_trips
    storage.settle(  # a pipeline spanning two queues: both come back NOSCRIPT and are resent
        [Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed + [other]]
    )
    assert storage.round_trips - before == 3  # pipeline, one SCRIPT LOAD, the two calls resent
    assert storage.stats("q").succeeded == 4 and storage.stats("other").succeeded == 1
    redis_client.script_flush()
    enqueued = storage.enqueue(new_tasks(1, prefix="late"))  # both enqueue round trips reload
    assert enqueued[0].created
    assert [a.attempt_no for a in storage.get(claimed[0].task.id).attempts] == [1]


# -- retention and purge leave nothing behind ------------------------------------------------------------------------

def test_purge_and_retention_leave_no_keys(storage, redis_client, key_prefix):
    storage.enqueue(new_tasks(6) + new_tasks(3, queue="other", prefix="o"))
    claimed = storage.claim("q", 4, 60)
    storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=1) for c in claimed])
    storage.cancel("t00004")
    dead_letter_all(storage, "q")
    dead_letter_all(storage, "other")
    assert keys_under(redis_client, key_prefix)
    assert storage.purge_succeeded(3600, 100) == 0
    assert storage.purge_succeeded(0, 3) == 3  # bounded
    assert storage.purge_succeeded(0, 100) == 2  # the last success and the cancelled task
    assert storage.purge_dead("q", DeadFilter(ids=("t00005",))) == 1
    assert storage.list_queues() == ["other"]
    assert storage.purge_dead("other", DeadFilter(error_type="Boom")) == 3
    assert keys_under(redis_client, key_prefix) == []
    assert storage.list_queues() == []
    assert storage.get("t00000") is None
    # The ids are free again, on any queue.
    assert storage.enqueue([NewTask(id="t00000", queue="other", handler="h")])[0].created


# -- DLQ ----------------------------------------------------------------------------------------------------------

def test_dlq_ties_on_dead_at_are_ordered_by_id_and_paged_exactly_once(storage):
    storage.enqueue(new_tasks(25))
    dead_letter_all(storage)  # one settle call: every task gets the same dead_at
    dead_ats = {t.dead_at for t in storage.list_dead("q", limit=100).tasks}
    assert len(dead_ats) == 1
    seen, cursor = [], None
    while True:
        page = storage.list_dead("q", limit=4, cursor=cursor)
        seen.extend(t.id for t in page.tasks)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [f"t{i:05d}" for i in range(25)]


def test_dlq_filters_scan_past_non_matching_entries(storage):
    storage.enqueue(new_tasks(30))
    claimed = storage.claim("q", 30, 60)
    storage.settle([
        Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                   error=ErrorInfo("Rare" if i % 10 == 9 else "Common"))
        for i, c in enumerate(claimed)
    ])
    page = storage.list_dead("q", limit=2, filter=DeadFilter(error_type="Rare"))
    assert [t.id for t in page.tasks] == ["t00009", "t00019"]
    rest = storage.list_dead("q", limit=2, cursor=page.next_cursor, filter=DeadFilter(error_type="Rare"))
    assert [t.id for t in rest.tasks] == ["t00029"] and rest.next_cursor is None
    with pytest.raises(InvalidCursor):
        storage.list_dead("other", limit=2, cursor=page.next_cursor)
    assert storage.redrive("q", DeadFilter(error_type="Rare", handler="h")) == 3
    assert storage.stats("q").dead == 27


# -- operator side ---------------------------------------------------------------------------------------------------

def test_cancel_and_stats(storage):
    storage.enqueue(new_tasks(3) + [NewTask(id="future", queue="q", handler="h", delay_seconds=600)])
    time.sleep(0.2)
    (c,) = storage.claim("q", 1, 60)
    settle_one(storage, c, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
    assert storage.cancel("t00001").status is TaskStatus.CANCELLED
    with pytest.raises(TaskConflict):
        storage.cancel("t00001")
    with pytest.raises(TaskNotFound):
        storage.cancel("missing")
    stats = storage.stats("q")
    assert (stats.pending, stats.in_flight, stats.dead, stats.succeeded, stats.cancelled) == (2, 0, 0, 1, 1)
    assert 0.2 <= stats.oldest_pending_age_seconds < 30


def test_unreachable_server_is_storage_unavailable():
    store = RedisStorage("redis://127.0.0.1:1/0?socket_connect_timeout=1")
    with pytest.raises(StorageUnavailable):
        store.stats("q")
    with pytest.raises(StorageUnavailable):
        store.claim("q", 1, 60)
    store.close()


def test_error_text_and_results_round_trip_verbatim(storage):
    storage.enqueue(new_tasks(2))
    a, b = storage.claim("q", 2, 60)
    error = ErrorInfo('Weird"Type', 'quotes " \\ / and ünïcödé ✓ and a lone \ud800', "line1\nline2")
    storage.settle([
        Settlement(a.task.id, a.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.DEAD, error=error),
        Settlement(b.task.id, b.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"big": 2**60, "f": 0.1}),
    ])
    dead = storage.get(a.task.id)
    # Verbatim except the lone surrogate, which every backend stores as U+FFFD (see the SPI).
    stored = ErrorInfo('Weird"Type', 'quotes " \\ / and ünïcödé ✓ and a lone \ufffd', "line1\nline2")
    assert dead.last_error == stored and dead.attempts[0].error == stored
    assert storage.list_dead("q", limit=5, filter=DeadFilter(error_type='Weird"Type')).tasks[0].id == a.task.id
    assert storage.get(b.task.id).result == {"big": 2**60, "f": 0.1}


def test_an_invalid_item_fails_the_batch_before_anything_is_reserved(storage, redis_client, key_prefix):
    with pytest.raises(ValueError):
        storage.enqueue([NewTask(id="ok", queue="q", handler="h"), NewTask(id="bad", queue="Bad Queue!", handler="h")])
    assert keys_under(redis_client, key_prefix) == []


# -- scripts check everything before their first write ---------------------------------------------

def snapshot(client, prefix: str) -> dict:
    """Every key under the prefix with its full value: to prove a failed script wrote nothing."""
    state = {}
    for key in keys_under(client, prefix):
        kind = client.type(key)
        if kind == "hash":
            state[key] = client.hgetall(key)
        elif kind == "zset":
            state[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            state[key] = sorted(client.smembers(key))
        else:
            state[key] = client.get(key)
    return state


def test_a_settle_script_failing_mid_batch_writes_nothing(storage, redis_client, key_prefix):
    """Redis keeps the writes a script made before it failed. Malformed items sent after valid
    ones, straight to the script, must be refused before the valid ones are applied."""
    from rdq_core.errors import InvalidInput
    from rdq_core.storage.redis import _settle_args

    storage.enqueue(new_tasks(3))
    a, b, c = storage.claim("q", 3, 60)
    valid = [
        *_settle_args(Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result={"ok": 1})),
        *_settle_args(Settlement(b.task.id, b.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                                 retry_delay_seconds=5, error=ErrorInfo("Boom", "x"))),
    ]
    good_c = list(_settle_args(Settlement(c.task.id, c.claim_token, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING,
                                          error=ErrorInfo("Boom", "y"))))
    malformed = {
        "retry delay that is not a number": good_c[:4] + ["soon"] + good_c[5:],
        "unknown outcome": good_c[:2] + ["MAYBE"] + good_c[3:],
        "status a settle cannot set": good_c[:3] + ["IN_FLIGHT"] + good_c[4:],
        "error JSON cut short": good_c[:5] + ['{"type":"Boom","message":"y"'] + good_c[6:],
        "error JSON that is not an object": good_c[:5] + ["[1,2]"] + good_c[6:],
        "item cut short": good_c[:5],
    }
    before = snapshot(redis_client, key_prefix)
    for what, bad in malformed.items():
        with pytest.raises(InvalidInput):
            storage._run(storage._queue_call("settle", "q", *valid, *bad))
        assert snapshot(redis_client, key_prefix) == before, f"{what}: a failed settle script wrote"
    storage.settle([Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert [x.attempt_no for x in storage.get(a.task.id).attempts] == [1]


def test_every_writing_script_refuses_bad_arguments_before_writing(storage, redis_client, key_prefix):
    from rdq_core.errors import InvalidInput
    from rdq_core.storage.redis import _enqueue_args

    storage.enqueue(new_tasks(2))
    a, b = storage.claim("q", 2, 60)
    fresh = [NewTask(id=f"n{i}", queue="q", handler="h", payload={"i": i}) for i in range(3)]
    ok_enqueue = [v for t in fresh[:2] for v in _enqueue_args(t)]
    bad_enqueue = list(_enqueue_args(fresh[2]))
    bad_enqueue[6] = "later"  # delay_us
    pairs = [a.task.id, a.claim_token, b.task.id, b.claim_token]
    calls = {
        "enqueue: bad delay after valid tasks": storage._queue_call("enqueue", "q", "q", *ok_enqueue, *bad_enqueue),
        "enqueue: item cut short": storage._queue_call("enqueue", "q", "q", *ok_enqueue, *bad_enqueue[:3]),
        "extend: lease not a number": storage._queue_call("extend", "q", "forever", *pairs),
        "extend: dangling id": storage._queue_call("extend", "q", 5_000_000, *pairs, "c"),
        "release: dangling id": storage._queue_call("release", "q", *pairs, "c"),
        "claim: limit not a count": storage._queue_call("claim", "q", "all", 60_000_000, "q|x."),
        "dead_apply: unknown action": storage._queue_call("dead_apply", "q", "delete", "", "", 10, "", "", ""),
        "dead_apply: ids not JSON": storage._queue_call("dead_apply", "q", "purge", "", "", 10, "[t0", "", ""),
        "purge_finished: bad cutoff": storage._queue_call("purge_finished", "q", "old", 10),
        "reserve_ids: dangling id": storage._global_call("reserve_ids", "n0", "q", "n1"),
        "take_over_ids: cut short": storage._global_call("take_over_ids", "n0", "q"),
        "unindex: bad flag": storage._global_call("unindex", "q", "maybe", "t00000"),
    }
    before = snapshot(redis_client, key_prefix)
    for what, call in calls.items():
        with pytest.raises(InvalidInput):
            storage._run(call)
        assert snapshot(redis_client, key_prefix) == before, f"{what}: the script wrote before failing"
    assert storage.extend_leases([a.ref, b.ref], 120).keys() == {a.task.id, b.task.id}
    storage.release([a.ref, b.ref])
    assert storage.stats("q").pending == 2


# -- every call is bounded in time --------------------------------------------------------------

def _through(proxy, url: str, **query: str) -> str:
    parts = urlsplit(url)
    merged = dict(parse_qsl(parts.query))
    merged.update(query)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}", query=urlencode(merged)))


def test_a_half_open_connection_raises_storage_unavailable_within_the_socket_timeout(storage_url):
    from tests.backends.stall_proxy import StallingProxy

    upstream = urlsplit(storage_url)
    with StallingProxy(upstream.hostname or "127.0.0.1", upstream.port or 6379) as proxy:
        store = RedisStorage(_through(proxy, storage_url, socket_timeout="0.5"))
        try:
            store.migrate()
            store.enqueue(new_tasks(2))
            (held,) = store.claim("q", 1, 60)
            proxy.stall()  # the pooled connection stays open; nothing answers any more
            for call in (lambda: store.claim("q", 1, 60), lambda: store.extend_leases([held.ref], 60),
                         lambda: store.stats("q")):
                started = time.monotonic()
                with pytest.raises(StorageUnavailable):
                    call()
                assert time.monotonic() - started < 3
        finally:
            proxy.close()
            store.close()
    # Nothing was resent behind our back: the stalled claim never reached the server.
    check = RedisStorage(storage_url)
    assert (check.stats("q").pending, check.stats("q").in_flight) == (1, 1)
    check.close()


def test_a_server_that_never_answers_is_storage_unavailable_and_defaults_are_bounded(storage_url):
    from tests.backends.stall_proxy import StallingProxy

    with StallingProxy("127.0.0.1", 6379, stalled=True) as proxy:
        store = RedisStorage(_through(proxy, storage_url, socket_timeout="0.5", socket_connect_timeout="0.5"))
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            store.claim("q", 1, 60)
        assert time.monotonic() - started < 3
        proxy.close()
        store.close()
    store = RedisStorage(storage_url + "&retry_on_timeout=true")
    try:
        kwargs = store._client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (30, 5)
        assert kwargs["socket_keepalive"] is True and kwargs["health_check_interval"] == 30
        assert "retry_on_timeout" not in kwargs or not kwargs["retry_on_timeout"]
        assert kwargs["retry"].get_retries() == 0  # a script whose reply was lost is never resent
    finally:
        store.close()
