"""The servers tests and benchmarks use: started, owned and stopped here, and nowhere else.

* **Shared servers** (PostgreSQL ``RDQ_TEST_PG_URL``, Redis ``RDQ_TEST_REDIS_URL``) are never
  started, stopped or flushed: a run works in a scratch database or schema, or under a key
  prefix, of its own and removes exactly that.
* **Owned servers** (nx-27017, a redis-server or a PostgreSQL cluster a fault test crashes and
  restarts) run on a free loopback port with their own pid file, log and data in a temporary
  directory, are verified to be the process answering on that port (a stranger that took the
  port is never used), and are stopped by the PID we started.
* **Unreachable servers** fail a run under ``CI`` and skip it elsewhere (``fail_or_skip``).

The database drivers are imported only by the functions that need them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol, Self, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .support import wait_until

SHARED_PG_URL = os.environ.get("RDQ_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SHARED_REDIS_URL = os.environ.get("RDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: A MongoDB to use instead of starting nx-27017 (e.g. a real mongod).
CONFIGURED_MONGO_URL = os.environ.get("RDQ_TEST_MONGO_URL")
PG_BIN = Path(os.environ.get("RDQ_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
SERVER_START_DEADLINE_S = 20.0


def fail_or_skip(message: str) -> None:
    """A server a test needs is missing: a failure under CI, a skip with the reason elsewhere."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


# -- processes and ports --------------------------------------------------------------------------

def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) != 0


class ServerStartError(RuntimeError):
    """An owned server could not be started (its log tail is in the message)."""


def start_owned_server(
    start: Callable[[int], subprocess.Popen[bytes]],
    served_pid: Callable[[int], int | None],
    what: str,
    log_tail: Callable[[], str] = lambda: "",
    attempts: int = 3,
    timeout: float = SERVER_START_DEADLINE_S,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free loopback port and make sure the one answering there is *ours*.

    ``start(port)`` launches the server; ``served_pid(port)`` asks whoever answers on ``port``
    for its PID (None while nothing answers). A port is only free when chosen: another process
    can bind it before our server does. Then our server exits (address in use) or a stranger
    answers with another PID; either way ours is stopped and a new port tried.
    """
    problems: list[str] = []
    for _ in range(attempts):
        port = free_loopback_port()
        process = start(port)
        deadline = time.monotonic() + timeout
        while True:
            pid = served_pid(port)
            if pid == process.pid:
                return process, port
            if pid is not None:
                problems.append(f"port {port} is served by PID {pid}, not by the {what} we started (PID {process.pid})")
                break
            if process.poll() is not None:
                problems.append(f"{what} exited with {process.returncode} on port {port}: {log_tail()[-1500:]}")
                break
            if time.monotonic() > deadline:
                problems.append(f"{what} did not answer on port {port} within {timeout:g}s: {log_tail()[-1500:]}")
                break
            time.sleep(0.05)
        stop_process(process)
    raise ServerStartError("; ".join(problems))


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop a process we started, by its PID (its own process group if it leads one): SIGTERM,
    then SIGKILL."""
    if process.poll() is not None:
        return
    own_group = _leads_own_group(process)
    try:
        os.killpg(process.pid, signal.SIGTERM) if own_group else process.terminate()
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL) if own_group else process.kill()
        process.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def _leads_own_group(process: subprocess.Popen[bytes]) -> bool:
    try:
        return os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        return False


