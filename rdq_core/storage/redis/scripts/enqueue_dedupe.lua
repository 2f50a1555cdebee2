-- Enqueue one task that has a dedupe_key, as one atomic step against every other enqueue of the
-- queue (docs/flow-control.md). ARGV: base, queue, dedupe_key, states (JSON array of statuses),
-- window_us ('' for none), mode (skip, replace, debounce), max_wait_us ('' for none), then the
-- fields of one task exactly as enqueue.lua takes them.
-- Returns {created 0|1, task reply, deduplicated 0|1}: the task holding the id (an idempotent
-- repeat); else the newest task of the key in one of the states or created within the window,
-- with the mode applied if it is PENDING (replace: payload and headers; debounce: the run time);
-- else the task, inserted.
-- dedupe_index(key) is a zset of the key's tasks by created_at; purges remove their entries
-- (delete_task), and an entry whose task is gone anyway is dropped when a match walks past it.

local MODES = {skip = true, replace = true, debounce = true}
local T = 8  -- the task's fields start here
local queue = need_string(ARGV[2], 'queue')
local dedupe_key = need_string(ARGV[3], 'dedupe_key')
local states = need_json(ARGV[4], 'dedupe states')
if type(states) ~= 'table' then invalid('dedupe states must be a JSON array') end
local matching = {}
for _, status in ipairs(states) do
  need_status_zset(status)
  matching[status] = true
end
local window = ARGV[5] ~= '' and need_number(ARGV[5], 'dedupe window') or nil
local mode = ARGV[6]
if not MODES[mode] then invalid('unknown dedupe mode ' .. tostring(mode)) end
local max_wait = ARGV[7] ~= '' and need_number(ARGV[7], 'dedupe max wait') or nil
local id = need_string(ARGV[T], 'task id')
need_string(ARGV[T + 1], 'handler')
need_string(ARGV[T + 2], 'payload')
need_string(ARGV[T + 3], 'headers')
if ARGV[T + 4] ~= '' then need_count(ARGV[T + 4], 'max_attempts') end
local delay = need_number(ARGV[T + 6], 'delay')
if ARGV[T + 7] ~= '' then need_number(ARGV[T + 7], 'run_at') end
need_priority(ARGV[T + 8])

local now = now_us()
local key = task_key(id)
if redis.call('EXISTS', key) == 1 then return {0, task_reply(id), 0} end

local due = now + delay
if ARGV[T + 7] ~= '' then due = tonumber(ARGV[T + 7]) end
local index = dedupe_index(dedupe_key)
for _, other in ipairs(redis.call('ZREVRANGE', index, 0, -1)) do
  local held = redis.call('HMGET', task_key(other), 'status', 'created_at')
  if not held[1] then
    redis.call('ZREM', index, other)
  elseif matching[held[1]] or (window and tonumber(held[2]) >= now - window) then
    if held[1] == 'PENDING' and mode == 'replace' then
      redis.call('HSET', task_key(other), 'payload', ARGV[T + 2], 'headers', ARGV[T + 3], 'updated_at', us(now))
    elseif held[1] == 'PENDING' and mode == 'debounce' then
      local next_at = due
      if max_wait then next_at = math.min(next_at, tonumber(held[2]) + max_wait) end
      redis.call('HSET', task_key(other), 'next_attempt_at', us(next_at), 'updated_at', us(now))
      unpark(other, task_lane(other))
      index_pending(other, us(next_at))
    end
    return {0, task_reply(other), 1}
  end
end

local fields = {'id', id, 'queue', queue, 'handler', ARGV[T + 1], 'payload', ARGV[T + 2], 'headers', ARGV[T + 3],
  'status', 'PENDING', 'attempt_count', '0', 'redrive_count', '0', 'next_attempt_at', us(due),
  'created_at', us(now), 'updated_at', us(now), 'dedupe_key', dedupe_key}
if ARGV[T + 4] ~= '' then fields[#fields + 1] = 'max_attempts'; fields[#fields + 1] = ARGV[T + 4] end
if ARGV[T + 5] ~= '' then fields[#fields + 1] = 'backoff'; fields[#fields + 1] = ARGV[T + 5] end
add_flow_fields(fields, T + 8)
redis.call('HSET', key, unpack(fields))
index_pending(id, us(due), lane_of(ARGV[T + 8], ARGV[T + 11]))
redis.call('ZADD', index, now, id)
if due <= now then redis.call('PUBLISH', ARGV[1] .. 'wake', queue) end  -- as enqueue.lua: wake idle workers
return {1, task_reply_without_history(id), 0}
