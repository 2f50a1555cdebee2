"""Redis for tests: the shared server (``RDQ_TEST_REDIS_URL``), worked in under a key prefix of
our own and never flushed; a redis-server or a whole Redis Cluster run as our child processes."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from contextlib import contextmanager
from typing import Any, ContextManager, Iterator, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..conditions import wait_until
from .processes import OwnedProcessServer, ServerStartError, free_loopback_port, running

SHARED_REDIS_URL = os.environ.get("RDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_served_pid(port: int) -> int | None:
    """The PID the Redis server on ``port`` reports (``INFO server``), or None."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.25, socket_timeout=1)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()



class OwnedRedis(OwnedProcessServer):
    """redis-server with an append-only file fsynced on every write: without persistence a
    restarted Redis is empty, and "no task lost" would test nothing but that."""

    what = "redis-server"

    def __init__(self, prefix: str = "rdq-owned-redis-") -> None:
        super().__init__(prefix)

    def argv(self, port: int) -> list[str]:
        return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
                "--pidfile", str(self.workdir / "redis.pid")]

    def served_pid(self, port: int) -> int | None:
        return redis_served_pid(port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class OwnedClusterNode(OwnedRedis):
    """One node of an ``OwnedRedisCluster``: cluster mode, its own ``nodes.conf``, and a cluster
    bus port chosen here (Redis' default, port + 10000, may not exist above port 55535)."""

    what = "redis-server (cluster node)"

    def __init__(self, node_timeout_ms: int) -> None:
        super().__init__(prefix="rdq-owned-cluster-node-")
        self.bus_port = free_loopback_port()
        self.node_timeout_ms = node_timeout_ms

    def argv(self, port: int) -> list[str]:
        # No persistence: a failover, not a restart, is what these nodes are for. Replicas that
        # lost their master take over after node_timeout_ms (the default is 15 s).
        return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-port", str(self.bus_port), "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica may take over however long its link was down (a test stops one).
                "--cluster-replica-validity-factor", "0",
                "--dir", str(self.workdir), "--pidfile", str(self.workdir / "redis.pid")]

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_connect_timeout=1,
                           socket_timeout=5)

    def role(self) -> str | None:
        """``master`` or ``slave`` as the node itself says, None when it does not answer."""
        import redis

        client = self.client()
        try:
            return str(client.info("replication")["role"])
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class OwnedRedisCluster:
    """A Redis Cluster of ``masters`` masters with one replica each, every node a redis-server we
    started (loopback ports, own directories, stopped by PID), joined with
    ``redis-cli --cluster create``. ``failover`` promotes a replica with ``CLUSTER FAILOVER`` (the
    replica first catches up: nothing acknowledged is lost); ``kill_master`` is ``kill -9`` of a
    master, after which its replica takes over on its own."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise ServerStartError("redis-server and redis-cli are needed for a Redis Cluster")
        self.nodes = [OwnedClusterNode(node_timeout_ms) for _ in range(2 * masters)]
        self.masters = masters

    def start(self) -> Self:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1",
                                  "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise ServerStartError(f"redis-cli --cluster create failed: {created.stdout[-1500:]} {created.stderr[-500:]}")
        wait_until(self.healthy, timeout=30, interval=0.1, what="the owned Redis Cluster to be ready")
        return self

    @property
    def url(self) -> str:
        """The first live node, and every node as a start-up node: a client started after a
        master was killed still finds the cluster."""
        live = next(node for node in self.nodes if node.alive())
        nodes = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis://127.0.0.1:{live.port}/0?cluster=true&nodes={nodes}"

    def node_on(self, port: int) -> OwnedClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def _cluster_nodes(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as a live node sees it: id, port, flags, master id, slots."""
        for node in self.nodes:
            if not node.alive():
                continue
            client = node.client()
            try:
                parsed = client.execute_command("CLUSTER NODES")
            except Exception:  # noqa: BLE001 - ask the next live node
                continue
            finally:
                client.close()
            rows = []
            for address, row in parsed.items():  # redis-py parses CLUSTER NODES into a dict
                rows.append({"id": row["node_id"], "port": int(address.split("@")[0].rsplit(":", 1)[1]),
                             "flags": row["flags"].split(","), "master": row["master_id"],
                             "slots": [(int(span[0]), int(span[-1])) for span in row["slots"]]})
            return rows
        return []

    def healthy(self) -> bool:
        """Every live node says the cluster is ok and every live replica's link to its master is up."""
        for node in self.nodes:
            if not node.alive():
                continue
            client = node.client()
            try:
                if client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
                replication = client.info("replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False
            except Exception:  # noqa: BLE001 - not ready yet
                return False
            finally:
                client.close()
        return True

    def serving(self, key: str) -> OwnedClusterNode:
        """The master serving ``key``'s slot now."""
        client = self.node_on(next(n.port for n in self.nodes if n.alive())).client()
        try:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
        finally:
            client.close()
        for row in self._cluster_nodes():
            if "master" in row["flags"] and "fail" not in row["flags"]:
                if any(low <= slot <= high for low, high in row["slots"]):
                    return self.node_on(row["port"])
        raise ServerStartError(f"no master serves slot {slot}")

    def replica_of(self, master: OwnedClusterNode) -> OwnedClusterNode:
        rows = self._cluster_nodes()
        master_id = next(row["id"] for row in rows if row["port"] == master.port)
        return next(self.node_on(row["port"]) for row in rows if row["master"] == master_id and "fail" not in row["flags"])

    def failover(self, master: OwnedClusterNode) -> OwnedClusterNode:
        """``CLUSTER FAILOVER`` on ``master``'s replica; returns the new master once it serves."""
        replica = self.replica_of(master)
        client = replica.client()
        try:
            client.execute_command("CLUSTER FAILOVER")
        finally:
            client.close()
        wait_until(lambda: replica.role() == "master" and master.role() == "slave" and self.healthy(), timeout=30,
                   interval=0.05, what="the manual failover")
        return replica

    def kill_master(self, master: OwnedClusterNode, rejoin: bool = False) -> OwnedClusterNode:
        """``kill -9`` of ``master``; returns its replica once the cluster has promoted it. With
        ``rejoin``, the killed node is then started again (empty: no persistence) and waited for
        until it serves as the new master's replica, as a replaced node would."""
        replica = self.replica_of(master)
        master.crash()
        wait_until(lambda: replica.role() == "master" and self.healthy(), timeout=30, interval=0.05,
                   what="the replica to take over from the killed master")
        if rejoin:
            master.start()
            wait_until(lambda: master.role() == "slave" and self.healthy(), timeout=30, interval=0.05,
                       what="the killed master to rejoin as a replica")
        return replica

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()


def redis_cluster(masters: int = 3) -> ContextManager[OwnedRedisCluster]:
    """A Redis Cluster (``masters`` masters, one replica each) for the block, stopped by PID after it."""
    return running(OwnedRedisCluster(masters))



def redis_url_with_prefix(url: str, prefix: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["prefix"] = prefix
    return urlunsplit(parts._replace(query=urlencode(query)))


def new_redis_prefix(tag: str = "rdq-test") -> str:
    return f"{tag}-{secrets.token_hex(8)}"


def redis_reachable(url: str) -> str | None:
    """None when Redis answers at ``url``, else why not."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        return f"Redis is not reachable at {url} (set RDQ_TEST_REDIS_URL): {exc}"
    finally:
        client.close()
    return None


def redis_delete_prefix(url: str, prefix: str, match: str | None = None) -> int:
    """Delete exactly the keys under ``prefix`` (SCAN + UNLINK; never a FLUSH). ``match`` widens
    the pattern for stores that do not put a colon after the prefix (the benchmark's peers)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    deleted = 0
    batch: list[bytes] = []
    try:
        for key in client.scan_iter(match=match or f"{prefix}:*", count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                deleted += client.unlink(*batch)
                batch = []
        if batch:
            deleted += client.unlink(*batch)
    finally:
        client.close()
    return deleted


@contextmanager
def redis_fresh_prefix(url: str = SHARED_REDIS_URL, tag: str = "rdq-test") -> Iterator[str]:
    """A key prefix of our own on ``url``'s server; exactly its keys are deleted afterwards."""
    prefix = new_redis_prefix(tag)
    try:
        yield prefix
    finally:
        redis_delete_prefix(url, prefix)

