-- ARGV: base, limit, lease_us. Up to `limit` of this queue's events whose lease is absent or
-- past, in write order, each leased until now + lease in this same step (so no other take
-- returns it meanwhile); returns their JSON. Examines at most 1,000 events per call.
local limit = need_count(ARGV[2], 'limit')
local lease = need_number(ARGV[3], 'lease')
local now = now_us()
local taken, rank, examined = {}, 0, 0
while #taken < limit and examined < 1000 do
  local ids = redis.call('ZRANGE', OUTBOX, rank, rank + 99)
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    rank, examined = rank + 1, examined + 1
    if (tonumber(redis.call('HGET', OUTBOX_LEASES, id)) or 0) <= now then
      redis.call('HSET', OUTBOX_LEASES, id, us(now + lease))
      taken[#taken + 1] = redis.call('HGET', OUTBOX_EVENTS, id)
      if #taken >= limit then break end
    end
  end
end
return taken
