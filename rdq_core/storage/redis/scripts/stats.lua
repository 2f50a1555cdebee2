-- ARGV: base. Counts are ZCARDs; the oldest pending is the head of the due zset.
-- Returns {now_us, pending, in_flight, dead, succeeded, cancelled, oldest due score or false}.

local head = redis.call('ZRANGE', DUE, 0, 0, 'WITHSCORES')
return {us(now_us()), redis.call('ZCARD', DUE), redis.call('ZCARD', INFLIGHT), redis.call('ZCARD', DEAD),
  redis.call('ZCARD', SUCCEEDED), redis.call('ZCARD', CANCELLED), head[2] or false}
