--[[ reap: return every lapsed job to the front of pending, uncounted.
  The at-least-once floor: no stall is counted, nothing is dead-lettered.
  KEYS[1] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] base      <p>:{q}: (job rows derive from it)
  ARGV[1] now_ms
  ARGV[2] limit     most jobs reaped by this call (1..1000)
  Returns the array of reaped ids.
]]
local active, pending, wake, head, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now_ms, limit = tonumber(ARGV[1]), tonumber(ARGV[2])

local BAND = 1099511627776

local ids = redis.call('ZRANGE', active, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
local out = {}
for _, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  redis.call('ZREM', active, id)
  local priority = redis.call('HGET', job, 'priority')
  if priority then
    local n = redis.call('INCR', head)
    redis.call('ZADD', pending, tonumber(priority) * BAND - n, id)
    redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', 'lease_expired')
    redis.call('LPUSH', wake, 1)
    out[#out + 1] = id
  end
end
return out
