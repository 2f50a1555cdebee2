-- Keyset positions in sorted sets; included (after _checks.lua) before every script. A zset
-- orders its entries by (score, member), members of equal score by their raw bytes, so a
-- position (score, id) names a place in that order whether or not the entry is still there.
-- Finding it costs O(log n) commands, never a walk over the entries before it: pages, scans
-- and the audit trail stay as cheap on the millionth entry as on the first.

-- Byte-wise a <= b: Lua's own string comparison follows the server's collation locale, but
-- zsets order equal scores by raw bytes, and so must every keyset position.
local function bytes_le(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a <= #b
end

-- The rank of the first entry of `zset` at or after (score, id) (`strictly_after` = false) or
-- strictly after it (true). `score` must be a checked number (text). When the entry itself is
-- there with that score its rank answers at once; otherwise the entries sharing the score (ranks
-- [lo, hi)) are bisected by member bytes.
local function rank_of(zset, score, id, strictly_after)
  local held = redis.call('ZSCORE', zset, id)
  if held and tonumber(held) == tonumber(score) then
    local rank = redis.call('ZRANK', zset, id)
    if strictly_after then return rank + 1 end
    return rank
  end
  local lo = redis.call('ZCOUNT', zset, '-inf', '(' .. score)
  local hi = redis.call('ZCOUNT', zset, '-inf', score)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if bytes_le(redis.call('ZRANGE', zset, mid, mid)[1], id) then lo = mid + 1 else hi = mid end
  end
  return lo
end
