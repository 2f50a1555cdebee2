-- Argument checks shared by every script (queue-scoped or global); included before each one.
--
-- Redis does not roll back a script that fails half way: the writes made before the error stay.
-- So every script that writes runs in two phases. Phase 1 reads and checks everything -- the
-- argument count, every number, enum value and JSON text it will decode or embed, every fence
-- (token, status, lease) -- and plans the writes; a bad argument raises `RDQ_INVALID ...`
-- (InvalidInput in Python) while nothing has been written yet. Phase 2 only applies the plan,
-- with commands that cannot fail on checked input. Payload, headers, backoff and result JSON are
-- stored verbatim and never decoded by a script (decoding up to a MiB per batch would stall the
-- server), so they cannot make a script fail; the client encodes them.

local function invalid(message) error({err = 'RDQ_INVALID ' .. message}) end

local function need_string(value, what)
  if type(value) ~= 'string' or value == '' then invalid(what .. ' must be a non-empty string') end
  return value
end

local function need_number(value, what)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then invalid(what .. ' must be a finite number') end
  return n
end

local function need_count(value, what)
  local n = need_number(value, what)
  if n < 0 or n ~= math.floor(n) then invalid(what .. ' must be a whole number >= 0') end
  return n
end

-- ARGV[first..] must hold whole groups of `size` values.
local function need_groups(first, size, what)
  if #ARGV < first - 1 or (#ARGV - first + 1) % size ~= 0 then
    invalid(what .. ': expected groups of ' .. size .. ' arguments, got ' .. (#ARGV - first + 1))
  end
end

local function need_json(text, what)
  local ok, value = pcall(cjson.decode, text)
  if not ok then invalid(what .. ' is not valid JSON') end
  return value
end
