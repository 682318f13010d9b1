--[[ bury: dead-letter one job into the morgue, with a reason. Fenced by the claim's token.
  Used for a payload that cannot be decoded, content the consumer does not accept,
  a message Celery will not run, and reject(requeue=False).
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[5] job       <p>:{q}:job:<id> (HASH)
  KEYS[6] failed    <p>:{q}:metrics:failed (HASH, fields count and reason:<reason>)
  KEYS[7] base      <p>:{q}: (lane keys and lanes derive from it)
  ARGV[1] id
  ARGV[2] token     the claim's id
  ARGV[3] reason    short machine-readable reason (malformed, rejected, ...)
  ARGV[4] error     human-readable detail
  ARGV[5] now_ms    '' takes the Redis server's clock
  Returns 0 OK (from the live claim it names, or from pending after that claim
  lapsed: the verdict is on the message), 1 NOT_FOUND (no row, already dead, or
  waiting for its ETA: a claim the server forgot with its last writes),
  5 FENCED (another claim holds the job now; untouched but counted in
  <p>:{q}:metrics:fenced, reason:bury), 7 COMPLETED (an older
  claim completed the job: deleted and counted completed, never dead-lettered).
]]
--@include unqueue
--@include clock
--@include live
local active, pending, wake, dead, job = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local failed, base = KEYS[6], KEYS[7]
-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000
local id, token, reason, err = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now_ms = clock(ARGV[5])

local row = redis.call('HMGET', job, 'state', 'deliveries', 'group', 'completed', 'claim')
if not row[1] or row[1] == 'dead' or row[1] == 'delayed' then
  return 1
end
if row[1] == 'active' then
  local live = live_claim(row[2], row[5])
  if live ~= token then
    redis.call('HINCRBY', base .. 'metrics:fenced', 'count', 1)
    redis.call('HINCRBY', base .. 'metrics:fenced', 'reason:bury', 1)
    redis.call('PEXPIRE', base .. 'metrics:fenced', COUNTER_TTL_MS)
    return 5
  end
  redis.call('ZREM', active, id)
  if row[4] then
    redis.call('DEL', job, base .. 'msg:' .. id)
    redis.call('HINCRBY', base .. 'metrics:completed', 'count', 1)
    redis.call('PEXPIRE', base .. 'metrics:completed', COUNTER_TTL_MS)
    return 7
  end
else
  unqueue(base, pending, wake, id, row[3])
end
redis.call('HSET', job, 'state', 'dead', 'owner', '', 'last_error', reason,
  'reason', reason, 'error', err, 'died_ms', now_ms)
redis.call('ZADD', dead, now_ms, id)
redis.call('HINCRBY', failed, 'count', 1)
redis.call('HINCRBY', failed, 'reason:' .. reason, 1)
redis.call('PEXPIRE', failed, COUNTER_TTL_MS)
return 0
