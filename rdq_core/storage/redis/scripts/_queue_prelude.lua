-- Included (after _checks.lua) before every queue script. KEYS = the queue's five zsets (due,
-- inflight, dead, succeeded, cancelled); ARGV[1] = the queue's key base (`P:{q}:`). Per-task keys
-- are built from that base, so they share the hash tag and therefore the slot. Numbers are
-- formatted with us(): Redis turns a Lua number into a string with 14 significant digits, which
-- would truncate microsecond times.

local DUE, INFLIGHT, DEAD, SUCCEEDED, CANCELLED = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local BASE = need_string(ARGV[1], 'key base')

local function us(n) return string.format('%.0f', n) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function task_key(id) return BASE .. 'task:' .. id end
local function attempts_key(id) return BASE .. 'attempts:' .. id end
-- The ids of one dedupe_key's tasks by created_at (enqueue_dedupe.lua).
local function dedupe_index(dedupe_key) return BASE .. 'dedupe:' .. dedupe_key end

-- A purge: the task's hash, its history and its entry in its dedupe key's index.
local function delete_task(id)
  local dedupe_key = redis.call('HGET', task_key(id), 'dedupe_key')
  if dedupe_key then redis.call('ZREM', dedupe_index(dedupe_key), id) end
  redis.call('DEL', task_key(id), attempts_key(id))
end

local function task_reply(id)
  return {redis.call('HGETALL', task_key(id)), redis.call('HGETALL', attempts_key(id))}
end

-- Claims and lease scans hand out tasks without their history (see the SPI): reading it would
-- make every claim cost per attempt row, and a freshly created task has none to read.
local function task_reply_without_history(id)
  return {redis.call('HGETALL', task_key(id)), {}}
end

-- The lifecycle-event outbox of this queue (rdq_core/events.py), in the queue's slot so a
-- settle or redrive script writes its events with the change: OUTBOX is a zset of event ids
-- scored by write order (OUTBOX_SEQ counts), OUTBOX_EVENTS their JSON, OUTBOX_LEASES the
-- instant (µs) a taken event becomes takeable again.
local OUTBOX, OUTBOX_EVENTS = BASE .. 'outbox', BASE .. 'outbox:events'
local OUTBOX_LEASES, OUTBOX_SEQ = BASE .. 'outbox:leases', BASE .. 'outbox:seq'

-- A queue with undelivered events is not empty: it stays in the registry the outbox is taken by.
local function queue_is_empty()
  for i = 1, 5 do
    if redis.call('ZCARD', KEYS[i]) > 0 then return false end
  end
  return redis.call('ZCARD', OUTBOX) == 0
end

-- Put one event (its JSON built from parts that are JSON already) unless its id is there.
local function outbox_put(id, event_type, queue, task_id, at, detail_json)
  if redis.call('HEXISTS', OUTBOX_EVENTS, id) == 1 then return end
  redis.call('HSET', OUTBOX_EVENTS, id, '{"id":' .. cjson.encode(id) .. ',"type":' .. cjson.encode(event_type) ..
    ',"queue":' .. cjson.encode(queue) .. ',"task_id":' .. (task_id and cjson.encode(task_id) or 'null') .. ',"at":"' .. at ..
    '","detail":' .. detail_json .. '}')
  redis.call('ZADD', OUTBOX, redis.call('INCR', OUTBOX_SEQ), id)
end

-- A task event (dead, succeeded, redriven) from the task's stored fields; the id is the task id,
-- the kind, the attempt number (a redrive: the new redrive count) and the task's created_at (µs),
-- so a task id reused after a purge names new events (rdq_core/events.py task_event_id).
local function task_event(task_id, kind, attempt_no, at, with_payload)
  local held = redis.call('HMGET', task_key(task_id), 'handler', 'redrive_count', 'last_error', 'payload', 'queue',
    'created_at')
  local error_json = (kind ~= 'succeeded' and held[3]) or 'null'
  local payload_json = (with_payload == '1' and held[4]) or 'null'
  local number = kind == 'redriven' and (held[2] or '0') or tostring(attempt_no)
  outbox_put(task_id .. ':' .. kind .. ':' .. number .. ':' .. (held[6] or '0'), 'rdq.task.' .. kind, held[5], task_id, at,
    '{"handler":' .. cjson.encode(held[1] or '') .. ',"attempt":' .. tostring(attempt_no) ..
    ',"redrive_count":' .. (held[2] or '0') .. ',"error":' .. error_json .. ',"payload":' .. payload_json .. '}')
