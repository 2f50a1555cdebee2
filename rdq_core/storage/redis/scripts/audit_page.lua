-- Audit script: KEYS = the zset to read (every entry, or one queue's). ARGV: entry key base,
-- before_score ('' = from the newest), before_id, limit. Read-only: up to `limit` entries
-- strictly before (before_score, before_id), newest first; O(log n + limit). Returns the
-- entries' hashes (flat field, value lists).

local base = need_string(ARGV[1], 'entry key base')
if ARGV[2] ~= '' then need_number(ARGV[2], 'cursor position') end
if type(ARGV[3]) ~= 'string' then invalid('cursor id must be a string') end
local limit = need_count(ARGV[4], 'limit')

local stop = redis.call('ZCARD', KEYS[1])
if ARGV[2] ~= '' then stop = rank_of(KEYS[1], ARGV[2], ARGV[3], false) end
local out = {}
if limit > 0 and stop > 0 then
  local ids = redis.call('ZRANGE', KEYS[1], math.max(0, stop - limit), stop - 1)
  for i = #ids, 1, -1 do out[#out + 1] = redis.call('HGETALL', base .. ids[i]) end
end
return out
