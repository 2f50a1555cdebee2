-- ARGV: base, limit, lease_us, token_prefix, then the queue's flow policy ('' = none for each):
-- aging_us, max_in_flight, fair ('1' | '0'), concurrency_limit, concurrency overrides (a JSON
-- object of key -> limit), rate count, rate period_us; then the claimer's name ('' = none),
-- stored as each task's claimed_by in the same HSET as its claim (settle and release drop it).
-- The token is the prefix (random per call, minted by the client) plus the position in the
-- batch, so it is never reused.
-- A paused queue (its `paused` key, in the queue's slot) claims nothing: one EXISTS, read in
-- this same atomic step, so no claim that starts after a pause returned can take a task.
--
-- Order: lowest priority first, then next_attempt_at, then id (with aging: next_attempt_at +
-- priority x aging, then id), due tasks only, read from the claim lanes (see the prelude). Every
-- limit is checked here, in the claim's own atomic step: a task over a limit is skipped (left
-- PENDING, nothing spent) and the tasks behind it are still considered. A task of a key this
-- call already found full (or out of rate budget) costs one HMGET to pass over; finding a key
-- full costs its check. So a claim that comes back short has left no due task every limit allows
-- (docs/flow-control.md#progress), up to WALK_LIMIT entries passed over per call: a bound on one
-- script's run time, far above any head of blocked tasks the docs promise to walk past.

local limit = need_count(ARGV[2], 'limit')
local lease = need_number(ARGV[3], 'lease')
local token_prefix = need_string(ARGV[4], 'token prefix')
local aging, max_in_flight, conc_default, rate_count, rate_period
if ARGV[5] ~= '' then aging = need_number(ARGV[5], 'aging') end
if ARGV[6] ~= '' then max_in_flight = need_count(ARGV[6], 'max_in_flight') end
local fair = ARGV[7] == '1'
if ARGV[8] ~= '' then conc_default = need_count(ARGV[8], 'concurrency_limit') end
local overrides = {}
if ARGV[9] ~= '' then
  overrides = need_json(ARGV[9], 'concurrency overrides')
  if type(overrides) ~= 'table' then invalid('concurrency overrides must be a JSON object') end
  for key, n in pairs(overrides) do
    if type(key) ~= 'string' or type(n) ~= 'number' then invalid('concurrency overrides map keys to limits') end
  end
end
if ARGV[10] ~= '' then
  rate_count = need_count(ARGV[10], 'rate count')
  rate_period = need_number(ARGV[11], 'rate period')
end
local worker = ARGV[12] or ''
local limits_concurrency = conc_default ~= nil or next(overrides) ~= nil

if redis.call('EXISTS', BASE .. 'paused') == 1 then return {} end

local WALK_LIMIT = 100000
local now = now_us()
local now_text = us(now)
local lease_until = us(now + lease)
local plain = not limits_concurrency and not max_in_flight and not rate_count
-- Without limits every due entry is taken, so a lane read asks for exactly what may be taken.
local chunk = limit
if not plain then chunk = math.max(limit, 64) end

local out = {}
local skipped_total = 0
local in_flight = 0
if max_in_flight then in_flight = redis.call('ZCARD', INFLIGHT) end

-- A cursor over one lane's due entries in score order, or over one park's (the lane's tasks
-- parked behind `blocker`, a key of `kind`). The lane or park is left as it is until the end of
-- the script (taken and parked entries are removed then, in one command each), so the next read
-- starts after every entry read so far.
local function cursor(lane, park, kind, blocker)
  return {lane = lane, key = park and park_key(park) or lane_key(lane), park = park, kind = kind, blocker = blocker,
    priority = tonumber(string.sub(lane, 1, 1)), group = string.sub(lane, 3), buf = {}, pos = 1, read = 0,
    chunk = chunk, done = false, taken = {}, parked = {}}
end

local function head(c)
  if c.pos > #c.buf then
    if c.done then return nil end
    local got = redis.call('ZRANGEBYSCORE', c.key, '-inf', now_text, 'WITHSCORES', 'LIMIT', c.read, c.chunk)
    c.read = c.read + #got / 2
    c.buf, c.pos = {}, 1
    for j = 1, #got, 2 do c.buf[#c.buf + 1] = {got[j], tonumber(got[j + 1])} end
    if #c.buf < c.chunk then c.done = true end
    -- A read skips the `read` entries before it again: reads that double keep a long walk past
    -- blocked entries at O(n log n) instead of O(n^2 / chunk).
    c.chunk = math.min(c.chunk * 2, 4096)
    if #c.buf == 0 then return nil end
  end
  return c.buf[c.pos]
end

local function ranks_before(a, ca, b, cb)
  if aging then
    local ra, rb = a[2] + ca.priority * aging, b[2] + cb.priority * aging
    if ra ~= rb then return ra < rb end
  else
    if ca.priority ~= cb.priority then return ca.priority < cb.priority end
    if a[2] ~= b[2] then return a[2] < b[2] end
  end
  return bytes_le(a[1], b[1])
end

-- The cursor whose head comes first in claim order, or nil when every lane is drained. Cursors
-- are in lane-name order, so by priority: without aging, lanes of a higher priority number are
-- not even read while a lower one has a due task.
local full_keys, spent_rates = {}, {}

-- Whether concurrency key `ckey` has a free slot under the policy (found full: remembered).
local function key_has_room(ckey)
  if not limits_concurrency then return true end
  local n = overrides[ckey] or conc_default
  if not n then return true end
  if full_keys[ckey] then return false end
  if redis.call('ZCARD', key_in_flight(ckey)) >= n then
    full_keys[ckey] = true
    return false
  end
  return true
end

-- Whether rate key `rkey` has budget left in the window (found spent: remembered).
local function rate_has_room(rkey)
  if not rate_count then return true end
  if spent_rates[rkey] then return false end
  local log = rate_log(rkey)
  redis.call('ZREMRANGEBYSCORE', log, '-inf', us(now - rate_period))
  if redis.call('ZCARD', log) >= rate_count then
    spent_rates[rkey] = true
    return false
  end
  return true
end

local function park_has_room(c)
  if c.kind == 'c' then return key_has_room(c.blocker) end
  return rate_has_room(c.blocker)
end

local function first(cursors)
  local best, best_entry
  for _, c in ipairs(cursors) do
    if best and not aging and c.priority > best.priority then break end
    -- A park is read only while its key has room (it may fill during this claim).
    if not c.park or park_has_room(c) then
      local e = head(c)
      if e and (not best or ranks_before(e, c, best_entry, best)) then best, best_entry = c, e end
    end
  end
  return best
end

-- Nil when the task may start now under the policy; else what holds it back: 'c' or 'r' and the key.
local function blocked_by(held)
  local ckey, rkey = held[2], held[3]
  if ckey and not key_has_room(ckey) then return 'c', ckey end
  if rkey and not rate_has_room(rkey) then return 'r', rkey end
  return nil
end

local taken_ids = {}

local function take(c, id, held)
  local token = token_prefix .. (#out + 1)
  taken_ids[#taken_ids + 1] = id
  c.taken[#c.taken + 1] = id
  redis.call('HSET', task_key(id), 'status', 'IN_FLIGHT', 'claim_token', token, 'claimed_at', now_text,
    'claimed_by', worker, 'lease_expires_at', lease_until, 'updated_at', now_text)
  if held[2] then redis.call('ZADD', key_in_flight(held[2]), lease_until, id) end
  if held[3] and rate_count then
    local log = rate_log(held[3])
    redis.call('ZADD', log, now_text, token)
    redis.call('PEXPIRE', log, math.ceil(rate_period / 1000) + 1000)
  end
  out[#out + 1] = task_reply_without_history(id)
end

local stopped = false

-- Takes the next task the policy admits from `cursors`, in claim order; false when none is left
-- (or a queue-wide limit or WALK_LIMIT ends the claim).
local function take_next(cursors)
  while true do
    if max_in_flight and in_flight + #out >= max_in_flight then stopped = true end
    if stopped or skipped_total >= WALK_LIMIT then return false end
    local c = first(cursors)
    if not c then return false end
    local entry = c.buf[c.pos]
    local id = entry[1]
    c.pos = c.pos + 1
    local held = redis.call('HMGET', task_key(id), 'status', 'concurrency_key', 'rate_key')
    if held[1] ~= 'PENDING' then
      c.taken[#c.taken + 1] = id  -- a stale entry, dropped (a park may hold one after a re-index)
    else
      local kind, blocker = blocked_by(held)
      if not kind then
        take(c, id, held)
        return true
      end
      -- Parked behind the key that holds it back: later claims pass over it in one check
      -- while that key stays full, and read it again, in order, once the key has room.
      c.parked[#c.parked + 1] = {id, entry[2], park_of(kind, blocker, c.lane)}
      skipped_total = skipped_total + 1
    end
  end
end

local cursors = {}
for _, lane in ipairs(redis.call('ZRANGEBYSCORE', LANES, '-inf', now_text)) do cursors[#cursors + 1] = cursor(lane) end
for _, park in ipairs(redis.call('SMEMBERS', PARKS)) do
  local kind, blocker, lane = string.match(park, '^([cr]) (%S+) (%d:.*)$')
  if kind then cursors[#cursors + 1] = cursor(lane, park, kind, blocker) end
end
-- By priority first (`first` stops at the first cursor of a later priority), then lane, lanes
-- before their parks.
table.sort(cursors, function(a, b)
  if a.priority ~= b.priority then return a.priority < b.priority end
  if a.lane ~= b.lane then return bytes_le(a.lane, b.lane) end
  return (a.park or '') < (b.park or '')
end)

if not fair then
  while #out < limit and take_next(cursors) do end
else
  -- Round robin over the groups that have due tasks (byte order of the name, '' = no group),
  -- one task per group per turn, starting after the group the last claim served last.
  local by_group, names = {}, {}
  for _, c in ipairs(cursors) do
    if not by_group[c.group] then by_group[c.group] = {}; names[#names + 1] = c.group end
    table.insert(by_group[c.group], c)
  end
  table.sort(names, function(a, b) return a ~= b and bytes_le(a, b) end)
  local pointer_key = BASE .. 'fair_last'
  local last = redis.call('GET', pointer_key)
  local turn = {}
  if last then
    for _, name in ipairs(names) do if not bytes_le(name, last) then turn[#turn + 1] = name end end
    for _, name in ipairs(names) do if bytes_le(name, last) then turn[#turn + 1] = name end end
  else
    turn = names
  end
  local served
  while #out < limit and #turn > 0 and not stopped do
    local still = {}
    for _, name in ipairs(turn) do
      if #out >= limit then break end
      if take_next(by_group[name]) then
        still[#still + 1] = name
        served = name
      end
    end
    turn = still
  end
  if served then redis.call('SET', pointer_key, served) end
end

-- The index moves, one command per index (chunks of 500 members keep Lua's stack small).
local function each_chunk(ids, apply)
  for first = 1, #ids, 500 do apply({unpack(ids, first, math.min(first + 499, #ids))}) end
end
each_chunk(taken_ids, function(chunk)
  redis.call('ZREM', DUE, unpack(chunk))
  local scored = {}
  for _, id in ipairs(chunk) do scored[#scored + 1] = lease_until; scored[#scored + 1] = id end
  redis.call('ZADD', INFLIGHT, unpack(scored))
end)
local parks = {}
for _, c in ipairs(cursors) do
  for _, p in ipairs(c.parked) do
    c.taken[#c.taken + 1] = p[1]
    if not parks[p[3]] then parks[p[3]] = {} end
    local scored = parks[p[3]]
    scored[#scored + 1] = p[2]; scored[#scored + 1] = p[1]
  end
  if #c.taken > 0 then
    each_chunk(c.taken, function(chunk) redis.call('ZREM', c.key, unpack(chunk)) end)
    if c.park then forget_park_if_empty(c.park) else forget_lane_if_empty(c.lane) end
  elseif not c.park and c.done and c.read == 0 then
    forget_lane_if_empty(c.lane)  -- listed as due, holding none (scored 0 by an older version): scored at its head
  end
end
for park, scored in pairs(parks) do
  for first = 1, #scored, 1000 do
    redis.call('ZADD', park_key(park), unpack(scored, first, math.min(first + 999, #scored)))
  end
  redis.call('SADD', PARKS, park)
end
return out
