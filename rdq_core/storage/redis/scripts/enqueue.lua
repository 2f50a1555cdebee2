-- ARGV: base, queue, then per task: id, handler, payload, headers, max_attempts, backoff,
-- delay_us, run_at_us ('' for none), priority, concurrency_key, rate_key, group ('' for none).
-- An existing id is returned untouched (idempotency).
-- Returns per task {created 0|1, task reply}.
-- Creating a due task PUBLISHes the queue name on base..'wake' (the queue's slot), once per
-- call, to wake idle workers.

need_string(ARGV[2], 'queue')
need_groups(3, 12, 'enqueue')
for o = 3, #ARGV, 12 do
  need_string(ARGV[o], 'task id')
  need_string(ARGV[o + 1], 'handler')
  need_string(ARGV[o + 2], 'payload')
  need_string(ARGV[o + 3], 'headers')
  if ARGV[o + 4] ~= '' then need_count(ARGV[o + 4], 'max_attempts') end
  need_number(ARGV[o + 6], 'delay')
  if ARGV[o + 7] ~= '' then need_number(ARGV[o + 7], 'run_at') end
  need_priority(ARGV[o + 8])
end

local now = now_us()
local queue = ARGV[2]
local out = {}
local woken = false
for o = 3, #ARGV, 12 do
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
    add_flow_fields(fields, o + 8)
    redis.call('HSET', key, unpack(fields))
    index_pending(id, us(next_at), lane_of(ARGV[o + 8], ARGV[o + 11]))
    out[#out + 1] = {1, task_reply_without_history(id)}
    woken = woken or next_at <= now
  end
end
if woken then redis.call('PUBLISH', ARGV[1] .. 'wake', queue) end
return out
