-- ARGV: base, after_score, after_id, want, budget, ids_json, error_type, handler.
-- Returns {exhausted, last_score, last_id, {{score, task}, ...}}.

local want, budget = need_count(ARGV[4], 'want'), need_count(ARGV[5], 'budget')
need_dead_selection(ARGV[2], ARGV[3], ARGV[6], ARGV[7], ARGV[8])
local matches, last_score, last_id, exhausted = scan_dead(ARGV[2], ARGV[3], want, budget, ARGV[6], ARGV[7], ARGV[8])
local out = {}
for i, m in ipairs(matches) do out[i] = {m[1], task_reply(m[2])} end
return {exhausted and 1 or 0, last_score, last_id, out}
