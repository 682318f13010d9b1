--[[ purge_dead: delete dead jobs from the morgue, by id.
  KEYS[1] dead      <p>:{q}:dead (ZSET)
  KEYS[2] base      <p>:{q}: (job rows derive from it)
  ARGV[1] whole     1: all or nothing (if any id is not dead, none is deleted)
  ARGV[2..] ids     dead job ids to delete (the caller sends at most 500)
  Returns {deleted, missing}: how many dead jobs were deleted, and the ids that were
  not in the morgue (skipped; with `whole`, nothing is then deleted).
]]
local dead, base = KEYS[1], KEYS[2]
local whole = ARGV[1] == '1'
local FIRST = 2

local missing = {}
for i = FIRST, #ARGV do
  if not redis.call('ZSCORE', dead, ARGV[i]) then
    missing[#missing + 1] = ARGV[i]
  end
end
if whole and #missing > 0 then
  return {0, missing}
end

local n = 0
for i = FIRST, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', dead, id) == 1 then
    redis.call('DEL', base .. 'job:' .. id, base .. 'msg:' .. id)
    n = n + 1
  end
end
return {n, missing}
