-- ARGV: base, limit, lease_us, token_prefix. Oldest due first; the token is the prefix (random
-- per call, minted by the client) plus the position in the batch, so it is never reused.
-- A paused queue (its `paused` key, in the queue's slot) claims nothing: one EXISTS, read in
-- this same atomic step, so no claim that starts after a pause returned can take a task.

local limit = need_count(ARGV[2], 'limit')
local lease = need_number(ARGV[3], 'lease')
local token_prefix = need_string(ARGV[4], 'token prefix')

if redis.call('EXISTS', BASE .. 'paused') == 1 then return {} end

local now = now_us()
local lease_until = us(now + lease)
local ids = redis.call('ZRANGEBYSCORE', DUE, '-inf', us(now), 'LIMIT', 0, limit)
local out = {}
for i, id in ipairs(ids) do
  redis.call('ZREM', DUE, id)
  local key = task_key(id)
  if redis.call('HGET', key, 'status') == 'PENDING' then
    redis.call('HSET', key, 'status', 'IN_FLIGHT', 'claim_token', token_prefix .. i, 'claimed_at', us(now),
      'lease_expires_at', lease_until, 'updated_at', us(now))
    redis.call('ZADD', INFLIGHT, lease_until, id)
    out[#out + 1] = task_reply_without_history(id)
  end
end
return out
