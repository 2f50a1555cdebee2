-- ARGV: base, ids... Returns per id the task reply, or false when absent.

local out = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', task_key(ARGV[i])) == 1 then out[#out + 1] = task_reply(ARGV[i]) else out[#out + 1] = false end
end
return out
