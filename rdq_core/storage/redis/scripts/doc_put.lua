-- Document script: KEYS = the kind's hash (document key -> '<version>:<body>') and its index, a
-- zset holding every key of the kind at score 0 (so ZRANGEBYLEX orders it by key bytes). ARGV:
-- document key, body (JSON text, stored verbatim), expected version ('' = insert only if the
-- document is absent; else replace only while its stored version is exactly this one).
-- Compare-and-set in one step: returns the new version (1 for an insert, expected + 1 after a
-- replace), or false when the condition did not hold and nothing was written.

local key = need_string(ARGV[1], 'document key')
local body = need_string(ARGV[2], 'document body')
local expected = ARGV[3]
if type(expected) ~= 'string' then invalid('expected version must be a string') end

local stored = redis.call('HGET', KEYS[1], key)
local version = 1
if expected == '' then
  if stored then return false end
else
  if not stored then return false end
  local current = string.match(stored, '^(%d+):')
  -- Compared as text: the client sends a plain decimal, so equal versions are equal strings.
  if current ~= expected then return false end
  version = tonumber(current) + 1
end

redis.call('HSET', KEYS[1], key, string.format('%.0f', version) .. ':' .. body)
redis.call('ZADD', KEYS[2], 0, key)
return version
