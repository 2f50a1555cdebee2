-- ARGV: base, then event ids. Deletes those of this queue's events; returns how many there were.
local removed = 0
for i = 2, #ARGV do
  removed = removed + redis.call('ZREM', OUTBOX, ARGV[i])
  redis.call('HDEL', OUTBOX_EVENTS, ARGV[i])
  redis.call('HDEL', OUTBOX_LEASES, ARGV[i])
end
return removed
