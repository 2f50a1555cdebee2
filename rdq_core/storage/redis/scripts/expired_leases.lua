-- ARGV: base, limit. Read-only: IN_FLIGHT tasks whose lease expired by server time.

local limit = need_count(ARGV[2], 'limit')
local ids = redis.call('ZRANGEBYSCORE', INFLIGHT, '-inf', us(now_us()), 'LIMIT', 0, limit)
local out = {}
for _, id in ipairs(ids) do out[#out + 1] = task_reply_without_history(id) end
return out
