-- Document script: KEYS = the kind's hash and its lex index (see doc_put.lua). ARGV: after (''
-- = from the first key), limit. Read-only: up to `limit` documents whose keys come strictly
-- after `after` in byte order; O(log n + limit). Returns a flat list of key, '<version>:<body>'.

if type(ARGV[1]) ~= 'string' then invalid('after must be a string') end
local limit = need_count(ARGV[2], 'limit')

local out = {}
if limit == 0 then return out end
local start = '-'
if ARGV[1] ~= '' then start = '(' .. ARGV[1] end
local keys = redis.call('ZRANGEBYLEX', KEYS[2], start, '+', 'LIMIT', 0, limit)
for _, key in ipairs(keys) do
  local stored = redis.call('HGET', KEYS[1], key)
  if stored then  -- always: both are written by the same scripts
    out[#out + 1] = key
    out[#out + 1] = stored
  end
end
return out
