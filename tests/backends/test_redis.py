"""Redis backend: what is about Redis itself -- URL options, key layout and hash tags, the Lua
scripts (reloading, checking every argument before writing), multi-queue batches, leaving no
keys behind -- plus the compliance kit, which holds every promise all backends share.

Needs a Redis server (``RDQ_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``). The server
may be shared: every test works under its own key prefix and deletes exactly the keys under that
prefix afterwards (``tests/conftest.py``). Nothing here flushes a database.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

redis = pytest.importorskip("redis")

from rdq_core.compliance import Capabilities, StorageCompliance  # noqa: E402 - after importorskip
from rdq_core.errors import StaleClaim, StorageUnavailable  # noqa: E402 - after importorskip
from rdq_core.model import ClaimRef, DeadFilter, DedupeMode, ErrorInfo, NewTask, Outcome, Settlement, TaskStatus  # noqa: E402 - see above
from rdq_core.storage import open_storage  # noqa: E402 - after importorskip
from rdq_core.storage.redis import RedisStorage  # noqa: E402 - after importorskip
from rdq_core.storage.spi import to_micros  # noqa: E402 - after importorskip


def keys_under(client, prefix: str) -> list[str]:
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))


@pytest.fixture
def storage_url(fresh_redis_url):
    """A fresh, empty store for one test: its own key prefix on the shared server."""
    yield fresh_redis_url


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


class TestRedisCompliance(StorageCompliance):
    # enqueue: reserve the ids globally, then create the tasks per queue; get: the id index, then the task;
    # stats: the counts script, then the paused queues (their registry, and when it lists any, their flags).
    capabilities = Capabilities(
        round_trips={"enqueue": 2, "claim": 1, "extend": 1, "release": 1, "settle": 1, "find_expired": 1,
                     "get": 2, "list_dead": 1, "stats": 3, "redrive": 1},
        unreachable_url="redis://127.0.0.1:{port}/0?socket_connect_timeout=1",
    )

    @pytest.fixture
    def storage_url(self, fresh_redis_url):
        yield fresh_redis_url


# -- URL and key layout -----------------------------------------------------------------------

def test_open_storage_routes_the_redis_schemes(storage_url, redis_prefix):
    store = open_storage(storage_url)
    try:
        assert isinstance(store, RedisStorage) and store.prefix == redis_prefix
    finally:
        store.close()


def test_prefix_defaults_to_rdq_and_rejects_hash_tag_characters():
    assert RedisStorage("redis://127.0.0.1:6379/0").prefix == "rdq"
    with pytest.raises(ValueError):
        RedisStorage("redis://127.0.0.1:6379/0?prefix=a{b}")


def test_all_keys_of_a_queue_share_its_hash_tag(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(2, queue="emails"))
    (c,) = storage.claim("emails", 1, 60)
    settle_one(storage, c, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD, error=ErrorInfo("Boom"))
    keys = keys_under(redis_client, redis_prefix)
    queue_keys = [k for k in keys if "{emails}" in k]
    global_keys = [k for k in keys if k not in queue_keys]
    assert sorted(queue_keys) == sorted(
        [
            f"{redis_prefix}:{{emails}}:due",
            f"{redis_prefix}:{{emails}}:lane:0:",  # the claim lane of priority 0, no group
            f"{redis_prefix}:{{emails}}:lanes",
            f"{redis_prefix}:{{emails}}:dead",
            f"{redis_prefix}:{{emails}}:task:t00000",
            f"{redis_prefix}:{{emails}}:task:t00001",
            f"{redis_prefix}:{{emails}}:attempts:t00000",
        ]
    )
    assert global_keys == [f"{redis_prefix}:{{{redis_prefix}:global}}:ids", f"{redis_prefix}:{{{redis_prefix}:global}}:queues"]
    assert {hash_tag(k) for k in queue_keys} == {"emails"}


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes to pick its slot."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1:end] if start >= 0 and end > start + 1 else key


# -- claim tokens carry their queue -----------------------------------------------------------

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


def test_extend_moves_the_lease_in_the_inflight_zset(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(1))
    (held,) = storage.claim("q", 1, 0)
    assert len(storage.find_expired_leases(10)) == 1
    extended = storage.extend_leases([held.ref], 60)
    assert storage.find_expired_leases(10) == []
    score = redis_client.zscore(f"{redis_prefix}:{{q}}:inflight", "t00000")
    assert score == to_micros(extended["t00000"]) == to_micros(storage.get("t00000").lease_expires_at)


# -- history ----------------------------------------------------------------------------------

def test_attempt_numbers_are_hash_fields_so_they_cannot_repeat(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(1))
    for _ in range(3):
        (c,) = storage.claim("q", 1, 60)
        settle_one(storage, c, Outcome.RETRYABLE_FAILURE, TaskStatus.PENDING, error=ErrorInfo("Boom"))
    assert sorted(redis_client.hkeys(f"{redis_prefix}:{{q}}:attempts:t00000"), key=int) == ["1", "2", "3"]


# -- enqueue ----------------------------------------------------------------------------------

def test_enqueue_takes_over_an_id_reserved_by_an_enqueue_that_died(storage, redis_client, redis_prefix):
    # What an enqueue leaves behind when it dies between reserving the id and creating the task.
    redis_client.hset(f"{redis_prefix}:{{{redis_prefix}:global}}:ids", "orphan", "elsewhere")
    (result,) = storage.enqueue([NewTask(id="orphan", queue="q", handler="h")])
    assert (result.created, result.conflict, result.task.queue) == (True, False, "q")
    assert storage.get("orphan").queue == "q"


# -- round trips ------------------------------------------------------------------------------

def test_a_batch_spanning_queues_costs_one_round_trip_per_step(storage):
    """The kit measures one queue; a batch over several queues is a pipeline of one script per
    queue, so it still costs what one queue does (and the scan of every queue one more)."""
    def trips(action):
        before = storage.round_trips
        value = action()
        return storage.round_trips - before, value

    assert trips(lambda: storage.enqueue(new_tasks(100) + new_tasks(50, queue="other", prefix="o")))[0] == 2
    claimed = storage.claim("q", 100, 60)
    (other,) = storage.claim("other", 1, 60)
    assert trips(lambda: storage.extend_leases([c.ref for c in claimed] + [other.ref], 120))[0] == 1
    assert trips(lambda: storage.release([c.ref for c in claimed[:10]] + [other.ref]))[0] == 1
    (other,) = storage.claim("other", 1, 60)
    assert trips(lambda: storage.settle([
        Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed[10:] + [other]
    ]))[0] == 1
    assert trips(lambda: storage.find_expired_leases(100))[0] == 2  # the queue registry + one pipeline


# -- scripts ----------------------------------------------------------------------------------

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


# -- retention and purge leave nothing behind -------------------------------------------------

def test_purge_and_retention_leave_no_keys(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(6) + new_tasks(3, queue="other", prefix="o"))
    claimed = storage.claim("q", 4, 60)
    storage.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED, result=1) for c in claimed])
    storage.cancel("t00004")
    dead_letter_all(storage, "q")
    dead_letter_all(storage, "other")
    assert keys_under(redis_client, redis_prefix)
    assert storage.purge_succeeded(3600, 100) == 0
    assert storage.purge_succeeded(0, 3) == 3  # bounded
    assert storage.purge_succeeded(0, 100) == 2  # the last success and the cancelled task
    assert storage.purge_dead("q", DeadFilter(ids=("t00005",))) == 1
    assert storage.list_queues() == ["other"]
    assert storage.purge_dead("other", DeadFilter(error_type="Boom")) == 3
    assert keys_under(redis_client, redis_prefix) == []
    assert storage.list_queues() == []
    assert storage.get("t00000") is None
    # The ids are free again, on any queue.
    assert storage.enqueue([NewTask(id="t00000", queue="other", handler="h")])[0].created


def test_an_invalid_item_fails_the_batch_before_anything_is_reserved(storage, redis_client, redis_prefix):
    with pytest.raises(ValueError):
        storage.enqueue([NewTask(id="ok", queue="q", handler="h"), NewTask(id="bad", queue="Bad Queue!", handler="h")])
    assert keys_under(redis_client, redis_prefix) == []


# -- scripts check everything before their first write ----------------------------------------

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


def test_a_settle_script_failing_mid_batch_writes_nothing(storage, redis_client, redis_prefix):
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
    before = snapshot(redis_client, redis_prefix)
    for what, bad in malformed.items():
        with pytest.raises(InvalidInput):
            storage._run(storage._queue_call("settle", "q", *valid, *bad))
        assert snapshot(redis_client, redis_prefix) == before, f"{what}: a failed settle script wrote"
    storage.settle([Settlement(a.task.id, a.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED)])
    assert [x.attempt_no for x in storage.get(a.task.id).attempts] == [1]


def test_every_writing_script_refuses_bad_arguments_before_writing(storage, redis_client, redis_prefix):
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
        "apply: unknown action": storage._queue_call("apply", "q", "delete", "", "", 10, "", "", ""),
        "apply: ids not JSON": storage._queue_call("apply", "q", "purge", "", "", 10, "[t0", "", ""),
        "apply: cancel after a cursor that is no number": storage._queue_call("apply", "q", "cancel", "x", "", 9, "", "", ""),
        "audit_append: count not a count": storage._audit_call("audit_append", storage._audit_keys("q"), "e1", "me",
                                                               "cancel", "q", "{}", "many"),
        "purge_finished: bad cutoff": storage._queue_call("purge_finished", "q", "old", 10),
        "reserve_ids: dangling id": storage._global_call("reserve_ids", "n0", "q", "n1"),
        "take_over_ids: cut short": storage._global_call("take_over_ids", "n0", "q"),
        "unindex: bad flag": storage._global_call("unindex", "q", "maybe", "t00000"),
    }
    before = snapshot(redis_client, redis_prefix)
    for what, call in calls.items():
        with pytest.raises(InvalidInput):
            storage._run(call)
        assert snapshot(redis_client, redis_prefix) == before, f"{what}: the script wrote before failing"
    assert storage.extend_leases([a.ref, b.ref], 120).keys() == {a.task.id, b.task.id}
    storage.release([a.ref, b.ref])
    assert storage.stats("q").pending == 2


# -- listings, bulk cancel, pausing, the audit trail -----------------------------------------

def trips(storage, action):
    before = storage.round_trips
    value = action()
    return storage.round_trips - before, value


def test_a_listing_enters_a_batch_of_equal_instants_at_its_position(storage, redis_client, redis_prefix):
    """One enqueue batch shares its next_attempt_at: the due zset orders it by id bytes alone, and
    a page starts at its cursor's place (even when that task has left) in one script call."""
    ids = [f"t{i:05d}" for i in range(300)]
    storage.enqueue([NewTask(id=i, queue="q", handler="h") for i in reversed(ids)])
    assert len({redis_client.zscore(f"{redis_prefix}:{{q}}:due", i) for i in ids}) == 1
    cost, first = trips(storage, lambda: storage.list_tasks("q", status=TaskStatus.PENDING, limit=250))
    assert cost == 1 and [t.id for t in first.tasks] == ids[:250]
    storage.cancel(ids[249])  # the cursor's own task leaves the zset: its position is found by bisection
    cost, rest = trips(storage, lambda: storage.list_tasks("q", status=TaskStatus.PENDING, limit=10,
                                                           cursor=first.next_cursor))
    assert cost == 1 and [t.id for t in rest.tasks] == ids[250:260]


