--[[ purge_dead: delete dead jobs from the morgue, by id.
  KEYS[1] dead      <p>:{q}:dead (ZSET)
  KEYS[2] base      <p>:{q}: (job rows derive from it)
  ARGV[1..] ids     dead job ids to delete (the caller sends at most 500)
  Returns the number of dead jobs deleted (ids not in the morgue are skipped).
]]
local dead, base = KEYS[1], KEYS[2]

local n = 0
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', dead, id) == 1 then
    redis.call('DEL', base .. 'job:' .. id, base .. 'msg:' .. id)
    n = n + 1
  end
end
return n
