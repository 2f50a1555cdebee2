-- Document script: KEYS = the kind's hash and its lex index (see doc_put.lua). ARGV: document
-- key, expected version. Deletes the document from both only while its stored version is still
-- the expected one; returns 1 when it did, 0 otherwise (nothing written).

local key = need_string(ARGV[1], 'document key')
local expected = need_string(ARGV[2], 'expected version')

local stored = redis.call('HGET', KEYS[1], key)
if not stored or string.match(stored, '^(%d+):') ~= expected then return 0 end
redis.call('HDEL', KEYS[1], key)
redis.call('ZREM', KEYS[2], key)
return 1