def test_bulk_cancel_walks_a_large_queue_in_bounded_atomic_steps(storage):
    from rdq_core.model import TaskFilter
    from rdq_core.storage.redis.backend import _SCAN_BUDGET

    total = 2 * _SCAN_BUDGET + 500
    for start in range(0, total, 1000):
        storage.enqueue(new_tasks(min(1000, total - start), prefix=f"b{start}-"))
    (held,) = storage.claim("q", 1, 60)
    cost, cancelled = trips(storage, lambda: storage.cancel_selected("q", TaskFilter()))
    assert cancelled == total - 1 and cost == 3  # one script per _SCAN_BUDGET due entries
    stats = storage.stats("q")
    assert (stats.pending, stats.in_flight, stats.cancelled) == (0, 1, total - 1)
    assert storage.get(held.task.id).status is TaskStatus.IN_FLIGHT


def test_bulk_cancel_racing_claims_never_cancels_a_claimed_task(storage_url):
    import threading

    from rdq_core.model import TaskFilter

    stores = [RedisStorage(storage_url) for _ in range(2)]
    try:
        stores[0].enqueue(new_tasks(1000) + new_tasks(1000, prefix="u"))
        claimed: list[str] = []
        done = threading.Event()

        def claimer():
            while not done.is_set():
                got = stores[1].claim("q", 20, 60)
                claimed.extend(c.task.id for c in got)
                if not got:
                    break

        worker = threading.Thread(target=claimer)
        worker.start()
        try:
            cancelled = stores[0].cancel_selected("q", TaskFilter())
        finally:
            done.set()
            worker.join(30)
        assert not worker.is_alive()
        assert cancelled + len(claimed) + stores[0].stats("q").pending == 2000
        assert all(stores[0].get(i).status is TaskStatus.IN_FLIGHT for i in claimed)
    finally:
        for store in stores:
            store.close()


