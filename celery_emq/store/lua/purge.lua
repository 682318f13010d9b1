--[[ purge: delete up to `limit` waiting jobs of a queue: pending, in its lanes, and
  delayed (kombu queue_purge,
  and the expiry of an x-expires queue once unused).
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] wake      <p>:{q}:wake (LIST)
  KEYS[3] seq       <p>:{q}:seq (STRING)
  KEYS[4] head      <p>:{q}:head (STRING)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[6] cursor    <p>:{q}:cursor (STRING)
  KEYS[7] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[8] base      <p>:{q}: (job rows and lane keys derive from it)
  KEYS[9] delayed   <p>:{q}:delayed (ZSET of jobs not yet due)
  KEYS[10] etas     <p>:{q}:etas (HASH, Celery task id -> its delayed jobs' ids)
  ARGV[1] limit     most jobs to delete in this call
  ARGV[2] expired   1: only if the queue expired (its expires key is gone)
  ARGV[3..] counters  with `expired`, the names of the queue's counters (metrics:<name>; a few)
  Returns the number of jobs deleted, -1 when `expired` was asked and the queue
  is still in use; the caller repeats while it equals limit.
  An expired queue left with no job at all (none pending, delayed, active or dead)
  loses its remaining keys too: counters, swept, migrated, etas and the ordering keys.
]]
--@include etas
local pending, wake, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lanes, cursor, expires, base = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local delayed, etas = KEYS[9], KEYS[10]
local limit, expired = tonumber(ARGV[1]), ARGV[2] == '1'
if expired and redis.call('EXISTS', expires) == 1 then
  return -1
end

local n = 0
local function drain(lane)
  local popped = redis.call('ZPOPMIN', lane, limit - n)
  for i = 1, #popped, 2 do
    redis.call('DEL', base .. 'job:' .. popped[i], base .. 'msg:' .. popped[i])
    n = n + 1
  end
end

drain(pending)
while n < limit do
  local group = redis.call('ZRANGE', lanes, 0, 0)[1]
  if not group then
    break
  end
  local lane = base .. 'g:' .. group .. ':pending'
  drain(lane)
  if redis.call('EXISTS', lane) == 0 then
    redis.call('ZREM', lanes, group)
  end
end
local claimable = n
if n < limit then
  local popped = redis.call('ZPOPMIN', delayed, limit - n)
  for i = 1, #popped, 2 do
    local job = base .. 'job:' .. popped[i]
    local task = redis.call('HGET', job, 'task')
    if task then
      unindex_eta(etas, task, popped[i])
    end
    redis.call('DEL', job, base .. 'msg:' .. popped[i])
    n = n + 1
  end
end
if redis.call('ZCARD', pending) == 0 and redis.call('EXISTS', lanes) == 0 then
  redis.call('DEL', wake, seq, head, cursor)
else
  redis.call('LTRIM', wake, 0, -(claimable + 1))
end
if redis.call('EXISTS', delayed) == 0 then
  redis.call('DEL', base .. 'soon')  -- nothing delayed: no due time to signal
end
if expired and redis.call('EXISTS', pending, lanes, delayed, base .. 'active', base .. 'dead') == 0 then
  local leftovers = {etas, base .. 'swept', base .. 'migrated'}
  for i = 3, #ARGV do
    leftovers[#leftovers + 1] = base .. 'metrics:' .. ARGV[i]
  end
  redis.call('DEL', unpack(leftovers))
end
return n
