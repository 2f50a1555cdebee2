-- ARGV: base, then pairs id, token. Back to PENDING at its old next_attempt_at; no attempt.
-- A released task never started, so its claim leaves its rate key's log (the log's members are
-- claim tokens): a rate limit counts starts. Returns the refused ids.

need_groups(2, 2, 'release')

local now = now_us()
local plan, refused, seen = {}, {}, {}
for o = 2, #ARGV, 2 do
  local id, token = ARGV[o], ARGV[o + 1]
  local held = redis.call('HMGET', task_key(id), 'status', 'claim_token', 'next_attempt_at', 'concurrency_key', 'rate_key')
  if not seen[id] and held[1] == 'IN_FLIGHT' and held[2] == token and tonumber(held[3]) then
    seen[id] = true
    plan[#plan + 1] = {id, held[3], held[4], held[5], token}
  else
    refused[#refused + 1] = id
  end
end

for _, p in ipairs(plan) do
  local id, key = p[1], task_key(p[1])
  redis.call('ZREM', INFLIGHT, id)
  if p[3] then redis.call('ZREM', key_in_flight(p[3]), id) end
  if p[4] then redis.call('ZREM', rate_log(p[4]), p[5]) end
  redis.call('HDEL', key, 'claim_token', 'claimed_at', 'claimed_by', 'lease_expires_at')
  redis.call('HSET', key, 'status', 'PENDING', 'updated_at', us(now))
  index_pending(id, p[2])
end
return refused
