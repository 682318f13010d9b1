--[[ reap: return every lapsed job to the front of its queue (or lane), uncounted.
  The at-least-once floor: no stall is counted, nothing is dead-lettered.
  KEYS[1] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[6] base      <p>:{q}: (job rows and lane keys derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] limit     most jobs reaped by this call (1..1000)
  A job whose task never started under the lapsed claim has `lapsed` counted (so
  the next claim takes it alone, see claim.lua); the reap dead-letters nothing.
  Returns the array of reaped ids. A job an older claim completed (its ack was
  fenced) is deleted and counted completed instead, and not returned. A batch keeps its order (earliest lapse first)
  at the front of the queue.
]]
--@include band
--@include clock
--@include live
local active, pending, wake, head, lanes, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local limit = tonumber(ARGV[2])
local now_ms = clock(ARGV[1])

-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000

local ids = redis.call('ZRANGE', active, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
-- Front-of-queue scores count down from the head sequence: the first of the
-- batch takes the highest number, so it stays first.
local top = 0
if #ids > 0 then
  top = redis.call('INCRBY', head, #ids)
end
local out = {}
for i, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  redis.call('ZREM', active, id)
  local row = redis.call('HMGET', job, 'state', 'group', 'completed', 'priority', 'started',
    'deliveries', 'claim')
  local token = live_claim(row[6], row[7])
  if row[3] then
    -- An older claim completed the job (its ack was fenced): done, not run again.
    redis.call('DEL', job, base .. 'msg:' .. id)
    redis.call('HINCRBY', base .. 'metrics:completed', 'count', 1)
    redis.call('PEXPIRE', base .. 'metrics:completed', COUNTER_TTL_MS)
  elseif row[1] then
    local lane = pending
    if row[2] and row[2] ~= '' then
      lane = base .. 'g:' .. row[2] .. ':pending'
      redis.call('ZADD', lanes, 0, row[2])
    end
    redis.call('ZADD', lane, tonumber(row[4] or '0') * BAND - (top - i + 1), id)
    redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', 'lease_expired')
    if row[5] ~= row[6] and row[5] ~= token then
      redis.call('HINCRBY', job, 'lapsed', 1)
    end
    redis.call('LPUSH', wake, 1)
    out[#out + 1] = id
  end
end
return out
