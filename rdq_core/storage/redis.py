"""Redis backend: every state change is one Lua script run atomically by the server.

Key layout (``P`` = the key prefix, default ``rdq``; ``{q}`` = the queue name as a hash tag, so
all keys of one queue live in one Redis Cluster slot and one script may touch them all):

=============================  ====================================================================
``P:{q}:due``                  zset of PENDING ids scored by ``next_attempt_at`` (µs since epoch)
``P:{q}:inflight``             zset of IN_FLIGHT ids scored by ``lease_expires_at`` (µs)
``P:{q}:dead``                 zset of DEAD ids scored by ``dead_at`` (µs); ties ordered by id
``P:{q}:succeeded``            zset of SUCCEEDED ids scored by ``updated_at`` (retention)
``P:{q}:cancelled``            zset of CANCELLED ids scored by ``updated_at`` (retention)
``P:{q}:task:<id>``            hash: the task's fields
``P:{q}:attempts:<id>``        hash: ``attempt_no`` -> attempt JSON (a field per number: unique)
``P:{P:global}:ids``           hash: task id -> queue (the global id index)
``P:{P:global}:queues``        set: queues that hold tasks (the reaper's registry)
=============================  ====================================================================

Every status has its own zset, so a task's status field and zset membership are changed together
by the same script. The id index and the queue registry live outside the queues' slots; they are
maintained by separate scripts in an order that tolerates races (see ``_forget_ids``), and
``docs/redis-backend.md`` explains the trade-off.

Round trips (``round_trips`` counts one per command or per pipeline sent, however many commands
the pipeline holds): claim 1, settle/extend/release 1 per batch (a pipeline of one script per
queue when a batch spans queues), enqueue 2 per batch, get 2.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ..errors import InvalidInput, StaleClaim, StorageUnavailable, TaskConflict, TaskNotFound
from ..model import (
    Attempt,
    Backoff,
    ClaimedTask,
    ClaimRef,
    DeadFilter,
    DeadPage,
    EnqueueResult,
    ErrorInfo,
    NewTask,
    Outcome,
    QueueStats,
    Settlement,
    Task,
    TaskStatus,
)
from .spi import Storage, decode_dead_cursor, encode_dead_cursor, from_micros, storable_error, storable_json, to_micros

log = logging.getLogger(__name__)

_QUEUE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,119}$")
_PREFIX = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_SETTLED_STATUSES = {TaskStatus.SUCCEEDED, TaskStatus.PENDING, TaskStatus.DEAD}
# How many DLQ entries one script call may examine, so a filtered scan of a huge DLQ never
# blocks the server for long; the client loops over bounded calls instead.
_DEAD_SCAN_BUDGET = 1000
_MIN_SERVER_VERSION = (5, 0)
_TRANSIENT_ERRORS = ("OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "BUSY")
#: Seconds to open a connection, and to wait for any reply (a script runs in milliseconds).
DEFAULT_CONNECT_TIMEOUT = 5
DEFAULT_SOCKET_TIMEOUT = 30
#: Seconds a pooled connection may sit idle before it is checked with a PING on reuse.
DEFAULT_HEALTH_CHECK_INTERVAL = 30
#: redis-py URL options that would make it resend a command after a timeout or error.
_RESEND_OPTIONS = ("retry_on_timeout", "retry_on_error")
#: The error prefix of a script that refused its arguments before writing anything.
_INVALID_ARGUMENTS = "RDQ_INVALID"


# --------------------------------------------------------------------------------------------
# Lua. Every queue script gets KEYS = the queue's five zsets (see _QUEUE_ZSETS) and ARGV[1] =
# the queue's key base (``P:{q}:``); per-task keys are built from that base, so they share the
# hash tag and therefore the slot. Numbers are formatted with ``us()``: Redis turns a Lua number
# argument into a string with 14 significant digits, which would truncate microsecond times.
#
# Redis does not roll back a script that fails half way: the writes made before the error stay.
# So every script that writes runs in two phases. Phase 1 reads and checks everything -- the
# argument count, every number, enum value and JSON text it will decode or embed, every fence
# (token, status, lease) -- and plans the writes; a bad argument raises ``RDQ_INVALID …``
# (``InvalidInput`` in Python) while nothing has been written yet. Phase 2 only applies the
# plan, with commands that cannot fail on checked input. Payload, headers, backoff and result
# JSON are stored verbatim and never decoded by a script (decoding up to a MiB per batch would
# stall the server), so they cannot make a script fail; the client encodes them.
# --------------------------------------------------------------------------------------------

_QUEUE_ZSETS = ("due", "inflight", "dead", "succeeded", "cancelled")

# Argument checks shared by every script (queue-scoped or global). They run before any write.
_CHECKS = r"""
local function invalid(message) error({err = 'RDQ_INVALID ' .. message}) end

local function need_string(value, what)
  if type(value) ~= 'string' or value == '' then invalid(what .. ' must be a non-empty string') end
  return value
end

local function need_number(value, what)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then invalid(what .. ' must be a finite number') end
  return n
end

local function need_count(value, what)
  local n = need_number(value, what)
  if n < 0 or n ~= math.floor(n) then invalid(what .. ' must be a whole number >= 0') end
  return n
end

