--[[ bury: dead-letter one claimed or pending job into the morgue, with a reason.
  Used for a payload that cannot be decoded and for reject(requeue=False).
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[4] job       <p>:{q}:job:<id> (HASH)
  KEYS[5] failed    <p>:{q}:metrics:failed (HASH, field count)
  KEYS[6] base      <p>:{q}: (lane keys derive from it)
  ARGV[1] id
  ARGV[2] reason    short machine-readable reason (malformed, rejected, ...)
  ARGV[3] error     human-readable detail
  ARGV[4] now_ms
  Returns 0 OK, 1 NOT_FOUND (no row, or already dead).
]]
local active, pending, dead, job, failed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local base = KEYS[6]
local id, reason, err, now_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local row = redis.call('HMGET', job, 'state', 'group')
if not row[1] or row[1] == 'dead' then
  return 1
end
redis.call('ZREM', active, id)
if row[2] then
  redis.call('ZREM', base .. 'g:' .. row[2] .. ':pending', id)
else
  redis.call('ZREM', pending, id)
end
redis.call('HSET', job, 'state', 'dead', 'owner', '', 'last_error', reason,
  'reason', reason, 'error', err, 'died_ms', now_ms)
redis.call('ZADD', dead, now_ms, id)
redis.call('HINCRBY', failed, 'count', 1)
return 0
