--[[ release: return a claimed job to the front of its queue (or lane), uncounted.
  Fenced by the claim's token. Used for kombu requeue/reject(requeue=True), for
  a warm shutdown's unstarted deliveries, and for a batch that did not reach
  the consumer. A release is not a stall: `stalled` is unchanged.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] job       <p>:{q}:job:<id> (HASH)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[7] base      <p>:{q}: (lane keys derive from it)
  ARGV[1] id
  ARGV[2] token     the claim's id
  ARGV[3] unless_started  1: leave the claim as it is if its task has started
  Returns 0 OK, 1 NOT_FOUND (not active), 5 FENCED (active under another claim;
  untouched but counted in <p>:{q}:metrics:fenced, reason:release),
  6 STARTED (unless_started, and the claim's task has started; untouched),
  7 COMPLETED (an older claim completed the job: deleted and counted completed).
]]
--@include lane
--@include band
--@include live
local active, pending, wake, head, job = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, base = KEYS[6], KEYS[7]
local id, token, unless_started = ARGV[1], ARGV[2], ARGV[3] == '1'

-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000

if not redis.call('ZSCORE', active, id) then
  return 1
end
local row = redis.call('HMGET', job, 'deliveries', 'priority', 'group', 'started', 'completed',
  'claim')
local live = live_claim(row[1], row[6])
if live ~= token then
  redis.call('HINCRBY', base .. 'metrics:fenced', 'count', 1)
  redis.call('HINCRBY', base .. 'metrics:fenced', 'reason:release', 1)
  redis.call('PEXPIRE', base .. 'metrics:fenced', COUNTER_TTL_MS)
  return 5
end
if unless_started and (row[4] == row[1] or row[4] == token) then
  return 6
end
if row[5] then
  redis.call('ZREM', active, id)
  redis.call('DEL', job, base .. 'msg:' .. id)
  redis.call('HINCRBY', base .. 'metrics:completed', 'count', 1)
  redis.call('PEXPIRE', base .. 'metrics:completed', COUNTER_TTL_MS)
  return 7
end
local n = redis.call('INCR', head)
redis.call('ZREM', active, id)
redis.call('ZADD', lane_of(base, pending, lanes, row[3]), tonumber(row[2] or '0') * BAND - n, id)
redis.call('HSET', job, 'state', 'pending', 'owner', '')
redis.call('LPUSH', wake, 1)
return 0
