-- ARGV: base, ids... Which of the ids exist, and whether the queue holds anything (used after a
-- deletion to repair an index entry a concurrent enqueue may still need; see _forget_ids).

local existing = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', task_key(ARGV[i])) == 1 then existing[#existing + 1] = ARGV[i] end
end
return {existing, queue_is_empty() and 1 or 0}
