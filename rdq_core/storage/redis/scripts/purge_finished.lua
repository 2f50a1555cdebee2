-- ARGV: base, older_than_us, limit. Deletes SUCCEEDED then CANCELLED tasks last updated before
-- now - older_than. Returns {deleted ids, queue_is_empty}.

local older_than = need_number(ARGV[2], 'older_than')
local limit = need_count(ARGV[3], 'limit')
local cutoff = '(' .. us(now_us() - older_than)
local deleted = {}
for _, zset in ipairs({SUCCEEDED, CANCELLED}) do
  if #deleted >= limit then break end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', zset, '-inf', cutoff, 'LIMIT', 0, limit - #deleted)) do
    redis.call('ZREM', zset, id)
    delete_task(id)
    deleted[#deleted + 1] = id
  end
end
return {deleted, queue_is_empty() and 1 or 0}