def mongo_served_pid(port: int) -> int | None:
    """The PID the MongoDB wire server on ``port`` reports (``serverStatus``), or None."""
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        f"mongodb://127.0.0.1:{port}/", serverSelectionTimeoutMS=250, connectTimeoutMS=250)
    try:
        return int(client.admin.command("serverStatus")["pid"])
    except (pymongo.errors.PyMongoError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()


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


# -- servers run as our child process -------------------------------------------------------------

class OwnedProcessServer:
    """A server run as our child process (redis-server, nx-27017) in a directory of its own.

    The first ``start`` picks a free loopback port and retries on another if a stranger answers
    there; later starts (after ``stop`` or ``crash``) reuse the port, since clients hold URLs.
    """

    what = "server"

    def __init__(self, prefix: str, new_session: bool = False) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.new_session = new_session  # its own process group: a Ctrl-C to ours does not reach it

    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def served_pid(self, port: int) -> int | None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def _log_tail(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace")

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        with open(self.workdir / "server.log", "ab") as log:
            return subprocess.Popen(self.argv(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.workdir, start_new_session=self.new_session)

    def start(self) -> Self:
        if not self.port:
            self.process, self.port = start_owned_server(self._spawn, self.served_pid, self.what, self._log_tail)
            return self
        self.process = process = self._spawn(self.port)

        def ours() -> bool:
            pid = self.served_pid(self.port)
            if pid is not None and pid != process.pid:
                raise ServerStartError(
                    f"port {self.port} is served by PID {pid}, not by our {self.what} (PID {process.pid})")
            if pid is None and process.poll() is not None:
                raise ServerStartError(f"{self.what} exited with {process.returncode}: {self._log_tail()[-1500:]}")
            return pid is not None

        wait_until(ours, timeout=SERVER_START_DEADLINE_S, interval=0.05, what=f"{self.what} on port {self.port}")
        return self

    def stop(self) -> None:
        """A clean shutdown (SIGTERM to the PID we started)."""
        self._end(signal.SIGTERM)

    def crash(self) -> None:
        """``kill -9`` of the PID we started."""
        self._end(signal.SIGKILL)

    def _end(self, sig: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        wait_until(lambda: port_refuses(self.port), timeout=10, what=f"the owned {self.what} to stop listening")

    def destroy(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)


class OwnedNx27017(OwnedProcessServer):
    """The nx-27017 MongoDB wire server: in memory by default, or over a SQLite file (``durable``)
    so data survives a restart. Its own ``--pid-file``: without one nx-27017 uses a fixed path and
    refuses to start while that names a live process (any other nx-27017 on the machine)."""

    what = "nx-27017"

    def __init__(self, durable: bool = False, prefix: str = "rdq-nx27017-", new_session: bool = False) -> None:
        super().__init__(prefix, new_session)
        self.durable = durable

    def argv(self, port: int) -> list[str]:
        executable = shutil.which("nx-27017") or "nx-27017"
        database = str(self.workdir / "data.db") if self.durable else "memory"
        return [executable, "--host", "127.0.0.1", "-p", str(port), "--db", database,
                "--log-file", str(self.workdir / f"nx-{port}.log"), "--pid-file", str(self.workdir / f"nx-{port}.pid")]

    def served_pid(self, port: int) -> int | None:
        return mongo_served_pid(port)

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/"


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


class OwnedPostgres:
    """A throwaway PostgreSQL cluster (initdb in a temp dir), run as the ``postgres`` user when
    we are root (PostgreSQL refuses to run as root); ``pg_ctl`` manages it by its data dir."""

    def __init__(self, prefix: str = "rdq-owned-pg-") -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.data = self.workdir / "data"
        self.log = self.workdir / "server.log"
        self.port = free_loopback_port()
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_postgres:
            shutil.chown(self.workdir, "postgres")
        self._run(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: object) -> None:
        subprocess.run(self.as_postgres + [str(a) for a in argv], check=True, capture_output=True, timeout=60)

    @property
    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> "OwnedPostgres":
        options = f"-p {self.port} -h 127.0.0.1 -k {self.workdir} -c fsync=off -c full_page_writes=off"
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "30", "-o", options, "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (sessions terminated); ``immediate``: a crash (recovery on start)."""
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "30", "stop")
        wait_until(lambda: port_refuses(self.port), timeout=10, what="the owned PostgreSQL to stop listening")

    def destroy(self) -> None:
        pid = self.postmaster_pid
        try:
            self.stop("immediate")
        except Exception:  # noqa: BLE001 - fall back to the PID the cluster wrote
            if pid and _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)


class OwnedPgBouncer(OwnedProcessServer):
    """Debian's ``pgbouncer`` in **transaction** mode in front of a PostgreSQL server: every
    database name is passed through (``* =``), at most ``server_connections`` server connections
    per database, trust auth for ``postgres``. Run as the ``postgres`` user when we are root
    (pgbouncer refuses root) through ``setpriv``, which execs it: the PID we started is
    pgbouncer's own. A server answering on our port is ours when its admin console reports our
    pid file (pgbouncer has no SQL that returns its PID)."""

    what = "pgbouncer"

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432, server_connections: int = 20,
                 max_clients: int = 400) -> None:
        super().__init__("rdq-owned-pgbouncer-", new_session=True)
        self.upstream = (upstream_host, upstream_port)
        self.server_connections = server_connections
        self.max_clients = max_clients
        self.as_postgres = (["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
                            if os.geteuid() == 0 else [])
        if self.as_postgres:
            shutil.chown(self.workdir, "postgres")
        (self.workdir / "users.txt").write_text('"postgres" ""\n')
        #: Extra ``[databases]`` entries by name (``schema_url``).
        self.aliases: dict[str, str] = {}

    def _write_config(self, port: int) -> Path:
        host, upstream_port = self.upstream
        config = self.workdir / "pgbouncer.ini"
        aliases = "".join(f"{line}\n" for line in self.aliases.values())
        config.write_text(f"""[databases]
{aliases}* = host={host} port={upstream_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {self.workdir / "users.txt"}
admin_users = postgres
pool_mode = transaction
default_pool_size = {self.server_connections}
max_db_connections = {self.server_connections}
max_client_conn = {self.max_clients}
server_idle_timeout = 5
server_lifetime = 60
ignore_startup_parameters = extra_float_digits
pidfile = {self.workdir / "pgbouncer.pid"}
logfile = {self.workdir / "pgbouncer.log"}
""")
        return config

    def argv(self, port: int) -> list[str]:
        config = self._write_config(port)
        return [*self.as_postgres, shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", str(config)]

    def served_pid(self, port: int) -> int | None:
        import psycopg

        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/pgbouncer", autocommit=True,
                                 connect_timeout=1, prepare_threshold=None) as admin:
                rows = admin.execute("SHOW CONFIG").fetchall()
        except psycopg.Error:
            return None
        settings = {row[0]: row[1] for row in rows}
        if settings.get("pidfile") != str(self.workdir / "pgbouncer.pid"):
            return -1  # a pgbouncer that is not ours
        try:  # ours: the PID it wrote (setpriv execs, so it is the PID we started)
            return int((self.workdir / "pgbouncer.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _log_tail(self) -> str:
        logs = [self.workdir / "server.log", self.workdir / "pgbouncer.log"]
        return "".join(log.read_text(errors="replace") for log in logs if log.exists())

    def url_for(self, direct_url: str) -> str:
        """``direct_url``'s database through this pgbouncer, with no startup session settings
        (pgbouncer refuses the ``options`` startup parameter)."""
        parts = urlsplit(direct_url)
        query = dict(parse_qsl(parts.query))
        query.pop("options", None)
        query["rdq_session_timeouts"] = "off"
        query["listen"] = "off"  # LISTEN needs a session, which transaction pooling does not give
        return urlunsplit(parts._replace(netloc=f"postgres@127.0.0.1:{self.port}", query=urlencode(query)))

    def schema_url(self, direct_url: str) -> str:
        """A new, empty schema in ``direct_url``'s database, reached through this pgbouncer under a
        database name of its own whose server connections select it (``connect_query``): how a
        pooler selects a schema, since ``search_path`` cannot travel in the startup options.
        Cheaper than a database per store; the schema goes with its database."""
        import psycopg
        from psycopg import sql

        schema = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(direct_url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        host, upstream_port = self.upstream
        database = urlsplit(direct_url).path.lstrip("/")
        self.aliases[schema] = (f"{schema} = host={host} port={upstream_port} dbname={database} "
                                f"connect_query='SET search_path TO {schema}'")
        self._write_config(self.port)
        self.admin("RELOAD")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{schema}?rdq_session_timeouts=off&listen=off"

    def admin(self, command: str) -> None:
        """One command on pgbouncer's admin console (``RELOAD``, ``DISABLE db``, ``KILL db``...)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer", autocommit=True,
                             connect_timeout=2, prepare_threshold=None) as console:
            console.execute(command)

    def server_connections_now(self) -> int:
        """Server connections pgbouncer holds to PostgreSQL now (``SHOW SERVERS``)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer", autocommit=True,
                             connect_timeout=2, prepare_threshold=None) as admin:
            return len(admin.execute("SHOW SERVERS").fetchall())


def pgbouncer(server_connections: int = 20, upstream_port: int = 5432) -> ContextManager[OwnedPgBouncer]:
    """A transaction-mode pgbouncer for the block, stopped by PID after it."""
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        raise ServerStartError("pgbouncer is not installed (apt-get install pgbouncer)")
    return running(OwnedPgBouncer(upstream_port=upstream_port, server_connections=server_connections))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _OwnedServer(Protocol):
    def start(self) -> Any: ...
    def destroy(self) -> None: ...


S = TypeVar("S", bound=_OwnedServer)


@contextmanager
def running(server: S) -> Iterator[S]:
    """``server`` started for the block and destroyed (stopped by PID, its directory removed) after it,
    also when it fails to start half way."""
    try:
        server.start()
        yield server
    finally:
        server.destroy()


def nx_27017(durable: bool = False, new_session: bool = False) -> ContextManager[OwnedNx27017]:
    """nx-27017 started for the block and stopped (by PID) after it."""
    if shutil.which("nx-27017") is None:
        raise ServerStartError("nx-27017 is not installed (pip install nx-27017)")
    return running(OwnedNx27017(durable=durable, new_session=new_session))


# -- fresh stores on shared servers ----------------------------------------------------------------

def pg_url_with_database(url: str, database: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


def pg_url_with_search_path(url: str, schema: str) -> str:
    """Adds ``options=-csearch_path=<schema>`` (libpq's own way to set a session GUC)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    option = f"-csearch_path={schema}"
    query["options"] = f"{query['options']} {option}" if "options" in query else option
    return urlunsplit(parts._replace(query=urlencode(query)))


def pg_reachable(admin_url: str) -> str | None:
    """None when PostgreSQL answers at ``admin_url``, else why not."""
    import psycopg

    try:
        psycopg.connect(admin_url, autocommit=True, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        return f"PostgreSQL is not reachable at {admin_url} (set RDQ_TEST_PG_URL): {exc}"
    return None


@contextmanager
def pg_scratch_database(admin_url: str = SHARED_PG_URL, prefix: str = "rdq_test_") -> Iterator[str]:
    """A database of our own on ``admin_url``'s server, dropped afterwards (only that one)."""
    import psycopg
    from psycopg import sql

    name = f"{prefix}{secrets.token_hex(6)}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_url_with_database(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def pg_fresh_schema(database_url: str, prefix: str = "t_") -> str:
    """A new, empty schema in ``database_url``; returns a URL that selects it (``search_path``).
    It goes when its database is dropped."""
    import psycopg
    from psycopg import sql

    schema = f"{prefix}{secrets.token_hex(6)}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    return pg_url_with_search_path(database_url, schema)


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


def mongo_url_with_database(server_url: str, database: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def mongo_answers(url: str, timeout_ms: int = 500) -> bool:
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        url, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms)
    try:
        client.admin.command("ping")
        return True
    except pymongo.errors.PyMongoError:
        return False
    finally:
        client.close()


@contextmanager
def mongo_fresh_database(server_url: str, prefix: str = "rdq_test_") -> Iterator[str]:
    """A URL naming a database no one has used; dropped afterwards."""
    import pymongo

    database = prefix + secrets.token_hex(6)
    try:
        yield mongo_url_with_database(server_url, database)
    finally:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(server_url, serverSelectionTimeoutMS=5000)
        try:
            client.drop_database(database)
        finally:
            client.close()
