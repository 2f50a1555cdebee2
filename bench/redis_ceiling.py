"""The physical reference on the same Redis: a bare Lua claim of 100 jobs plus one Lua ack of
those 100 per round, no library, redis-py with hiredis (the client rdq uses).

The layout is the least a real queue keeps: one hash per job (``status``, ``payload`` -- a small
JSON object like rdq's ``{"n": i}`` -- and, once claimed, ``lease_until``), a sorted set of
pending ids and a sorted set of in-flight ids scored by lease expiry (what a reaper would scan).
The claim pops the ids, writes each job's status and lease, reads its payload and returns it;
the ack writes each job's status and drops the ids from the in-flight set. No attempt history,
no fencing token, no flow control: the floor under rdq's claim and settle scripts, as
``bench/ceiling.py`` is on PostgreSQL.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rdq_testing import servers as provisioning

from . import servers
from .ceiling import busy_window
from .common import ready_then_go, run_on_barrier

#: KEYS: pending, in-flight. ARGV: job key prefix, limit, lease ms. Returns id, payload, id, ...
CLAIM_LUA = """
local popped = redis.call('ZPOPMIN', KEYS[1], ARGV[2])
if #popped == 0 then return {} end
local t = redis.call('TIME')
local lease_until = string.format('%d', (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) + tonumber(ARGV[3]))
local out, leases = {}, {}
for i = 1, #popped, 2 do
  local id = popped[i]
  local key = ARGV[1] .. id
  redis.call('HSET', key, 'status', 'RUNNING', 'lease_until', lease_until)
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', key, 'payload')
  leases[#leases + 1] = lease_until
  leases[#leases + 1] = id
end
redis.call('ZADD', KEYS[2], unpack(leases))
return out
"""

#: KEYS: in-flight. ARGV: job key prefix, then the ids. Returns how many left the in-flight set.
ACK_LUA = """
for i = 2, #ARGV do
  redis.call('HSET', ARGV[1] .. ARGV[i], 'status', 'DONE')
end
return redis.call('ZREM', KEYS[1], unpack(ARGV, 2))
"""

LEASE_MS = 30_000


def _keys(prefix: str) -> tuple[str, str, str]:
    """(pending, in-flight, job key prefix); one hash tag, so every key sits in one slot."""
    base = f"{prefix}:{{ceiling}}:"
    return base + "pending", base + "in_flight", base + "job:"


def worker_main() -> None:
    import redis

    url, prefix, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pending, in_flight, job = _keys(prefix)
    client = redis.Redis.from_url(url)
    claim, ack = client.script_load(CLAIM_LUA), client.script_load(ACK_LUA)
    if not ready_then_go():
        return
    first = time.time()
    last, rows = first, 0
    while True:
        reply = client.evalsha(claim, 2, pending, in_flight, job, limit, LEASE_MS)
        if not reply:
            break
        ids = reply[0::2]
        # Decoded like psycopg decodes the PG ceiling's jsonb column: the client really reads it.
        payloads = [json.loads(p) for p in reply[1::2]]
        if len(payloads) != len(ids):
            raise RuntimeError("claim reply without a payload per id")
        if client.evalsha(ack, 1, in_flight, job, *ids) != len(ids):
            raise RuntimeError("ack found ids that were not in flight")
        rows += len(ids)
        last = time.time()
    print(json.dumps({"rows": rows, "first": first, "last": last}), flush=True)


def _load(client: Any, prefix: str, n: int, chunk: int = 5000) -> None:
    pending, _, job = _keys(prefix)
    for start in range(1, n + 1, chunk):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(n, start + chunk - 1) + 1):
            pipe.hset(f"{job}{i}", mapping={"status": "PENDING", "payload": json.dumps({"n": i})})
        pipe.zadd(pending, {str(i): i for i in range(start, min(n, start + chunk - 1) + 1)})
        pipe.execute()


def redis_ceiling_run(n: int, clients: int, limit: int = 100, redis_url: str = servers.REDIS_URL) -> dict[str, Any]:
    """``clients`` processes drain ``n`` jobs from a fresh key prefix (deleted afterwards with
    SCAN + UNLINK); rows/s over the first claim to the last ack."""
    import redis

    prefix = servers.new_redis_prefix("rdqbench-ceiling")
    client = redis.Redis.from_url(redis_url)
    try:
        _load(client, prefix, n)
        reports = run_on_barrier(["-m", "bench.redis_ceiling", redis_url, prefix, str(limit)], clients)
        _, in_flight, _ = _keys(prefix)
        if client.zcard(in_flight):  # every claimed job was acked
            raise RuntimeError(f"{client.zcard(in_flight)} jobs left in flight")
    finally:
        client.close()
        provisioning.redis_delete_prefix(redis_url, prefix)
    window = busy_window(reports, n)
    return {"store": "redis", "n": n, "clients": clients, "batch": limit, "rows_per_s": n / window, "seconds": window}


if __name__ == "__main__":
    worker_main()
