-- Global script: KEYS = ids index, queue registry.
-- ARGV: triples id, expected_owner, new_owner: compare-and-set of index entries whose task is
-- gone (an enqueue that died between reserving and creating). Returns the owner per id.

need_groups(1, 3, 'take_over_ids')
for i = 1, #ARGV, 3 do
  need_string(ARGV[i], 'task id')
  need_string(ARGV[i + 1], 'expected owner')
  need_string(ARGV[i + 2], 'new owner')
end
local owners = {}
for i = 1, #ARGV, 3 do
  local id, expected, new = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', KEYS[1], id) == expected then
    redis.call('HSET', KEYS[1], id, new)
    redis.call('SADD', KEYS[2], new)
  end
  owners[#owners + 1] = redis.call('HGET', KEYS[1], id)
end
return owners
