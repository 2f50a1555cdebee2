-- Global script: KEYS = ids index, queue registry.
-- ARGV: queue, queue_is_empty, ids... Drops the ids' index entries that still point at queue
-- and, when the queue emptied, its registry entry.

local queue = need_string(ARGV[1], 'queue')
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then invalid('queue_is_empty must be 0 or 1') end
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == queue then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
if ARGV[2] == '1' then redis.call('SREM', KEYS[2], queue) end
return 1
