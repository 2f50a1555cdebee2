"""The servers tests and benchmarks use: started, owned and stopped here, and nowhere else.

* **Shared servers** (PostgreSQL ``RDQ_TEST_PG_URL``, Redis ``RDQ_TEST_REDIS_URL``) are never
  started, stopped or flushed: a run works in a scratch database or schema, or under a key
  prefix, of its own and removes exactly that.
* **Owned servers** (nx-27017, a redis-server, a Redis Cluster, PgBouncer, or a PostgreSQL
  cluster a fault test crashes and restarts) run on a free loopback port with their own pid
  file, log and data in a temporary directory, are verified to be the process answering on that
  port (a stranger that took the port is never used), and are stopped by the PID we started.
* **Unreachable servers** fail a run under ``CI`` and skip it elsewhere (``fail_or_skip``).

One module per kind (``postgres``, ``redis``, ``mongo``) over ``processes``, which starts and
stops them; every name is importable from here. The database drivers are imported only by the
functions that need them.
"""

from .mongo import (
    CONFIGURED_MONGO_URL,
    OwnedNx27017,
    mongo_answers,
    mongo_fresh_database,
    mongo_served_pid,
    mongo_url_with_database,
    nx_27017,
)
from .postgres import (
    PG_BIN,
    SHARED_PG_URL,
    OwnedPgBouncer,
    OwnedPostgres,
    pg_fresh_schema,
    pg_reachable,
    pg_scratch_database,
    pg_url_with_database,
    pg_url_with_search_path,
    pgbouncer,
)
from .processes import (
    SERVER_START_DEADLINE_S,
    OwnedProcessServer,
    ServerStartError,
    fail_or_skip,
    free_loopback_port,
    port_refuses,
    running,
    start_owned_server,
    stop_process,
)
from .redis import (
    SHARED_REDIS_URL,
    OwnedClusterNode,
    OwnedRedis,
    OwnedRedisCluster,
    new_redis_prefix,
    redis_cluster,
    redis_delete_prefix,
    redis_fresh_prefix,
    redis_reachable,
    redis_served_pid,
    redis_url_with_prefix,
)

__all__ = [
    "CONFIGURED_MONGO_URL", "PG_BIN", "SERVER_START_DEADLINE_S", "SHARED_PG_URL", "SHARED_REDIS_URL",
    "OwnedClusterNode", "OwnedNx27017", "OwnedPgBouncer", "OwnedPostgres", "OwnedProcessServer", "OwnedRedis",
    "OwnedRedisCluster", "ServerStartError",
    "fail_or_skip", "free_loopback_port", "mongo_answers", "mongo_fresh_database", "mongo_served_pid",
    "mongo_url_with_database", "new_redis_prefix", "nx_27017", "pg_fresh_schema", "pg_reachable",
    "pg_scratch_database", "pg_url_with_database", "pg_url_with_search_path", "pgbouncer", "port_refuses",
    "redis_cluster", "redis_delete_prefix", "redis_fresh_prefix", "redis_reachable", "redis_served_pid",
    "redis_url_with_prefix", "running", "start_owned_server", "stop_process",
]
