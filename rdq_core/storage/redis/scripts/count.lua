-- ARGV: base, status, after_score, after_id, budget, ids_json, error_type, handler. Read-only.
-- Without a filter the count is the status zset's size (exhausted at once); with one, one bounded
-- step of the walk. Returns {exhausted, last_score, last_id, matches counted in this step}.

local zset = need_status_zset(ARGV[2])
local budget = need_count(ARGV[5], 'budget')
need_selection(ARGV[3], ARGV[4], ARGV[6], ARGV[7], ARGV[8])
if ARGV[3] == '' and ARGV[6] == '' and ARGV[7] == '' and ARGV[8] == '' then
  return {1, '', '', redis.call('ZCARD', zset)}
end
local matches, last_score, last_id, exhausted = scan(zset, ARGV[3], ARGV[4], budget, budget, ARGV[6], ARGV[7], ARGV[8])
return {exhausted and 1 or 0, last_score, last_id, #matches}
