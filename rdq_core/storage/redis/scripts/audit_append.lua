-- Audit script: KEYS = the zset of every entry, the zset of the entry's queue (both scored by
-- the entry's time in µs; equal times ordered by id). ARGV: entry key base, id, actor, action,
-- queue, selection (JSON text, stored verbatim), count. Append-only: an id already kept is
-- refused. Stamps the entry with the server's clock and returns that time (µs since the epoch).

local base = need_string(ARGV[1], 'entry key base')
local id = need_string(ARGV[2], 'entry id')
for i, what in ipairs({'actor', 'action', 'queue', 'selection'}) do
  if type(ARGV[i + 2]) ~= 'string' then invalid(what .. ' must be a string') end
end
need_string(ARGV[5], 'queue')
need_count(ARGV[7], 'count')
local key = base .. id
if redis.call('EXISTS', key) == 1 then invalid('audit entry ' .. id .. ' already exists') end

local t = redis.call('TIME')
local at = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
redis.call('HSET', key, 'id', id, 'at', at, 'actor', ARGV[3], 'action', ARGV[4], 'queue', ARGV[5],
  'selection', ARGV[6], 'count', ARGV[7])
redis.call('ZADD', KEYS[1], at, id)
redis.call('ZADD', KEYS[2], at, id)
return at
