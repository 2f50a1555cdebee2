-- ARGV: base, lease_us, then pairs id, token. The new expiry is max(current, now + lease): an
-- extension never moves a lease earlier. Returns {{id, expiry_us, ...}, refused ids}.

local lease = need_number(ARGV[2], 'lease')
need_groups(3, 2, 'extend')

local now = now_us()
local wanted = now + lease
local plan, refused = {}, {}
for o = 3, #ARGV, 2 do
  local id, token = ARGV[o], ARGV[o + 1]
  local held = redis.call('HMGET', task_key(id), 'status', 'claim_token', 'lease_expires_at')
  if held[1] == 'IN_FLIGHT' and held[2] == token then
    plan[#plan + 1] = {id, math.max(tonumber(held[3]) or 0, wanted)}
  else
    refused[#refused + 1] = id
  end
end

local extended = {}
for _, p in ipairs(plan) do
  local id, lease_until = p[1], us(p[2])
  redis.call('HSET', task_key(id), 'lease_expires_at', lease_until, 'updated_at', us(now))
  redis.call('ZADD', INFLIGHT, lease_until, id)
  extended[#extended + 1] = id
  extended[#extended + 1] = lease_until
end
return {extended, refused}