def test_the_pause_flag_lives_in_the_queues_slot_and_claim_still_costs_one_round_trip(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(2, queue="emails"))
    storage.set_paused("emails", True)
    flag = f"{redis_prefix}:{{emails}}:paused"
    registry = f"{redis_prefix}:{{{redis_prefix}:global}}:paused"
    assert redis_client.exists(flag) and hash_tag(flag) == "emails"
    assert redis_client.smembers(registry) == {"emails"}
    assert trips(storage, lambda: storage.claim("emails", 10, 60)) == (1, [])
    storage.set_paused("emails", False)
    assert not redis_client.exists(flag) and not redis_client.exists(registry)
    cost, claimed = trips(storage, lambda: storage.claim("emails", 10, 60))
    assert cost == 1 and len(claimed) == 2


def test_a_registered_queue_whose_flag_is_gone_is_not_listed_as_paused(storage, redis_client, redis_prefix):
    """What a pause that failed after registering leaves behind: claims run, so it is not paused."""
    redis_client.sadd(f"{redis_prefix}:{{{redis_prefix}:global}}:paused", "ghost")
    storage.set_paused("real", True)
    assert storage.paused_queues() == {"real"}
    storage.enqueue(new_tasks(1, queue="ghost"))
    assert len(storage.claim("ghost", 1, 60)) == 1


