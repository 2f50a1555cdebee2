-- ARGV: base, id. Returns {'missing'} | {'conflict', task} | {'cancelled', task}.

local id = need_string(ARGV[2], 'task id')
local key = task_key(id)
local status = redis.call('HGET', key, 'status')
if not status then return {'missing'} end
if status ~= 'PENDING' then return {'conflict', task_reply(id)} end
local now = us(now_us())
unindex_pending(id)
redis.call('HSET', key, 'status', 'CANCELLED', 'updated_at', now)
redis.call('ZADD', CANCELLED, now, id)
return {'cancelled', task_reply(id)}
