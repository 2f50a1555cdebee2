-- ARGV: base, start rank, budget. Puts the PENDING tasks at ranks [start, start + budget) of DUE
-- into their claim lanes (see the prelude) when they are not there: tasks made PENDING by a
-- version of rdq from before the lanes existed. Idempotent; `migrate` walks every queue with it.
-- Returns {next rank, exhausted 0|1, tasks indexed}.

local start = need_count(ARGV[2], 'start')
local budget = need_count(ARGV[3], 'budget')
local entries = redis.call('ZRANGE', DUE, start, start + budget - 1, 'WITHSCORES')
local indexed = 0
for j = 1, #entries, 2 do
  local id, score = entries[j], entries[j + 1]
  local lane = task_lane(id)
  if not redis.call('ZSCORE', lane_key(lane), id) then
    index_pending(id, score, lane)
    indexed = indexed + 1
  end
end
return {start + #entries / 2, #entries / 2 < budget and 1 or 0, indexed}
