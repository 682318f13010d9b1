--[[ give_back: return a wake marker a consumer popped (BRPOP) but did not claim for.
  Pushed only while the queue has claimable jobs, so a marker whose job another
  consumer claimed meanwhile is not left over.
  KEYS[1] wake      <p>:{q}:wake (LIST)
  KEYS[2] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[3] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  Returns 1 when the marker went back, 0 when nothing was claimable.
]]
local wake, pending, lanes = KEYS[1], KEYS[2], KEYS[3]

if redis.call('EXISTS', pending, lanes) == 0 then
  return 0
end
redis.call('LPUSH', wake, 1)
return 1