end

-- MAX(attempt_no) over the task's history (0 for none).
local function last_attempt_no(task_id)
  local attempt_no = 0
  for _, no in ipairs(redis.call('HKEYS', attempts_key(task_id))) do
    attempt_no = math.max(attempt_no, tonumber(no) or 0)
  end
  return attempt_no
end

-- The zset that holds the tasks of a status (ordered by that status's instant, then id).
local STATUS_ZSETS = {PENDING = DUE, IN_FLIGHT = INFLIGHT, DEAD = DEAD, SUCCEEDED = SUCCEEDED, CANCELLED = CANCELLED}

local function need_status_zset(status)
  local zset = STATUS_ZSETS[status]
  if not zset then invalid('unknown status ' .. tostring(status)) end
  return zset
end

-- (score, id) strictly after the keyset position (after_score, after_id); '' = the start.
local function is_after(score, id, after_score, after_id)
  if after_score == '' then return true end
  local s, a = tonumber(score), tonumber(after_score)
  if s ~= a then return s > a end
  return not bytes_le(id, after_id)
end

-- Whether a task passes the filters ('' = any): its last error's type and its handler.
local function filter_matches(id, error_type, handler)
  if error_type == '' and handler == '' then return true end
  local held = redis.call('HMGET', task_key(id), 'error_type', 'handler')
  if error_type ~= '' and held[1] ~= error_type then return false end
  if handler ~= '' and held[2] ~= handler then return false end
  return true
end

-- The selection arguments (after_score, after_id, ids_json, error_type, handler), checked.
local function need_selection(after_score, after_id, ids_json, error_type, handler)
  if after_score ~= '' then need_number(after_score, 'cursor position') end
  if type(after_id) ~= 'string' then invalid('cursor id must be a string') end
  if ids_json ~= '' then
    local ids = need_json(ids_json, 'ids')
    if type(ids) ~= 'table' then invalid('ids must be a JSON array') end
    for _, id in ipairs(ids) do
      if type(id) ~= 'string' then invalid('ids must be strings') end
    end
  end
  if type(error_type) ~= 'string' or type(handler) ~= 'string' then invalid('filters must be strings') end
end

-- Up to `want` entries of `zset` after the position that match the filter, in (score, id) order,
-- examining at most `budget` entries. Returns matches {score, id}, the last examined position
-- and whether the zset was exhausted. The walk starts at the position's rank (rank_of), so a
-- page costs what it examines, however deep it is. Arguments are checked by need_selection.
local function scan(zset, after_score, after_id, want, budget, ids_json, error_type, handler)
  local matches, last_score, last_id = {}, after_score, after_id
  if ids_json ~= '' then
    local ids, wanted = {}, cjson.decode(ids_json)
    for _, id in ipairs(wanted) do ids[id] = true end
    local found = {}
    for id in pairs(ids) do
      local score = redis.call('ZSCORE', zset, id)
      if score and is_after(score, id, after_score, after_id) and filter_matches(id, error_type, handler) then
        found[#found + 1] = {score, id}
      end
    end
    table.sort(found, function(x, y)
      local a, b = tonumber(x[1]), tonumber(y[1])
      if a ~= b then return a < b end
      return x[2] ~= y[2] and bytes_le(x[2], y[2])
    end)
    for i = 1, math.min(want, #found) do matches[i] = found[i] end
    return matches, last_score, last_id, true
  end
  local rank = 0
  if after_score ~= '' then rank = rank_of(zset, after_score, after_id, true) end
  local examined = 0
  while #matches < want and examined < budget do
    local chunk = redis.call('ZRANGE', zset, rank, rank + math.min(100, budget - examined) - 1, 'WITHSCORES')
    if #chunk == 0 then return matches, last_score, last_id, true end
    for j = 1, #chunk, 2 do
      local id, score = chunk[j], chunk[j + 1]
      rank, examined = rank + 1, examined + 1
      last_score, last_id = score, id
      if filter_matches(id, error_type, handler) then
        matches[#matches + 1] = {score, id}
        if #matches >= want then break end
      end
    end
  end
  return matches, last_score, last_id, false
end

-- Flow control (docs/flow-control.md). Every PENDING task is in DUE (the listing index, by
-- next_attempt_at) and also in the claim lane of its priority and group, `BASE..'lane:<p>:<group>'`
-- (scored the same; <group> is '' for none), so a claim reads tasks in priority order without
-- walking past others. LANES lists the lanes that hold tasks, each scored at or before its
-- head (its earliest entry), so a claim reads only the lanes with a due head: a lane whose tasks
-- are all in the future costs a claim nothing. (Lanes written before that were scored 0: they
-- are read, then scored, by the next claim.)
-- Every write that puts a task into PENDING or takes it out goes through index_pending /
-- unindex_pending, which keep both together (index_pending also re-scores a task already there).
--
-- Parking (docs/redis-backend.md#parking): a claim that walks past a task because its
-- concurrency key is full or its rate key spent moves the task's lane entry into a *park* of that
-- key and lane, `BASE..'park:<c|r> <key> <lane>'` (same score), listed in PARKS. A later claim
-- reads a park like a lane, in the same order, but only while its key has room, so a full key's
-- backlog costs one check per claim, not one read per task. Every entry of a PENDING task is in
-- its lane or in one park; a stale entry (a task no longer PENDING) is dropped when read.
local LANES = BASE .. 'lanes'
local PARKS = BASE .. 'parks'
local FLOW_FIELDS = {'priority', 'concurrency_key', 'rate_key', 'group'}

local function need_priority(value)
  if value ~= '' and not string.match(value, '^%d$') then invalid('priority must be 0..9') end
end

-- Appends a new task's flow-control fields, ARGV[first..first + 3] in FLOW_FIELDS order, to its
-- HSET field list; only those set: a default task's hash is what it always was.
local function add_flow_fields(fields, first)
  for j, name in ipairs(FLOW_FIELDS) do
    local value = ARGV[first + j - 1]
    if value ~= '' and not (name == 'priority' and value == '0') then
      fields[#fields + 1] = name; fields[#fields + 1] = value
    end
  end
end

-- A lane's name: the priority's one digit, ':', the group ('' for none). Groups may hold ':' but
-- the digit never does, so the name splits unambiguously.
local function lane_of(priority, group)
  if not priority or priority == '' then priority = '0' end
  return priority .. ':' .. (group or '')
end

local function lane_key(lane) return BASE .. 'lane:' .. lane end

local function task_lane(id)
  local held = redis.call('HMGET', task_key(id), 'priority', 'group')
  return lane_of(held[1], held[2])
end

local function index_pending(id, score, lane)
  lane = lane or task_lane(id)
  redis.call('ZADD', DUE, score, id)
  redis.call('ZADD', lane_key(lane), score, id)
  local head = redis.call('ZSCORE', LANES, lane)
  if not head or tonumber(score) < tonumber(head) then redis.call('ZADD', LANES, score, lane) end
end

-- After entries left a lane: forgotten when empty, else scored at its new head.
local function forget_lane_if_empty(lane)
  local head = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('ZREM', LANES, lane)
  else
    redis.call('ZADD', LANES, head[2], lane)
  end
end

local function park_key(park) return BASE .. 'park:' .. park end

-- A park's name: kind ('c' concurrency key, 'r' rate key), the key and the lane, space-separated
-- (keys, groups and lanes hold no space).
local function park_of(kind, key, lane) return kind .. ' ' .. key .. ' ' .. lane end

local function forget_park_if_empty(park)
  if redis.call('EXISTS', park_key(park)) == 0 then redis.call('SREM', PARKS, park) end
end

-- Re-scoring a PENDING task (a debounce) puts it back in its lane: out of any park first.
local function unpark(id, lane)
  local held = redis.call('HMGET', task_key(id), 'concurrency_key', 'rate_key')
  for i, kind in ipairs({'c', 'r'}) do
    if held[i] then
      local park = park_of(kind, held[i], lane)
      if redis.call('ZREM', park_key(park), id) == 1 then forget_park_if_empty(park) end
    end
  end
end

local function unindex_pending(id, lane)
  lane = lane or task_lane(id)
  redis.call('ZREM', DUE, id)
  redis.call('ZREM', lane_key(lane), id)
  forget_lane_if_empty(lane)
  unpark(id, lane)
end

-- The IN_FLIGHT tasks of one concurrency key (scored by the lease expiry they were claimed with):
-- a claim counts them all, so a killed holder keeps its slot until the reaper settles its expired
-- lease, never less. Claims add, settles (the reaper's too) and releases remove, whatever the
-- policy, so a limit set later counts every holder.
local function key_in_flight(concurrency_key) return BASE .. 'conc:' .. concurrency_key end
-- The claim times (µs) of one rate key within the last period (members: claim tokens).
local function rate_log(rate_key) return BASE .. 'rate:' .. rate_key end
