--[[ promote: make delayed jobs claimable once due (or at once, by Celery task id).
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] wake      <p>:{q}:wake (LIST)
  KEYS[3] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[4] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[5] delayed   <p>:{q}:delayed (ZSET, score = ETA ms)
  KEYS[6] etas      <p>:{q}:etas (HASH, Celery task id -> its delayed jobs' ids)
  KEYS[7] base      <p>:{q}: (job rows and lane keys derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] limit     most due jobs promoted by this call
  ARGV[3..] task ids  promote these delayed jobs now, due or not, marked `revoked`: they
            were revoked, and the worker that claims one discards it as Celery does a
            revoked task, even one that no longer remembers the revoke
  Several queues (one server only: a consumer's scan of every queue it waits on, in
  one call): the same seven keys again for each; the task ids apply to each.
  Returns {promoted, waiting, next_due} per queue, in KEYS order: how many jobs were
  promoted, 1 if the queue has jobs to claim (pending or in a lane) else 0, and in how
  many ms (on the server's clock) the earliest job still delayed is due (-1: none; 0:
  due, past the limit). A promoted job joins the tail of its queue or lane, in ETA order.
]]
--@include band
--@include etas
--@include lane
--@include promote
--@include clock
local limit, now_arg = tonumber(ARGV[2]), ARGV[1]

local now_ms
local function promote(g)
  local pending, wake, seq, lanes = KEYS[g + 1], KEYS[g + 2], KEYS[g + 3], KEYS[g + 4]
  local delayed, etas, base = KEYS[g + 5], KEYS[g + 6], KEYS[g + 7]
  local ids = {}
  for i = 3, #ARGV do
    -- Every delayed job of the task id goes now: the whole entry leaves the index.
    local listed = redis.call('HGET', etas, ARGV[i])
    if listed then
      for id in string.gmatch(listed, '%S+') do
        if redis.call('ZSCORE', delayed, id) then
          redis.call('HSET', base .. 'job:' .. id, 'revoked', 1)
          ids[#ids + 1] = id
        end
      end
      redis.call('HDEL', etas, ARGV[i])
    end
  end
  -- An idle consumer runs this after each wait: with nothing delayed, it reads no clock.
  if limit > 0 and redis.call('EXISTS', delayed) == 1 then
    now_ms = now_ms or clock(now_arg)
    local due = redis.call('ZRANGE', delayed, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
    for _, id in ipairs(due) do
      ids[#ids + 1] = id
    end
  end
  local n = 0
  for _, id in ipairs(ids) do
    if promote_one(base, delayed, etas, pending, lanes, seq, wake, id) then
      n = n + 1
    end
  end
  local waiting = 0
  if redis.call('EXISTS', pending, lanes) > 0 then
    waiting = 1
  end
  local next_due = -1
  if now_ms then
    local first = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
    if first[2] then
      next_due = math.max(0, tonumber(first[2]) - now_ms)
    end
  end
  return n, waiting, next_due
end

local out = {}
for g = 0, #KEYS - 7, 7 do
  local n, waiting, next_due = promote(g)
  out[#out + 1] = n
  out[#out + 1] = waiting
  out[#out + 1] = next_due
end
return out
