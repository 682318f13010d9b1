--[[ release: return a claimed job to the front of pending, uncounted.
  Used for kombu requeue/reject(requeue=True) and for a warm shutdown's
  unstarted deliveries. A release is not a stall: `stalled` is unchanged.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] job       <p>:{q}:job:<id> (HASH)
  ARGV[1] id
  ARGV[2] owner     worker identity holding the lease
  Returns 0 OK, 1 NOT_FOUND (not active), 2 LEASE_LOST (active under another owner; untouched).
]]
local active, pending, wake, head, job = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, owner = ARGV[1], ARGV[2]

local BAND = 1099511627776

if not redis.call('ZSCORE', active, id) then
  return 1
end
local row = redis.call('HMGET', job, 'owner', 'priority')
if row[1] ~= owner then
  return 2
end
local n = redis.call('INCR', head)
redis.call('ZREM', active, id)
redis.call('ZADD', pending, tonumber(row[2] or '0') * BAND - n, id)
redis.call('HSET', job, 'state', 'pending', 'owner', '')
redis.call('LPUSH', wake, 1)
return 0
