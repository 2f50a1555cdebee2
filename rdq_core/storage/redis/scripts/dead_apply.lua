-- ARGV: base, action ('redrive' | 'purge'), after_score, after_id, budget, ids_json, error_type,
-- handler. Applies the action to the matches found in one bounded scan (phase 1 is the scan).
-- Returns {exhausted, last_score, last_id, affected ids, queue_is_empty}.

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