def test_the_audit_trail_has_a_slot_of_its_own(storage, redis_client, redis_prefix):
    a = storage.record_audit(actor="local", action="cancel", queue="a", selection={"handler": "h"}, count=2)
    b = storage.record_audit(actor="local", action="purge", queue="b", selection={}, count=0)
    tag = f"{redis_prefix}:audit"
    base = f"{redis_prefix}:{{{tag}}}:"
    assert keys_under(redis_client, redis_prefix) == sorted(
        [base + "all", base + "queue:a", base + "queue:b", base + "entry:" + a.id, base + "entry:" + b.id]
    )
    assert redis_client.zscore(base + "all", a.id) == to_micros(a.at) == redis_client.zscore(base + "queue:a", a.id)
    cost, page = trips(storage, lambda: storage.list_audit(queue="a", limit=10))
    assert cost == 1 and page.entries == (a,)


def test_engine_documents_have_a_slot_of_their_own_and_cost_one_round_trip_each(storage, redis_client, redis_prefix):
    base = f"{redis_prefix}:{{{redis_prefix}:docs}}:"
    cost, first = trips(storage, lambda: storage.put_document("locks", "q:a", {"n": 1}, expected_version=None))
    assert cost == 1 and first is not None and first.version == 1
    storage.put_document("locks", "q:b", {"n": 2}, expected_version=None)
    storage.put_document("ops", "x", {}, expected_version=None)
    assert keys_under(redis_client, redis_prefix) == sorted(
        [base + "kind:locks", base + "keys:locks", base + "kind:ops", base + "keys:ops"]
    )
    assert {hash_tag(k) for k in keys_under(redis_client, redis_prefix)} == {f"{redis_prefix}:docs"}
    assert redis_client.hget(base + "kind:locks", "q:a") == '1:{"n":1}'
    assert redis_client.zrange(base + "keys:locks", 0, -1, withscores=True) == [("q:a", 0.0), ("q:b", 0.0)]
    for call in (lambda: storage.get_document("locks", "q:a"),
                 lambda: storage.put_document("locks", "q:a", {"n": 3}, expected_version=1),
                 lambda: storage.list_documents("locks", limit=10, after="q:a"),
                 lambda: storage.delete_document("locks", "q:b", expected_version=1)):
        assert trips(storage, call)[0] == 1
    assert storage.delete_document("locks", "q:a", expected_version=2)
    storage.delete_document("ops", "x", expected_version=1)
    assert keys_under(redis_client, redis_prefix) == [], "the last document of a kind takes its keys with it"


# -- every call is bounded in time ------------------------------------------------------------

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


# -- flow control: claim lanes and limits in the claim script ----------------------------------

def test_migrate_puts_pending_tasks_from_before_the_lanes_into_their_lanes(storage, redis_client, redis_prefix):
    storage.enqueue(new_tasks(3) + new_tasks(2, prefix="p", priority=4))
    # What a store written by an rdq without lanes holds: the tasks in `due` only.
    redis_client.delete(*[k for k in keys_under(redis_client, redis_prefix) if ":lane" in k])
    assert storage.claim("q", 10, 60) == []
    storage.migrate()
    storage.migrate()  # idempotent
    assert [c.task.id for c in storage.claim("q", 10, 60)] == ["t00000", "t00001", "t00002", "p00000", "p00001"]


