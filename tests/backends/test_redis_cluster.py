"""Redis Cluster: the compliance kit and the chaos tests on a real local cluster (three masters,
one replica each) that this module starts and owns, failovers in the middle of chaos runs, and
exactly what a failover can lose under asynchronous replication -- and what ``wait_replicas``
changes about it.

Every node is a redis-server we started on a loopback port, stopped by PID
(``rdq_testing.servers.OwnedRedisCluster``).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("redis")

from rdq_core.compliance import StorageCompliance
from rdq_testing.chaos.runs import run_chaos
from rdq_testing.servers import (
    OwnedRedisCluster,
    ServerStartError,
    fail_or_skip,
    new_redis_prefix,
    redis_url_with_prefix,
)
from rdq_core.compliance.support import wait_until
from rdq_core.errors import StorageUnavailable
from rdq_core.model import NewTask, Outcome, Settlement, TaskStatus
from rdq_core.storage.redis import RedisStorage
from tests.backends import test_redis  # the module, so its tests are not collected here



def _start_cluster() -> OwnedRedisCluster:
    cluster = OwnedRedisCluster(masters=3)
    try:
        return cluster.start()
    except ServerStartError as exc:
        cluster.destroy()
        fail_or_skip(f"could not start a Redis Cluster: {exc}")
        raise


@pytest.fixture(scope="module")
def cluster() -> Iterator[OwnedRedisCluster]:
    """One cluster for the kit: every test works under a key prefix of its own."""
    owned = _start_cluster()
    yield owned
    owned.destroy()


@pytest.fixture
def own_cluster() -> Iterator[OwnedRedisCluster]:
    """A cluster for one test that fails nodes over or kills them."""
    owned = _start_cluster()
    yield owned
    owned.destroy()


def cluster_url(cluster: OwnedRedisCluster, **options: str) -> str:
    url = redis_url_with_prefix(cluster.url, new_redis_prefix("rdq-cluster"))
    return url + "".join(f"&{name}={value}" for name, value in options.items())


class TestRedisClusterCompliance(StorageCompliance):
    """The whole kit through ``RedisCluster``: the same budgets as on one Redis (a pipeline split
    across nodes is still sent at once: one round trip)."""

    capabilities = replace(test_redis.TestRedisCompliance.capabilities,
                           unreachable_url="redis://127.0.0.1:{port}/0?cluster=true&socket_connect_timeout=1")

    @pytest.fixture
    def storage_url(self, cluster):
        yield cluster_url(cluster)


def test_every_queue_lives_in_one_slot_and_queues_spread_over_the_masters(cluster):
    store = RedisStorage(cluster_url(cluster))
    store.migrate()
    try:
        queues = [f"q{i}" for i in range(12)]
        store.enqueue([NewTask(id=f"t-{q}", queue=q, handler="h", payload=None) for q in queues])
        served_by = {q: cluster.serving(f"{store.prefix}:{{{q}}}:due").port for q in queues}
        assert len(set(served_by.values())) == 3, served_by  # a multi-queue batch really spans nodes
        claimed = [c for q in queues for c in store.claim(q, 10, 30)]
        assert sorted(c.task.id for c in claimed) == sorted(f"t-{q}" for q in queues)
        before = store.round_trips
        store.settle([Settlement(c.task.id, c.claim_token, Outcome.SUCCESS, TaskStatus.SUCCEEDED) for c in claimed])
        assert store.round_trips - before == 1  # twelve scripts on three nodes: one pipeline
        assert {q: store.stats(q).succeeded for q in queues} == {q: 1 for q in queues}
    finally:
        store.close()


def _answers(store: RedisStorage) -> bool:
    try:
        store.stats("chaos")
    except StorageUnavailable:  # the first call after a master died: the client refreshes its map
        return False
    return True


def _failover_midway(cluster: OwnedRedisCluster, store: RedisStorage, act: str, done: threading.Event,
                     errors: list[BaseException]) -> None:
    """Once the chaos run's queue is being worked, fail over the master serving it; then wait
    until the run's own store (the audit's) has found the new master."""
    prefix = store.prefix
    import redis

    probe = redis.RedisCluster.from_url(cluster.url, decode_responses=True)
    key = f"{prefix}:{{chaos}}:succeeded"
    try:
        wait_until(lambda: probe.zcard(key) >= 40, timeout=120, interval=0.05, what="40 chaos tasks to succeed")
        master = cluster.serving(key)
        # The killed node rejoins as the new master's replica, as a replaced node would.
        cluster.failover(master) if act == "failover" else cluster.kill_master(master, rejoin=True)
        wait_until(lambda: _answers(store), timeout=30, interval=0.1, what="the store to reach the new master")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
    finally:
        probe.close()
        done.set()


@pytest.mark.chaos
@pytest.mark.parametrize("act", ["failover", "kill-master"])
def test_chaos_with_the_queues_master_failed_over_midway(own_cluster, tmp_path: Path, act: str):
    """Workers killed with ``kill -9`` while the master holding the queue is replaced: by
    ``CLUSTER FAILOVER`` on its replica (the replica catches up first: nothing is lost), or by
    ``kill -9`` of the master (its replica takes over after the node timeout; the killed node then
    rejoins as a replica). The full history audit holds across both. Across the kill that means
    no acknowledged write was lost in this run: on loopback the replica trails the master by far
    less than a millisecond. What a kill can lose is shown deterministically below."""
    url = cluster_url(own_cluster)
    store = RedisStorage(url)
    store.migrate()
    done, errors = threading.Event(), []
    actor = threading.Thread(target=_failover_midway, args=(own_cluster, store, act, done, errors), daemon=True)
    actor.start()
    try:
        # The lease outlasts the outage (failure detection after the 1 s node timeout, then the
        # election: about 2-3 s here), so no live holder's lease lapses while it cannot renew.
        figures = run_chaos(store, url, tmp_path, workers=4, tasks=300, kills=10, lease_seconds=10.0)
    finally:
        actor.join(60)
        store.close()
    assert done.is_set() and not errors, errors
    print(f"\nchaos across a {act}: {figures}")


def test_a_killed_master_loses_what_its_replica_had_not_received_unless_wait_replicas(own_cluster):
    """Asynchronous replication, made deterministic: the replica is stopped (SIGSTOP) and its link
    cut, an enqueue is acknowledged by the master alone, the master is killed and the replica takes over. The
    acknowledged task is gone. The same enqueue through ``wait_replicas=1`` is not acknowledged:
    it raises ``StorageUnavailable`` (the caller knows it may be lost) instead of succeeding."""
    plain = RedisStorage(cluster_url(own_cluster))
    durable = RedisStorage(cluster_url(own_cluster, wait_replicas="1", wait_timeout_ms="300"))
    durable.prefix = plain.prefix  # one store, two ways of writing to it
    durable._global_keys, durable._audit_base, durable._docs_base, durable._paused_registry = (
        plain._global_keys, plain._audit_base, plain._docs_base, plain._paused_registry)
    plain.migrate()

    def task(name: str) -> NewTask:
        return NewTask(id=name, queue="orders", handler="h", payload={"n": name})

    try:
        durable.enqueue([task("replicated")])  # confirmed by the replica
        master = own_cluster.serving(f"{plain.prefix}:{{orders}}:due")
        replica = own_cluster.replica_of(master)
        assert replica.process is not None
        # Cut the replication link and keep it cut: stop the replica (our own child), then have
        # the master drop its connection (a stopped replica would still find whatever the master
        # sent meanwhile in its socket buffer when it resumes).
        os.kill(replica.process.pid, signal.SIGSTOP)
        master_client = master.client()
        try:
            master_client.execute_command("CLIENT", "KILL", "TYPE", "replica")
        finally:
            master_client.close()
        try:
            plain.enqueue([task("acknowledged-then-lost")])  # the master alone has it
            with pytest.raises(StorageUnavailable, match="replica"):
                durable.enqueue([task("never-acknowledged")])
            assert plain.get("acknowledged-then-lost") is not None
        finally:
            master.crash()
            os.kill(replica.process.pid, signal.SIGCONT)
        wait_until(lambda: replica.role() == "master" and own_cluster.healthy(), timeout=30, interval=0.05,
                   what="the replica to take over")
        wait_until(lambda: _answers(plain), timeout=30, interval=0.1, what="the store to reach the new master")
        assert plain.get("replicated") is not None
        assert plain.get("acknowledged-then-lost") is None  # acknowledged, and lost with the master
        assert plain.get("never-acknowledged") is None
    finally:
        plain.close()
        durable.close()


def test_wait_replicas_is_checked_in_the_url():
    from rdq_core.errors import ConfigurationError

    for bad in ("wait_replicas=x", "wait_replicas=-1", "wait_timeout_ms=0"):
        with pytest.raises(ConfigurationError):
            RedisStorage(f"redis://127.0.0.1:6379/0?{bad}")


def test_wait_replicas_on_a_redis_without_replicas_never_confirms_a_write(fresh_redis_url):
    """On one Redis (no Cluster) each script and its WAIT share a pipeline too, single calls
    included: with no replica to confirm, every script raises ``StorageUnavailable`` (a write
    ran, unconfirmed), and the round trips stay those without ``wait_replicas``."""
    durable = RedisStorage(fresh_redis_url + "&wait_replicas=1&wait_timeout_ms=50")
    try:
        durable.migrate()
        with pytest.raises(StorageUnavailable, match="0 of 1 replica"):
            durable.enqueue([NewTask(id="w1", queue="q", handler="h", payload=None)])
        plain = RedisStorage(fresh_redis_url)
        try:
            # The first step (the id reservation) ran unconfirmed and the enqueue stopped there: no
            # task; a later enqueue of the id creates it, as after any enqueue that died half way.
            assert plain.get("w1") is None
            assert plain.enqueue([NewTask(id="w1", queue="q", handler="h", payload=None)])[0].created
        finally:
            plain.close()
        before = durable.round_trips
        with pytest.raises(StorageUnavailable, match="0 of 1 replica"):
            durable.claim("q", 1, 30)  # a single script: its WAIT rides in the same round trip
        assert durable.round_trips - before == 1
    finally:
        durable.close()
