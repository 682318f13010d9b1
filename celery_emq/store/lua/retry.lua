--[[ retry: bring dead jobs back from the morgue to the front of their queue or lane.
  The job starts a fresh budget: its stall count and its lapses before a start
  (`lapsed`) are reset; the history of stalls is kept. Its `enqueued_ms` becomes the
  retry's time, so a week-old job retried does not make the queue's oldest pending
  age jump to a week (nor fire a backlog alert).
  KEYS[1] dead      <p>:{q}:dead (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[6] base      <p>:{q}: (job rows, lane keys and metrics:<name> derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] whole     1: all or nothing (if any id is not dead, none is retried)
  ARGV[3..] ids     dead job ids to retry (the caller sends at most 500)
  Returns {retried, missing}: the ids that were dead and are pending again, in the
  order given (the first at the very front), and the ids that were not dead (with
  `whole`, retried is then empty).
]]
--@include lane
--@include band
--@include clock
local dead, pending, wake, head, lanes, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now_ms, whole = clock(ARGV[1]), ARGV[2] == '1'
local FIRST = 3

-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000

local missing = {}
for i = FIRST, #ARGV do
  local id = ARGV[i]
  local state = redis.call('HGET', base .. 'job:' .. id, 'state')
  if state ~= 'dead' or not redis.call('ZSCORE', dead, id) then
    missing[#missing + 1] = id
  end
end
if whole and #missing > 0 then
  return {{}, missing}
end

-- The first id of the batch takes the highest head number, so the batch keeps its order.
local top = 0
if #ARGV >= FIRST then
  top = redis.call('INCRBY', head, #ARGV - FIRST + 1)
end
local out = {}
for i = FIRST, #ARGV do
  local id = ARGV[i]
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'state', 'priority', 'group')
  if row[1] == 'dead' and redis.call('ZREM', dead, id) == 1 then
    local n = top - i + FIRST
    local lane = lane_of(base, pending, lanes, row[3])
    redis.call('ZADD', lane, tonumber(row[2] or '0') * BAND - n, id)
    redis.call('HSET', job, 'state', 'pending', 'stalled', 0, 'owner', '', 'retried_ms', now_ms,
      'enqueued_ms', now_ms)
    redis.call('HDEL', job, 'died_ms', 'lapsed')
    redis.call('LPUSH', wake, 1)
    redis.call('HINCRBY', base .. 'metrics:retried', 'count', 1)
    redis.call('PEXPIRE', base .. 'metrics:retried', COUNTER_TTL_MS)
    out[#out + 1] = id
  end
end
return {out, missing}