def test_a_claim_lane_empties_with_its_tasks_and_limits_leave_no_stray_keys(storage, redis_client, redis_prefix):
    from rdq_core.flow import FlowPolicy, RateLimit

    storage.enqueue(new_tasks(2, priority=3, group="tenant-a", concurrency_key="k"))
    flow = FlowPolicy(concurrency_limit=1, rate_limit=RateLimit(5, 60))
    (first,) = storage.claim("q", 10, 60, flow)  # the key's limit holds the second back: parked behind it
    assert redis_client.zcard(f"{redis_prefix}:{{q}}:lane:3:tenant-a") == 0
    assert redis_client.zcard(f"{redis_prefix}:{{q}}:park:c k 3:tenant-a") == 1
    assert redis_client.smembers(f"{redis_prefix}:{{q}}:parks") == {"c k 3:tenant-a"}
    assert storage.claim("q", 10, 60, flow) == [], "the park is passed over while its key is full"
    settle_one(storage, first, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
    (second,) = storage.claim("q", 10, 60, flow)
    settle_one(storage, second, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
    leftover = [k for k in keys_under(redis_client, redis_prefix) if ":lane" in k or ":conc:" in k or ":park" in k]
    assert leftover == []
    assert redis_client.pttl(f"{redis_prefix}:{{q}}:rate:k") == -2  # no rate key: the tasks had none


# -- parking: tasks held back by a full key leave the lane until the key has room ---------------

def _park_sizes(redis_client, redis_prefix) -> dict[str, int]:
    parks = redis_client.smembers(f"{redis_prefix}:{{q}}:parks")
    return {park: redis_client.zcard(f"{redis_prefix}:{{q}}:park:{park}") for park in parks}


def test_a_full_keys_backlog_is_parked_once_and_comes_back_in_order(storage, redis_client, redis_prefix):
    from rdq_core.flow import FlowPolicy

    flow = FlowPolicy(concurrency_limit=1)
    storage.enqueue(new_tasks(300, concurrency_key="hot"))
    (first,) = storage.claim("q", 10, 60, flow)
    assert first.task.id == "t00000"
    assert _park_sizes(redis_client, redis_prefix) == {"c hot 0:": 299}
    storage.enqueue([NewTask(id="late", queue="q", handler="h", concurrency_key="hot")])  # lane, after the park
    storage.enqueue(new_tasks(2, prefix="free"))
    assert sorted(c.task.id for c in storage.claim("q", 10, 60, flow)) == ["free00000", "free00001"]
    order = []
    previous = first
    for _ in range(4):
        settle_one(storage, previous, Outcome.SUCCESS, TaskStatus.SUCCEEDED)
        (previous,) = storage.claim("q", 10, 60, flow)
        order.append(previous.task.id)
    assert order == ["t00001", "t00002", "t00003", "t00004"], "a key's tasks keep their order through the park"


def test_a_parked_task_can_be_cancelled_rescored_and_claimed_without_the_policy(storage, redis_client, redis_prefix):
    from rdq_core.flow import FlowPolicy

    flow = FlowPolicy(concurrency_limit=1)
    storage.enqueue(new_tasks(3, concurrency_key="k")
                    + [NewTask(id="t00003", queue="q", handler="h", concurrency_key="k", dedupe_key="d")])
    storage.claim("q", 10, 60, flow)
    assert _park_sizes(redis_client, redis_prefix) == {"c k 0:": 3}
    storage.cancel("t00001")
    assert _park_sizes(redis_client, redis_prefix) == {"c k 0:": 2}
    # A debounced enqueue re-scores its match: back in its lane, out of the park, never in both.
    storage.enqueue([NewTask(id="again", queue="q", handler="h", concurrency_key="k", dedupe_key="d",
                             dedupe_mode=DedupeMode.DEBOUNCE)])
    assert _park_sizes(redis_client, redis_prefix) == {"c k 0:": 1}
    assert redis_client.zrange(f"{redis_prefix}:{{q}}:lane:0:", 0, -1) == ["t00003"]
    assert [c.task.id for c in storage.claim("q", 10, 60)] == ["t00002", "t00003"], "no policy: parks are read too"
    assert _park_sizes(redis_client, redis_prefix) == {}
    assert storage.stats("q").pending == 0


def test_a_rate_parked_task_comes_back_when_the_window_has_room(storage, redis_client, redis_prefix):
    from rdq_core.flow import FlowPolicy, RateLimit

    flow = FlowPolicy(rate_limit=RateLimit(1, 0.3))
    storage.enqueue(new_tasks(3, rate_key="r"))
    assert [c.task.id for c in storage.claim("q", 10, 60, flow)] == ["t00000"]
    assert _park_sizes(redis_client, redis_prefix) == {"r r 0:": 2}
    assert storage.claim("q", 10, 60, flow) == []
    deadline = time.monotonic() + 5
    while not (claimed := storage.claim("q", 10, 60, flow)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert [c.task.id for c in claimed] == ["t00001"]
