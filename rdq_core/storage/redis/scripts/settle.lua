-- ARGV: base, the statuses that write a lifecycle event (comma-separated, '' = none), whether
-- events carry the payload ('1'/'0'), then per settlement: id, token, outcome, status, retry_delay_us, error_json,
-- error_type, result_json ('' = none), started_after_us (how long after the claim the handler
-- started; '' = it never ran: the claim's time). The error JSON is embedded in the attempt record, so it
-- is decoded (checked) first; the result JSON is stored verbatim. Returns the refused ids.
-- Phase 1 checks every item and its fence (token, IN_FLIGHT, lease expiry for LEASE_EXPIRED,
-- one settle per task within the batch) and numbers its attempt; phase 2 writes.

local OUTCOMES = {SUCCESS = true, RETRYABLE_FAILURE = true, PERMANENT_FAILURE = true, LEASE_EXPIRED = true, SNOOZED = true}
local SETTLED = {SUCCEEDED = true, PENDING = true, DEAD = true}
need_groups(4, 9, 'settle')
local event_statuses, with_payload = ',' .. ARGV[2] .. ',', ARGV[3]

local now = now_us()
local refused, plan, seen = {}, {}, {}
for o = 4, #ARGV, 9 do
  local id, token, outcome, status = ARGV[o], ARGV[o + 1], ARGV[o + 2], ARGV[o + 3]
  local error_json, error_type, result_json = ARGV[o + 5], ARGV[o + 6], ARGV[o + 7]
  need_string(id, 'task id')
  if not OUTCOMES[outcome] then invalid('unknown outcome for task ' .. id) end
  if not SETTLED[status] then invalid('cannot settle task ' .. id .. ' as ' .. tostring(status)) end
  if outcome == 'SNOOZED' and status ~= 'PENDING' then invalid('a snoozed task goes back to PENDING: ' .. id) end
  local delay = need_number(ARGV[o + 4], 'retry delay')
  local started_after = 0
  if ARGV[o + 8] ~= '' then started_after = need_number(ARGV[o + 8], 'started after') end
  if error_json ~= '' then
    local decoded = need_json(error_json, 'error')
    if type(decoded) ~= 'table' or type(decoded['type']) ~= 'string' then invalid('error must be an object with a type') end
  end
  local key = task_key(id)
  local held = redis.call('HMGET', key, 'status', 'claim_token', 'lease_expires_at', 'claimed_at', 'concurrency_key',
    'attempt_count', 'priority', 'group')
  local valid = not seen[id] and held[1] == 'IN_FLIGHT' and held[2] == token
  if valid and outcome == 'LEASE_EXPIRED' and (tonumber(held[3]) or 0) > now then valid = false end
  if valid then
    -- attempt_no = MAX(attempt_no) + 1 over the history, never derived from attempt_count.
    local attempt_no = last_attempt_no(id)
    local started_at = held[4] and us(math.min(tonumber(held[4]) + started_after, now)) or ''
    local spent = outcome == 'SNOOZED' and 0 or 1  -- a SNOOZED attempt spends no budget
    seen[id] = true
    plan[#plan + 1] = {id = id, key = key, status = status, delay = delay, error_json = error_json, ckey = held[5],
      attempt_count = (tonumber(held[6]) or 0) + spent, lane = lane_of(held[7], held[8]),
      error_type = error_type, result_json = result_json, attempt_no = attempt_no + 1,
      attempt = '{"outcome":"' .. outcome .. '","started_at":"' .. started_at .. '","finished_at":"' ..
        us(now) .. '","error":' .. (error_json ~= '' and error_json or 'null') .. '}'}
  else
    refused[#refused + 1] = id
  end
end

-- Phase 2: per task one history entry, one HDEL and one HSET of every field it changes; the
-- status indexes are written once per batch (variadic ZREM/ZADD), not once per task.
local at = us(now)
local left_in_flight, finished = {}, {}  -- finished: zset -> {score, id, ...}
for _, p in ipairs(plan) do
  local id, key = p.id, p.key
  redis.call('HSETNX', attempts_key(id), tostring(p.attempt_no), p.attempt)
  left_in_flight[#left_in_flight + 1] = id
  if p.ckey then redis.call('ZREM', key_in_flight(p.ckey), id) end
  redis.call('HDEL', key, 'claim_token', 'claimed_at', 'claimed_by', 'lease_expires_at', 'dead_at')
  local fields = {'status', p.status, 'updated_at', at, 'attempt_count', tostring(p.attempt_count)}
  if p.error_json ~= '' then
    fields[#fields + 1] = 'last_error'; fields[#fields + 1] = p.error_json
    fields[#fields + 1] = 'error_type'; fields[#fields + 1] = p.error_type
  end
  if p.status == 'PENDING' then
    local next_at = us(now + p.delay)
    fields[#fields + 1] = 'next_attempt_at'; fields[#fields + 1] = next_at
    index_pending(id, next_at, p.lane)
  elseif p.status == 'SUCCEEDED' then
    if p.result_json ~= '' then fields[#fields + 1] = 'result'; fields[#fields + 1] = p.result_json end
  else
    fields[#fields + 1] = 'dead_at'; fields[#fields + 1] = at
  end
  redis.call('HSET', key, unpack(fields))
  if p.status ~= 'PENDING' then
    local zset = STATUS_ZSETS[p.status]
    local into = finished[zset] or {}
    finished[zset] = into
    into[#into + 1] = at; into[#into + 1] = id
  end
end
-- (unpack passes at most a few thousand values: a batch is sent in chunks.)
for first = 1, #left_in_flight, 1000 do
  redis.call('ZREM', INFLIGHT, unpack(left_in_flight, first, math.min(first + 999, #left_in_flight)))
end
for zset, scored in pairs(finished) do
  for first = 1, #scored, 1000 do
    redis.call('ZADD', zset, unpack(scored, first, math.min(first + 999, #scored)))
  end
end
-- The events read the fields just written, so they come last.
for _, p in ipairs(plan) do
  if string.find(event_statuses, ',' .. p.status .. ',', 1, true) then
    task_event(p.id, string.lower(p.status), p.attempt_no, at, with_payload)
  end
end
return refused
