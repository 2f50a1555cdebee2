-- ARGV: base, action ('redrive' | 'purge' on DEAD tasks, 'cancel' on PENDING ones), after_score,
-- after_id, budget, ids_json, error_type, handler, events ('1': a redrive writes
-- rdq.task.redriven per task, with the payload when '2'). Applies the action to the matches found in one
-- bounded scan (phase 1 is the scan), so each step is atomic on its own and never blocks the
-- server for long; the client walks the whole selection in such steps.
-- Returns {exhausted, last_score, last_id, affected ids, queue_is_empty}.

local ACTION_ZSETS = {redrive = DEAD, purge = DEAD, cancel = DUE}
local action = ARGV[2]
local zset = ACTION_ZSETS[action]
if not zset then invalid('unknown action ' .. tostring(action)) end
local budget = need_count(ARGV[5], 'budget')
need_selection(ARGV[3], ARGV[4], ARGV[6], ARGV[7], ARGV[8])
local matches, last_score, last_id, exhausted = scan(zset, ARGV[3], ARGV[4], budget, budget, ARGV[6], ARGV[7], ARGV[8])

local now = us(now_us())
local affected = {}
for _, m in ipairs(matches) do
  local id = m[2]
  local key = task_key(id)
  if action == 'cancel' then
    -- What cancel.lua does for one task. Being in the due zset means PENDING; the status is read
    -- again here, in the same script as the write, so a task a claim took is never cancelled.
    if redis.call('HGET', key, 'status') == 'PENDING' then
      unindex_pending(id)
      redis.call('HSET', key, 'status', 'CANCELLED', 'updated_at', now)
      redis.call('ZADD', CANCELLED, now, id)
      affected[#affected + 1] = id
    end
  elseif action == 'redrive' then
    -- History is kept: attempt numbers continue from MAX(attempt_no) on the next settle.
    redis.call('ZREM', DEAD, id)
    redis.call('HDEL', key, 'dead_at')
    redis.call('HINCRBY', key, 'redrive_count', 1)
    redis.call('HSET', key, 'status', 'PENDING', 'attempt_count', '0', 'next_attempt_at', now, 'updated_at', now)
    index_pending(id, now)
    if ARGV[9] == '1' or ARGV[9] == '2' then
      task_event(id, 'redriven', last_attempt_no(id), now, ARGV[9] == '2' and '1' or '0')
    end
    affected[#affected + 1] = id
  else
    redis.call('ZREM', DEAD, id)
    delete_task(id)
    affected[#affected + 1] = id
  end
end
return {exhausted and 1 or 0, last_score, last_id, affected, queue_is_empty() and 1 or 0}