-- ARGV[first..] must hold whole groups of `size` values.
local function need_groups(first, size, what)
  if #ARGV < first - 1 or (#ARGV - first + 1) % size ~= 0 then
    invalid(what .. ': expected groups of ' .. size .. ' arguments, got ' .. (#ARGV - first + 1))
  end
end

local function need_json(text, what)
  local ok, value = pcall(cjson.decode, text)
  if not ok then invalid(what .. ' is not valid JSON') end
  return value
end
"""

_PRELUDE = _CHECKS + r"""
local DUE, INFLIGHT, DEAD, SUCCEEDED, CANCELLED = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local BASE = need_string(ARGV[1], 'key base')

local function us(n) return string.format('%.0f', n) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function task_key(id) return BASE .. 'task:' .. id end
local function attempts_key(id) return BASE .. 'attempts:' .. id end

local function task_reply(id)
  return {redis.call('HGETALL', task_key(id)), redis.call('HGETALL', attempts_key(id))}
end

-- Claims and lease scans hand out tasks without their history (see the SPI): reading it would
-- make every claim cost per attempt row, and a freshly created task has none to read.
local function task_reply_without_history(id)
  return {redis.call('HGETALL', task_key(id)), {}}
end

local function queue_is_empty()
  for i = 1, 5 do
    if redis.call('ZCARD', KEYS[i]) > 0 then return false end
  end
  return true
end

-- Byte-wise a <= b: Lua's own string comparison follows the server's collation locale, but
-- zsets order equal scores by raw bytes, and so must the DLQ keyset.
local function bytes_le(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a <= #b
end

-- (score, id) strictly after the keyset position (after_score, after_id); '' = the start.
local function is_after(score, id, after_score, after_id)
  if after_score == '' then return true end
  local s, a = tonumber(score), tonumber(after_score)
  if s ~= a then return s > a end
  return not bytes_le(id, after_id)
end

local function dead_matches(id, ids, error_type, handler)
  if ids and not ids[id] then return false end
  if error_type ~= '' and redis.call('HGET', task_key(id), 'error_type') ~= error_type then return false end
  if handler ~= '' and redis.call('HGET', task_key(id), 'handler') ~= handler then return false end
  return true
end

-- The DLQ selection arguments (after_score, after_id, ids_json, error_type, handler), checked.
local function need_dead_selection(after_score, after_id, ids_json, error_type, handler)
  if after_score ~= '' then need_number(after_score, 'cursor position') end
  if type(after_id) ~= 'string' then invalid('cursor id must be a string') end
  if ids_json ~= '' then
    local ids = need_json(ids_json, 'ids')
    if type(ids) ~= 'table' then invalid('ids must be a JSON array') end
    for _, id in ipairs(ids) do
      if type(id) ~= 'string' then invalid('ids must be strings') end
    end
  end
  if type(error_type) ~= 'string' or type(handler) ~= 'string' then invalid('filters must be strings') end
end

-- Up to `want` DEAD entries after the position that match the filter, in (dead_at, id) order,
-- examining at most `budget` entries. Returns matches {score, id}, the last examined position
-- and whether the zset was exhausted. Arguments are checked by need_dead_selection first.
local function scan_dead(after_score, after_id, want, budget, ids_json, error_type, handler)
  local matches, last_score, last_id = {}, after_score, after_id
  if ids_json ~= '' then
    local ids, wanted = {}, cjson.decode(ids_json)
    for _, id in ipairs(wanted) do ids[id] = true end
    local found = {}
    for id in pairs(ids) do
      local score = redis.call('ZSCORE', DEAD, id)
      if score and is_after(score, id, after_score, after_id) and dead_matches(id, nil, error_type, handler) then
        found[#found + 1] = {score, id}
      end
    end
    table.sort(found, function(x, y)
      local a, b = tonumber(x[1]), tonumber(y[1])
      if a ~= b then return a < b end
      return x[2] ~= y[2] and bytes_le(x[2], y[2])
    end)
    for i = 1, math.min(want, #found) do matches[i] = found[i] end
    return matches, last_score, last_id, true
  end
  local min = after_score == '' and '-inf' or after_score
  local offset, examined = 0, 0
  while #matches < want and examined < budget do
    local chunk = redis.call('ZRANGEBYSCORE', DEAD, min, '+inf', 'WITHSCORES', 'LIMIT', offset, 100)
    if #chunk == 0 then return matches, last_score, last_id, true end
    for j = 1, #chunk, 2 do
      local id, score = chunk[j], chunk[j + 1]
      offset = offset + 1
      if is_after(score, id, after_score, after_id) then
        examined = examined + 1
        last_score, last_id = score, id
        if dead_matches(id, nil, error_type, handler) then
          matches[#matches + 1] = {score, id}
          if #matches >= want then break end
        end
      end
    end
  end
  return matches, last_score, last_id, false
end
"""

# ARGV: base, queue, then per task: id, handler, payload, headers, max_attempts, backoff,
# delay_us, run_at_us ('' for none). An existing id is returned untouched (idempotency).
_ENQUEUE = r"""
need_string(ARGV[2], 'queue')
need_groups(3, 8, 'enqueue')
for o = 3, #ARGV, 8 do
  need_string(ARGV[o], 'task id')
  need_string(ARGV[o + 1], 'handler')
  need_string(ARGV[o + 2], 'payload')
  need_string(ARGV[o + 3], 'headers')
  if ARGV[o + 4] ~= '' then need_count(ARGV[o + 4], 'max_attempts') end
  need_number(ARGV[o + 6], 'delay')
  if ARGV[o + 7] ~= '' then need_number(ARGV[o + 7], 'run_at') end
end

local now = now_us()
local queue = ARGV[2]
local out = {}
for o = 3, #ARGV, 8 do
  local id = ARGV[o]
  local key = task_key(id)
  if redis.call('EXISTS', key) == 1 then
    out[#out + 1] = {0, task_reply(id)}
  else
    local next_at = now + tonumber(ARGV[o + 6])
    if ARGV[o + 7] ~= '' then next_at = tonumber(ARGV[o + 7]) end
    local fields = {'id', id, 'queue', queue, 'handler', ARGV[o + 1], 'payload', ARGV[o + 2],
      'headers', ARGV[o + 3], 'status', 'PENDING', 'attempt_count', '0', 'redrive_count', '0',
      'next_attempt_at', us(next_at), 'created_at', us(now), 'updated_at', us(now)}
    if ARGV[o + 4] ~= '' then fields[#fields + 1] = 'max_attempts'; fields[#fields + 1] = ARGV[o + 4] end
    if ARGV[o + 5] ~= '' then fields[#fields + 1] = 'backoff'; fields[#fields + 1] = ARGV[o + 5] end
    redis.call('HSET', key, unpack(fields))
    redis.call('ZADD', DUE, us(next_at), id)
    out[#out + 1] = {1, task_reply_without_history(id)}
  end
end
return out
"""

# ARGV: base, limit, lease_us, token_prefix. Oldest due first; the token is the prefix (random
# per call, minted by the client) plus the position in the batch, so it is never reused.
_CLAIM = r"""
local limit = need_count(ARGV[2], 'limit')
local lease = need_number(ARGV[3], 'lease')
local token_prefix = need_string(ARGV[4], 'token prefix')

local now = now_us()
local lease_until = us(now + lease)
local ids = redis.call('ZRANGEBYSCORE', DUE, '-inf', us(now), 'LIMIT', 0, limit)
local out = {}
for i, id in ipairs(ids) do
  redis.call('ZREM', DUE, id)
  local key = task_key(id)
  if redis.call('HGET', key, 'status') == 'PENDING' then
    redis.call('HSET', key, 'status', 'IN_FLIGHT', 'claim_token', token_prefix .. i, 'claimed_at', us(now),
      'lease_expires_at', lease_until, 'updated_at', us(now))
    redis.call('ZADD', INFLIGHT, lease_until, id)
    out[#out + 1] = task_reply_without_history(id)
  end
end
return out
"""

# ARGV: base, then per settlement: id, token, outcome, status, retry_delay_us, error_json,
# error_type, result_json ('' = none). The error JSON is embedded in the attempt record, so it
# is decoded (checked) first; the result JSON is stored verbatim. Returns the refused ids.
# Phase 1 checks every item and its fence (token, IN_FLIGHT, lease expiry for LEASE_EXPIRED,
# one settle per task within the batch) and numbers its attempt; phase 2 writes.
_SETTLE = r"""
local OUTCOMES = {SUCCESS = true, RETRYABLE_FAILURE = true, PERMANENT_FAILURE = true, LEASE_EXPIRED = true}
local SETTLED = {SUCCEEDED = true, PENDING = true, DEAD = true}
need_groups(2, 8, 'settle')

local now = now_us()
local refused, plan, seen = {}, {}, {}
for o = 2, #ARGV, 8 do
  local id, token, outcome, status = ARGV[o], ARGV[o + 1], ARGV[o + 2], ARGV[o + 3]
  local error_json, error_type, result_json = ARGV[o + 5], ARGV[o + 6], ARGV[o + 7]
  need_string(id, 'task id')
  if not OUTCOMES[outcome] then invalid('unknown outcome for task ' .. id) end
  if not SETTLED[status] then invalid('cannot settle task ' .. id .. ' as ' .. tostring(status)) end
  local delay = need_number(ARGV[o + 4], 'retry delay')
  if error_json ~= '' then
    local decoded = need_json(error_json, 'error')
    if type(decoded) ~= 'table' or type(decoded['type']) ~= 'string' then invalid('error must be an object with a type') end
  end
  local key = task_key(id)
  local held = redis.call('HMGET', key, 'status', 'claim_token', 'lease_expires_at', 'claimed_at')
  local valid = not seen[id] and held[1] == 'IN_FLIGHT' and held[2] == token
  if valid and outcome == 'LEASE_EXPIRED' and (tonumber(held[3]) or 0) > now then valid = false end
  if valid then
    -- attempt_no = MAX(attempt_no) + 1 over the history, never derived from attempt_count.
    local attempt_no = 0
    for _, no in ipairs(redis.call('HKEYS', attempts_key(id))) do
      attempt_no = math.max(attempt_no, tonumber(no) or 0)
    end
    seen[id] = true
    plan[#plan + 1] = {id = id, key = key, status = status, delay = delay, error_json = error_json,
      error_type = error_type, result_json = result_json, attempt_no = attempt_no + 1,
      attempt = '{"outcome":"' .. outcome .. '","started_at":"' .. (held[4] or '') .. '","finished_at":"' ..
        us(now) .. '","error":' .. (error_json ~= '' and error_json or 'null') .. '}'}
  else
    refused[#refused + 1] = id
  end
end

for _, p in ipairs(plan) do
  local id, key = p.id, p.key
  redis.call('HSETNX', attempts_key(id), tostring(p.attempt_no), p.attempt)
  redis.call('ZREM', INFLIGHT, id)
  redis.call('HDEL', key, 'claim_token', 'claimed_at', 'lease_expires_at', 'dead_at')
  redis.call('HINCRBY', key, 'attempt_count', 1)
  redis.call('HSET', key, 'status', p.status, 'updated_at', us(now))
  if p.error_json ~= '' then
    redis.call('HSET', key, 'last_error', p.error_json, 'error_type', p.error_type)
  end
  if p.status == 'PENDING' then
    local next_at = us(now + p.delay)
    redis.call('HSET', key, 'next_attempt_at', next_at)
    redis.call('ZADD', DUE, next_at, id)
  elseif p.status == 'SUCCEEDED' then
    if p.result_json ~= '' then redis.call('HSET', key, 'result', p.result_json) end
    redis.call('ZADD', SUCCEEDED, us(now), id)
  else
    redis.call('HSET', key, 'dead_at', us(now))
    redis.call('ZADD', DEAD, us(now), id)
  end
end
return refused
"""

# ARGV: base, lease_us, then pairs id, token. The new expiry is max(current, now + lease): an
# extension never moves a lease earlier. Returns {{id, expiry_us, ...}, refused ids}.
_EXTEND = r"""
local lease = need_number(ARGV[2], 'lease')
need_groups(3, 2, 'extend')

local now = now_us()
local wanted = now + lease
local plan, refused = {}, {}
for o = 3, #ARGV, 2 do
  local id, token = ARGV[o], ARGV[o + 1]
  local held = redis.call('HMGET', task_key(id), 'status', 'claim_token', 'lease_expires_at')
  if held[1] == 'IN_FLIGHT' and held[2] == token then
    plan[#plan + 1] = {id, math.max(tonumber(held[3]) or 0, wanted)}
  else
    refused[#refused + 1] = id
  end
end

local extended = {}
for _, p in ipairs(plan) do
  local id, lease_until = p[1], us(p[2])
  redis.call('HSET', task_key(id), 'lease_expires_at', lease_until, 'updated_at', us(now))
  redis.call('ZADD', INFLIGHT, lease_until, id)
  extended[#extended + 1] = id
  extended[#extended + 1] = lease_until
end
return {extended, refused}
"""

# ARGV: base, then pairs id, token. Back to PENDING at its old next_attempt_at; no attempt.
_RELEASE = r"""
need_groups(2, 2, 'release')

local now = now_us()
local plan, refused, seen = {}, {}, {}
for o = 2, #ARGV, 2 do
  local id, token = ARGV[o], ARGV[o + 1]
  local held = redis.call('HMGET', task_key(id), 'status', 'claim_token', 'next_attempt_at')
  if not seen[id] and held[1] == 'IN_FLIGHT' and held[2] == token and tonumber(held[3]) then
    seen[id] = true
    plan[#plan + 1] = {id, held[3]}
  else
    refused[#refused + 1] = id
  end
end

for _, p in ipairs(plan) do
  local id, key = p[1], task_key(p[1])
  redis.call('ZREM', INFLIGHT, id)
  redis.call('HDEL', key, 'claim_token', 'claimed_at', 'lease_expires_at')
  redis.call('HSET', key, 'status', 'PENDING', 'updated_at', us(now))
  redis.call('ZADD', DUE, p[2], id)
end
return refused
"""

# ARGV: base, limit. Read-only: IN_FLIGHT tasks whose lease expired by server time.
_EXPIRED_LEASES = r"""
local limit = need_count(ARGV[2], 'limit')
local ids = redis.call('ZRANGEBYSCORE', INFLIGHT, '-inf', us(now_us()), 'LIMIT', 0, limit)
local out = {}
for _, id in ipairs(ids) do out[#out + 1] = task_reply_without_history(id) end
return out
"""

# ARGV: base, ids... Returns per id the task reply, or false when absent.
_READ_TASKS = r"""
local out = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', task_key(ARGV[i])) == 1 then out[#out + 1] = task_reply(ARGV[i]) else out[#out + 1] = false end
end
return out
"""

# ARGV: base, id. Returns {'missing'} | {'conflict', task} | {'cancelled', task}.
_CANCEL = r"""
local id = need_string(ARGV[2], 'task id')
local key = task_key(id)
local status = redis.call('HGET', key, 'status')
if not status then return {'missing'} end
if status ~= 'PENDING' then return {'conflict', task_reply(id)} end
local now = us(now_us())
redis.call('ZREM', DUE, id)
redis.call('HSET', key, 'status', 'CANCELLED', 'updated_at', now)
redis.call('ZADD', CANCELLED, now, id)
return {'cancelled', task_reply(id)}
"""

# ARGV: base. Counts are ZCARDs; the oldest pending is the head of the due zset.
_STATS = r"""
local head = redis.call('ZRANGE', DUE, 0, 0, 'WITHSCORES')
return {us(now_us()), redis.call('ZCARD', DUE), redis.call('ZCARD', INFLIGHT), redis.call('ZCARD', DEAD),
  redis.call('ZCARD', SUCCEEDED), redis.call('ZCARD', CANCELLED), head[2] or false}
"""

# ARGV: base, after_score, after_id, want, budget, ids_json, error_type, handler.
# Returns {exhausted, last_score, last_id, {{score, task}, ...}}.
_DEAD_PAGE = r"""
local want, budget = need_count(ARGV[4], 'want'), need_count(ARGV[5], 'budget')
need_dead_selection(ARGV[2], ARGV[3], ARGV[6], ARGV[7], ARGV[8])
local matches, last_score, last_id, exhausted = scan_dead(ARGV[2], ARGV[3], want, budget, ARGV[6], ARGV[7], ARGV[8])
local out = {}
for i, m in ipairs(matches) do out[i] = {m[1], task_reply(m[2])} end
return {exhausted and 1 or 0, last_score, last_id, out}
"""

# ARGV: base, action ('redrive' | 'purge'), after_score, after_id, budget, ids_json, error_type,
# handler. Applies the action to the matches found in one bounded scan (phase 1 is the scan).
# Returns {exhausted, last_score, last_id, affected ids, queue_is_empty}.
_DEAD_APPLY = r"""
local action = ARGV[2]
if action ~= 'redrive' and action ~= 'purge' then invalid('unknown DLQ action ' .. tostring(action)) end
local budget = need_count(ARGV[5], 'budget')
need_dead_selection(ARGV[3], ARGV[4], ARGV[6], ARGV[7], ARGV[8])
local matches, last_score, last_id, exhausted = scan_dead(ARGV[3], ARGV[4], budget, budget, ARGV[6], ARGV[7], ARGV[8])

local now = us(now_us())
local affected = {}
for _, m in ipairs(matches) do
  local id = m[2]
  local key = task_key(id)
  redis.call('ZREM', DEAD, id)
  if action == 'redrive' then
    -- History is kept: attempt numbers continue from MAX(attempt_no) on the next settle.
    redis.call('HDEL', key, 'dead_at')
    redis.call('HINCRBY', key, 'redrive_count', 1)
    redis.call('HSET', key, 'status', 'PENDING', 'attempt_count', '0', 'next_attempt_at', now, 'updated_at', now)
    redis.call('ZADD', DUE, now, id)
  else
    redis.call('DEL', key, attempts_key(id))
  end
  affected[#affected + 1] = id
end
return {exhausted and 1 or 0, last_score, last_id, affected, queue_is_empty() and 1 or 0}
"""

# ARGV: base, older_than_us, limit. Deletes SUCCEEDED then CANCELLED tasks last updated before
# now - older_than. Returns {deleted ids, queue_is_empty}.
_PURGE_FINISHED = r"""
local older_than = need_number(ARGV[2], 'older_than')
local limit = need_count(ARGV[3], 'limit')
local cutoff = '(' .. us(now_us() - older_than)
local deleted = {}
for _, zset in ipairs({SUCCEEDED, CANCELLED}) do
  if #deleted >= limit then break end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', zset, '-inf', cutoff, 'LIMIT', 0, limit - #deleted)) do
    redis.call('ZREM', zset, id)
    redis.call('DEL', task_key(id), attempts_key(id))
    deleted[#deleted + 1] = id
  end
end
return {deleted, queue_is_empty() and 1 or 0}
"""

# ARGV: base, ids... Which of the ids exist, and whether the queue holds anything (used after a
# deletion to repair an index entry a concurrent enqueue may still need; see _forget_ids).
_EXISTING = r"""
local existing = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', task_key(ARGV[i])) == 1 then existing[#existing + 1] = ARGV[i] end
end
return {existing, queue_is_empty() and 1 or 0}
"""

# Global scripts: KEYS = ids index, queue registry.

# ARGV: pairs id, queue. Reserves each id for its queue unless it is already taken; returns the
# owning queue per id and registers the queues that own their ids.
_RESERVE_IDS = _CHECKS + r"""
need_groups(1, 2, 'reserve_ids')
for i = 1, #ARGV, 2 do
  need_string(ARGV[i], 'task id')
  need_string(ARGV[i + 1], 'queue')
end
local owners = {}
for i = 1, #ARGV, 2 do
  local id, queue = ARGV[i], ARGV[i + 1]
  local owner = queue
  if redis.call('HSETNX', KEYS[1], id, queue) == 0 then owner = redis.call('HGET', KEYS[1], id) end
  if owner == queue then redis.call('SADD', KEYS[2], queue) end
  owners[#owners + 1] = owner
end
return owners
"""

# ARGV: queue, queue_is_empty, ids... Drops the ids' index entries that still point at queue
# and, when the queue emptied, its registry entry.
_UNINDEX = _CHECKS + r"""
local queue = need_string(ARGV[1], 'queue')
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then invalid('queue_is_empty must be 0 or 1') end
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == queue then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
if ARGV[2] == '1' then redis.call('SREM', KEYS[2], queue) end
return 1
"""

# ARGV: triples id, expected_owner, new_owner: compare-and-set of index entries whose task is
# gone (an enqueue that died between reserving and creating). Returns the owner per id.
_TAKE_OVER_IDS = _CHECKS + r"""
need_groups(1, 3, 'take_over_ids')
for i = 1, #ARGV, 3 do
  need_string(ARGV[i], 'task id')
  need_string(ARGV[i + 1], 'expected owner')
  need_string(ARGV[i + 2], 'new owner')
end
local owners = {}
for i = 1, #ARGV, 3 do
  local id, expected, new = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', KEYS[1], id) == expected then
    redis.call('HSET', KEYS[1], id, new)
    redis.call('SADD', KEYS[2], new)
  end
  owners[#owners + 1] = redis.call('HGET', KEYS[1], id)
end
return owners
"""


@dataclass(frozen=True)
class _Script:
    name: str
    source: str
    sha: str

    @classmethod
    def build(cls, name: str, body: str, *, queue_scoped: bool = True) -> "_Script":
        source = (_PRELUDE + body) if queue_scoped else body
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


_SCRIPTS = {
    s.name: s
    for s in (
        _Script.build("enqueue", _ENQUEUE),
        _Script.build("claim", _CLAIM),
        _Script.build("settle", _SETTLE),
        _Script.build("extend", _EXTEND),
        _Script.build("release", _RELEASE),
        _Script.build("expired_leases", _EXPIRED_LEASES),
        _Script.build("read_tasks", _READ_TASKS),
        _Script.build("cancel", _CANCEL),
        _Script.build("stats", _STATS),
        _Script.build("dead_page", _DEAD_PAGE),
        _Script.build("dead_apply", _DEAD_APPLY),
        _Script.build("purge_finished", _PURGE_FINISHED),
        _Script.build("existing", _EXISTING),
        _Script.build("reserve_ids", _RESERVE_IDS, queue_scoped=False),
        _Script.build("unindex", _UNINDEX, queue_scoped=False),
        _Script.build("take_over_ids", _TAKE_OVER_IDS, queue_scoped=False),
    )
}


@dataclass(frozen=True)
class _Call:
    """One script invocation, ready to send alone or in a pipeline."""

    script: _Script
    keys: tuple[str, ...]
    args: tuple[Any, ...]


class RedisStorage(Storage):
    """``redis://host:port/db?prefix=rdq`` (``rediss://`` for TLS; ``&cluster=true`` for Redis
    Cluster). Other query parameters go to redis-py (e.g. ``socket_timeout``)."""

    schemes = ("redis", "rediss")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        self.prefix = options.pop("prefix", "rdq")
        if not _PREFIX.match(self.prefix):
            raise InvalidInput(f"invalid Redis key prefix {self.prefix!r}", field="prefix")
        cluster = options.pop("cluster", "").lower() in ("1", "true", "yes")
        for name in _RESEND_OPTIONS:
            if options.pop(name, None) is not None:
                log.warning("ignoring %s in the Redis URL: rdq never resends a command", name)
        client_url = urlunsplit(parts._replace(query=urlencode(options)))
        # No automatic resend: a script whose reply was lost may have run, and resending a
        # claim or settle is not idempotent. Failures surface as StorageUnavailable instead.
        # Every call is bounded: the timeouts below apply unless the URL sets them (redis-py
        # lets URL options win), so a half-open connection raises instead of hanging.
        client_options: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT,
            "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
            "socket_keepalive": True,
            # A connection idle this long is PINGed before reuse; a dead one fails there,
            # before any script was sent.
            "health_check_interval": DEFAULT_HEALTH_CHECK_INTERVAL,
            "retry": Retry(NoBackoff(), 0),
        }
        if cluster:
            from redis.cluster import RedisCluster

            self._client: Any = RedisCluster.from_url(client_url, **client_options)
        else:
            self._client = redis.Redis.from_url(client_url, **client_options)
        self._global_keys = (f"{self.prefix}:{{{self.prefix}:global}}:ids", f"{self.prefix}:{{{self.prefix}:global}}:queues")
        self._counter_lock = threading.Lock()
        self.round_trips = 0

    # -- plumbing ------------------------------------------------------------------------------
    def _count(self, n: int = 1) -> None:
        with self._counter_lock:
            self.round_trips += n

    @contextmanager
    def _connection_errors(self) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, ReadOnlyError) as exc:
            raise StorageUnavailable(f"Redis unavailable: {exc}") from exc
        except ResponseError as exc:
            # Server states that pass (out of memory, failover, a script cache flushed twice in a
            # row) are unavailability; a script that refused its arguments wrote nothing and
            # says so (InvalidInput); anything else is a bug and surfaces as is.
            if isinstance(exc, NoScriptError) or str(exc).startswith(_TRANSIENT_ERRORS):
                raise StorageUnavailable(f"Redis unavailable: {exc}") from exc
            if str(exc).startswith(_INVALID_ARGUMENTS):
                raise InvalidInput(str(exc).split(" script: ", 1)[0][len(_INVALID_ARGUMENTS):].strip()) from exc
            if "DB index is out of range" in str(exc):
                # A configuration mistake in the URL (redis://host/99 on a 16-database server).
                raise InvalidInput(f"the Redis URL names a database this server does not have ({exc}); "
                                   f"use one in 0..(databases-1), usually 0..15", field="storage_url") from exc
            raise

    def _queue_base_checked(self, queue: str) -> str:
        # The name becomes the hash tag: anything outside the queue charset could change the slot.
        if not isinstance(queue, str) or not _QUEUE_NAME.match(queue):
            raise InvalidInput(f"invalid queue name {queue!r}", field="queue")
        return f"{self.prefix}:{{{queue}}}:"

    def _queue_call(self, name: str, queue: str, *args: Any) -> _Call:
        base = self._queue_base_checked(queue)
        return _Call(_SCRIPTS[name], tuple(base + z for z in _QUEUE_ZSETS), (base, *args))

    def _global_call(self, name: str, *args: Any) -> _Call:
        return _Call(_SCRIPTS[name], self._global_keys, args)

    def _load(self, scripts: Sequence[_Script]) -> None:
        for script in {s.name: s for s in scripts}.values():
            self._count()
            self._client.script_load(script.source)

    def _run(self, call: _Call) -> Any:
        """Send one script by SHA; on NOSCRIPT (server restarted, failed over or flushed its
        script cache) load it and send it again -- a NOSCRIPT reply means nothing ran."""
        with self._connection_errors():
            for loaded in (False, True):
                self._count()
                try:
                    return self._client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                except NoScriptError:
                    if loaded:
                        raise
                    self._load([call.script])

    def _run_pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        """Send many scripts in one round trip (not a transaction: each script is atomic on its
        own). Calls refused with NOSCRIPT are resent, in order, after loading their scripts."""
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        with self._connection_errors():
            for attempt in range(2):
                if not pending:
                    break
                pipe = self._client.pipeline(transaction=False)
                for i in pending:
                    call = calls[i]
                    pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                self._count()
                replies = pipe.execute(raise_on_error=False)
                missing = []
                for i, reply in zip(pending, replies):
                    if isinstance(reply, NoScriptError) and attempt == 0:
                        missing.append(i)
                    elif isinstance(reply, Exception):
                        raise reply
                    else:
                        results[i] = reply
                if missing:
                    self._load([calls[i].script for i in missing])
                pending = missing
        return results

    # -- lifecycle -----------------------------------------------------------------------------
    def migrate(self) -> None:
        """Redis has no schema: check the server and load the scripts (idempotent)."""
        with self._connection_errors():
            self._count()
            version = str(self._client.info("server").get("redis_version", "0"))
            if tuple(int(p) for p in version.split(".")[:2]) < _MIN_SERVER_VERSION:
                raise StorageUnavailable(f"Redis {version} is too old; rdq needs 5.0 or later")
            try:
                self._count()
                policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy")
            except ResponseError:  # CONFIG is often disabled on managed Redis
                policy = None
            if policy not in (None, "noeviction"):
                log.warning("maxmemory-policy is %r: Redis may evict task keys; use noeviction", policy)
            self._load(list(_SCRIPTS.values()))

    def close(self) -> None:
        self._client.close()

    def now(self) -> datetime:
        with self._connection_errors():
            self._count()
            seconds, micros = self._client.time()
        return from_micros(int(seconds) * 1_000_000 + int(micros))

    # -- producer side -------------------------------------------------------------------------
    def enqueue(self, tasks: Sequence[NewTask], *, connection: Any = None) -> list[EnqueueResult]:
        """Two round trips per batch: reserve the ids in the global index, then one pipeline of
        an enqueue script per queue (plus reads of conflicting tasks on their own queues)."""
        if connection is not None:
            raise TypeError("the Redis backend cannot join a caller's transaction")
        return self._enqueue(list(tasks))

    def _enqueue(self, tasks: list[NewTask]) -> list[EnqueueResult]:
        if not tasks:
            return []
        # Encode and validate everything before reserving ids, so a bad item cannot leave
        # reservations without tasks behind.
        encoded = [_enqueue_args(t) for t in tasks]
        for task in tasks:
            self._queue_base_checked(task.queue)
        owners = self._run(self._global_call("reserve_ids", *[v for t in tasks for v in (t.id, t.queue)]))
        results: list[EnqueueResult | None] = [None] * len(tasks)
        accepted: dict[str, list[int]] = {}
        conflicting: dict[str, list[int]] = {}
        for i, (task, owner) in enumerate(zip(tasks, owners)):
            if owner == task.queue:
                accepted.setdefault(task.queue, []).append(i)
            else:
                conflicting.setdefault(owner, []).append(i)

        calls: list[_Call] = []
        for queue, indexes in accepted.items():
            calls.append(self._queue_call("enqueue", queue, queue, *[a for i in indexes for a in encoded[i]]))
            # Re-assert the index and registry after creating: this ordering is what lets a
            # concurrent purge repair them (see _forget_ids).
            calls.append(self._global_call("reserve_ids", *[v for i in indexes for v in (tasks[i].id, queue)]))
        for owner, indexes in conflicting.items():
            calls.append(self._queue_call("read_tasks", owner, *[tasks[i].id for i in indexes]))
        replies = iter(self._run_pipeline(calls))

        for queue, indexes in accepted.items():
            created = next(replies)
            next(replies)
            for i, (flag, reply) in zip(indexes, created):
                results[i] = EnqueueResult(_task_from_reply(reply), created=flag == 1)
        dangling: list[tuple[int, str]] = []
        for owner, indexes in conflicting.items():
            for i, reply in zip(indexes, next(replies)):
                if reply:
                    results[i] = EnqueueResult(_task_from_reply(reply), created=False, conflict=True)
                else:
                    dangling.append((i, owner))
        if dangling:
            self._take_over(tasks, dangling, results)
        return results  # type: ignore[return-value]

    def _take_over(self, tasks: list[NewTask], dangling: list[tuple[int, str]], results: list[Any]) -> None:
        """An index entry names a queue that has no such task (an enqueue died between its two
        steps, or a purge between its steps): move the entry to the new queue if it is still
        the same, then enqueue again. Costs two more round trips, only in that case."""
        args = [v for i, owner in dangling for v in (tasks[i].id, owner, tasks[i].queue)]
        owners = self._run(self._global_call("take_over_ids", *args))
        retry = [i for (i, _), owner in zip(dangling, owners) if owner == tasks[i].queue]
        lost = [tasks[i].id for (i, _), owner in zip(dangling, owners) if owner != tasks[i].queue]
        if lost:
            raise TaskConflict(f"task id(s) {', '.join(lost)} are being enqueued on another queue concurrently")
        for i, result in zip(retry, self._enqueue([tasks[i] for i in retry])):
            results[i] = result

    # -- worker side ---------------------------------------------------------------------------
    def claim(self, queue: str, limit: int, lease_seconds: float) -> list[ClaimedTask]:
        if limit <= 0:
            return []
        # The token carries its queue so later fenced writes find the task's keys without a
        # lookup; the random part makes it unique even if Redis loses recent writes on restart.
        token_prefix = f"{queue}|{secrets.token_urlsafe(12)}."
        replies = self._run(self._queue_call("claim", queue, int(limit), _micros(lease_seconds), token_prefix))
        return [_claimed_from_reply(reply) for reply in replies]

    def extend_leases(self, refs: Sequence[ClaimRef], lease_seconds: float) -> dict[str, datetime]:
        by_queue, refused = _group_by_token_queue(refs)
        calls = [
            self._queue_call("extend", queue, _micros(lease_seconds), *[v for r in group for v in (r.task_id, r.claim_token)])
            for queue, group in by_queue.items()
        ]
        extended: dict[str, datetime] = {}
        for expiries, refused_ids in self._run_batch(calls):
            # The script reports each task's expiry as stored: never earlier than it was.
            for task_id, lease_until in zip(expiries[::2], expiries[1::2]):
                extended[task_id] = from_micros(int(lease_until))
            refused.extend(refused_ids)
        if refused:
            raise StaleClaim(refused)
        return extended

    def settle(self, settlements: Sequence[Settlement]) -> None:
        for s in settlements:
            Outcome(s.outcome)  # concatenated into the attempt JSON by the script: enum values only
            if s.status not in _SETTLED_STATUSES:
                raise InvalidInput(f"cannot settle task {s.task_id} as {s.status.value}", field="status")
        by_queue, refused = _group_by_token_queue(settlements)
        calls = [
            self._queue_call("settle", queue, *[a for s in group for a in _settle_args(s)])
            for queue, group in by_queue.items()
        ]
        for refused_ids in self._run_batch(calls):
            refused.extend(refused_ids)
        if refused:
            raise StaleClaim(refused)

    def release(self, refs: Sequence[ClaimRef]) -> None:
        by_queue, refused = _group_by_token_queue(refs)
        calls = [
            self._queue_call("release", queue, *[v for r in group for v in (r.task_id, r.claim_token)])
            for queue, group in by_queue.items()
        ]
        for refused_ids in self._run_batch(calls):
            refused.extend(refused_ids)
        if refused:
            raise StaleClaim(refused)

    def _run_batch(self, calls: list[_Call]) -> list[Any]:
        """One script alone, or one pipeline of scripts (one per queue): a single round trip."""
        if not calls:
            return []
        if len(calls) == 1:
            return [self._run(calls[0])]
        return self._run_pipeline(calls)

    # -- reaper side ---------------------------------------------------------------------------
    def find_expired_leases(self, limit: int, queue: str | None = None) -> list[ClaimedTask]:
        if limit <= 0:
            return []
        queues = [queue] if queue is not None else self._registered_queues()
        replies = self._run_batch([self._queue_call("expired_leases", q, int(limit)) for q in queues])
        expired = [_claimed_from_reply(r) for per_queue in replies for r in per_queue]
        expired.sort(key=lambda c: (c.lease_expires_at, c.task.id))
        return expired[:limit]

    # -- operator side -------------------------------------------------------------------------
    def get(self, task_id: str) -> Task | None:
        queue = self._queue_of(task_id)
        if queue is None:
            return None
        reply = self._run(self._queue_call("read_tasks", queue, task_id))[0]
        return _task_from_reply(reply) if reply else None

    def cancel(self, task_id: str) -> Task:
        queue = self._queue_of(task_id)
        if queue is None:
            raise TaskNotFound(task_id)
        outcome = self._run(self._queue_call("cancel", queue, task_id))
        if outcome[0] == "missing":
            raise TaskNotFound(task_id)
        task = _task_from_reply(outcome[1])
        if outcome[0] == "conflict":
            raise TaskConflict(f"task {task_id!r} is {task.status.value}, only a PENDING task can be cancelled")
        return task

    def list_dead(
        self, queue: str, *, limit: int, cursor: str | None = None, filter: DeadFilter = DeadFilter()
    ) -> DeadPage:
        after_score, after_id = "", ""
        if cursor is not None:
            micros, after_id = decode_dead_cursor(queue, cursor)
            after_score = str(micros)
        if limit <= 0:
            return DeadPage((), cursor)
        want = limit + 1  # one more than the page tells whether another page exists
        found: list[tuple[int, Task]] = []
        while True:
            exhausted, after_score, after_id, matches = self._run(
                self._queue_call("dead_page", queue, after_score, after_id, want - len(found), _DEAD_SCAN_BUDGET, *_filter_args(filter))
            )
            found.extend((int(float(score)), _task_from_reply(reply)) for score, reply in matches)
            if exhausted or len(found) >= want:
                break
        page = found[:limit]
        next_cursor = None
        if len(found) > limit:
            micros, last = page[-1]
            next_cursor = encode_dead_cursor(queue, from_micros(micros), last.id)
        return DeadPage(tuple(task for _, task in page), next_cursor)

    def redrive(self, queue: str, filter: DeadFilter) -> int:
        return len(self._apply_to_dead(queue, "redrive", filter))

    def purge_dead(self, queue: str, filter: DeadFilter) -> int:
        return len(self._apply_to_dead(queue, "purge", filter))

    def _apply_to_dead(self, queue: str, action: str, filter: DeadFilter) -> list[str]:
        """Redrive or purge in bounded script calls, walking the DLQ in (dead_at, id) order."""
        after_score, after_id, affected, queue_emptied = "", "", [], False
        while True:
            exhausted, after_score, after_id, ids, empty = self._run(
                self._queue_call("dead_apply", queue, action, after_score, after_id, _DEAD_SCAN_BUDGET, *_filter_args(filter))
            )
            affected.extend(ids)
            queue_emptied = empty == 1
            if exhausted:
                break
        if action == "purge" and affected:
            self._forget_ids(queue, affected, queue_emptied)
        return affected

    def stats(self, queue: str) -> QueueStats:
        now, pending, in_flight, dead, succeeded, cancelled, oldest = self._run(self._queue_call("stats", queue))
        now_us = int(now)
        oldest_age = 0.0
        if oldest is not None and oldest is not False and int(float(oldest)) <= now_us:
            oldest_age = (now_us - int(float(oldest))) / 1_000_000
        return QueueStats(queue, int(pending), int(in_flight), int(dead), int(succeeded), int(cancelled), oldest_age)

    def list_queues(self) -> list[str]:
        return sorted(self._registered_queues())

    def purge_succeeded(self, older_than_seconds: float, limit: int) -> int:
        deleted_total = 0
        for queue in sorted(self._registered_queues()):
            if deleted_total >= limit:
                break
            deleted, empty = self._run(
                self._queue_call("purge_finished", queue, _micros(older_than_seconds), limit - deleted_total)
            )
            if deleted:
                self._forget_ids(queue, deleted, empty == 1)
            deleted_total += len(deleted)
        return deleted_total

    # -- the global index and registry ---------------------------------------------------------
    def _queue_of(self, task_id: str) -> str | None:
        with self._connection_errors():
            self._count()
            return self._client.hget(self._global_keys[0], task_id)

    def _registered_queues(self) -> list[str]:
        with self._connection_errors():
            self._count()
            return list(self._client.smembers(self._global_keys[1]))

    def _forget_ids(self, queue: str, deleted_ids: list[str], queue_emptied: bool) -> None:
        """Drop the index entries of deleted tasks (and the registry entry of an emptied queue).

        The index lives in another slot, so this cannot be atomic with the deletion. An enqueue
        of the same id (or into the same queue) may run in between; enqueue re-asserts its entries
        *after* creating, and this re-checks *after* removing, so whichever runs last restores
        what is still needed.
        """
        self._run(self._global_call("unindex", queue, "1" if queue_emptied else "0", *deleted_ids))
        existing, empty = self._run(self._queue_call("existing", queue, *deleted_ids))
        if existing:
            self._run(self._global_call("reserve_ids", *[v for task_id in existing for v in (task_id, queue)]))
        elif queue_emptied and empty != 1:
            with self._connection_errors():
                self._count()
                self._client.sadd(self._global_keys[1], queue)


# -- encoding ----------------------------------------------------------------------------------

def _micros(seconds: float) -> int:
    return int(round(seconds * 1_000_000))


def _json(value: Any) -> str:
    # UTF-8 JSON with lone surrogates repaired: the same text every backend stores, and JSON
    # that Redis' cjson can decode (it rejects a lone "\ud800" escape).
    return storable_json(value)


def _enqueue_args(task: NewTask) -> tuple[Any, ...]:
    return (
        task.id,
        task.handler,
        _json(task.payload),
        _json(dict(task.headers)),
        "" if task.max_attempts is None else int(task.max_attempts),
        "" if task.backoff is None else _json(task.backoff.to_dict()),
        _micros(task.delay_seconds or 0.0),
        "" if task.run_at is None else to_micros(task.run_at),
    )


def _settle_args(s: Settlement) -> tuple[Any, ...]:
    error = storable_error(s.error)
    return (
        s.task_id,
        s.claim_token,
        s.outcome.value,
        s.status.value,
        _micros(s.retry_delay_seconds),
        _json(error.to_dict()) if error else "",
        error.type if error else "",
        _json(s.result) if s.status is TaskStatus.SUCCEEDED else "",
    )


def _filter_args(filter: DeadFilter) -> tuple[str, str, str]:
    return (
        _json(list(filter.ids)) if filter.ids is not None else "",
        filter.error_type or "",
        filter.handler or "",
    )


def _group_by_token_queue(refs: Sequence[Any]) -> tuple[dict[str, list[Any]], list[str]]:
    """Group fenced writes by the queue named in their claim token; a token that names no
    valid queue was not minted here and is refused without a round trip."""
    by_queue: dict[str, list[Any]] = {}
    refused: list[str] = []
    for ref in refs:
        queue, sep, _ = str(ref.claim_token).partition("|")
        if sep and _QUEUE_NAME.match(queue):
            by_queue.setdefault(queue, []).append(ref)
        else:
            refused.append(ref.task_id)
    return by_queue, refused


def _time(fields: dict[str, str], name: str) -> datetime | None:
    value = fields.get(name)
    return from_micros(int(value)) if value else None


def _task_from_reply(reply: list[Any]) -> Task:
    flat, attempts_flat = reply
    f = dict(zip(flat[::2], flat[1::2]))
    attempts = []
    for no, raw in sorted(zip(attempts_flat[::2], attempts_flat[1::2]), key=lambda pair: int(pair[0])):
        data = json.loads(raw)
        attempts.append(
            Attempt(
                attempt_no=int(no),
                outcome=Outcome(data["outcome"]),
                started_at=from_micros(int(data["started_at"])) if data.get("started_at") else None,
                finished_at=from_micros(int(data["finished_at"])) if data.get("finished_at") else None,
                error=ErrorInfo.from_dict(data.get("error")),
            )
        )
    return Task(
        id=f["id"],
        queue=f["queue"],
        handler=f["handler"],
        payload=json.loads(f["payload"]),
        status=TaskStatus(f["status"]),
        headers=json.loads(f.get("headers") or "{}"),
        attempt_count=int(f.get("attempt_count", 0)),
        redrive_count=int(f.get("redrive_count", 0)),
        max_attempts=int(f["max_attempts"]) if f.get("max_attempts") else None,
        backoff=Backoff.from_dict(json.loads(f["backoff"])) if f.get("backoff") else None,
        next_attempt_at=_time(f, "next_attempt_at"),
        lease_expires_at=_time(f, "lease_expires_at"),
        created_at=_time(f, "created_at"),
        updated_at=_time(f, "updated_at"),
        dead_at=_time(f, "dead_at"),
        result=json.loads(f["result"]) if "result" in f else None,
        last_error=ErrorInfo.from_dict(json.loads(f["last_error"])) if f.get("last_error") else None,
        attempts=tuple(attempts),
    )


def _claimed_from_reply(reply: list[Any]) -> ClaimedTask:
    flat = reply[0]
    f = dict(zip(flat[::2], flat[1::2]))
    return ClaimedTask(
        task=_task_from_reply(reply),
        claim_token=f["claim_token"],
        claimed_at=from_micros(int(f["claimed_at"])),
        lease_expires_at=from_micros(int(f["lease_expires_at"])),
    )
