--[[ purge: delete up to `limit` pending jobs of a queue (kombu queue_purge).
  KEYS[1] pending   <p>:{q}:pending (ZSET)
  KEYS[2] wake      <p>:{q}:wake (LIST)
  KEYS[3] jobs      <p>:{q}:job: (prefix of job rows, same hash tag)
  KEYS[4] seq       <p>:{q}:seq (STRING)
  KEYS[5] head      <p>:{q}:head (STRING)
  ARGV[1] limit     most jobs to delete in this call
  Returns the number of jobs deleted; the caller repeats while it equals limit.
]]
local pending, wake, jobs, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local limit = tonumber(ARGV[1])

local popped = redis.call('ZPOPMIN', pending, limit)
local n = 0
for i = 1, #popped, 2 do
  redis.call('DEL', jobs .. popped[i])
  n = n + 1
end
if redis.call('ZCARD', pending) == 0 then
  redis.call('DEL', wake, seq, head)
else
  redis.call('LTRIM', wake, 0, -(n + 1))
end
return n
