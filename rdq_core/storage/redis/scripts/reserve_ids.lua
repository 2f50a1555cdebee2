-- Global script: KEYS = ids index, queue registry.
-- ARGV: pairs id, queue. Reserves each id for its queue unless it is already taken; returns the
-- owning queue per id and registers the queues that own their ids.

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
