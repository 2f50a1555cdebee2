-- ARGV: base, status, after_score, after_id, want, budget, ids_json, error_type, handler,
-- history ('1' = with each task's attempts, '0' = without). Read-only: one bounded step of a
-- page of the status's tasks in (instant, id) order. Returns {exhausted, last_score, last_id,
-- {task, ...}}.

local zset = need_status_zset(ARGV[2])
local want, budget = need_count(ARGV[5], 'want'), need_count(ARGV[6], 'budget')
need_selection(ARGV[3], ARGV[4], ARGV[7], ARGV[8], ARGV[9])
local history = ARGV[10]
if history ~= '1' and history ~= '0' then invalid('history must be 0 or 1') end
local matches, last_score, last_id, exhausted = scan(zset, ARGV[3], ARGV[4], want, budget, ARGV[7], ARGV[8], ARGV[9])
local out = {}
for i, m in ipairs(matches) do
  if history == '1' then out[i] = task_reply(m[2]) else out[i] = task_reply_without_history(m[2]) end
end
return {exhausted and 1 or 0, last_score, last_id, out}
