-- ARGV: base, queue, then per event: id, type, detail JSON. Events that are not a task's (an
-- operation's end), stamped with the server clock; an id already there is kept.
need_groups(3, 3, 'outbox_put')
local at = us(now_us())
for o = 3, #ARGV, 3 do
  need_json(ARGV[o + 2], 'detail')
  outbox_put(need_string(ARGV[o], 'event id'), need_string(ARGV[o + 1], 'event type'), ARGV[2], nil, at, ARGV[o + 2])
end
return 0
