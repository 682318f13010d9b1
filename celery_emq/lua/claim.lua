--[[ claim: move up to `count` jobs from pending (and the fair lanes) to active, each leased.
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[5] head      <p>:{q}:head (STRING, head sequence)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[7] cursor    <p>:{q}:cursor (STRING, the lane served last)
  KEYS[8] base      <p>:{q}: (job rows and lane keys derive from it)
  ARGV[1] now_ms
  ARGV[2] lease_ms
  ARGV[3] owner     worker identity that will renew the leases
  ARGV[4] count     most jobs to claim (1..1000)
  ARGV[5] held      wake markers the caller already popped (BRPOP): 0 or 1
  ARGV[6] no_ack    1: the consumer never acks, so the job is deleted on claim
  Returns a flat array: id, payload, stalled, deliveries, ... per claimed job.
  With lanes, claims rotate one job at a time over the default lane and each
  group's lane (in name order), so no group can starve another.
]]
local pending, active, wake, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, cursor, base = KEYS[6], KEYS[7], KEYS[8]
local now_ms, lease_ms, owner = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local count, held, no_ack = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'

local ids = {}
if redis.call('EXISTS', lanes) == 0 then
  local popped = redis.call('ZPOPMIN', pending, count)
  for i = 1, #popped, 2 do
    ids[#ids + 1] = popped[i]
  end
else
  -- The rotation is: default lane (''), then each group in name order, around.
  local last = redis.call('GET', cursor) or ''
  local misses = 0
  while #ids < count and misses <= 1 do
    local nxt
    if last == '' then
      nxt = redis.call('ZRANGE', lanes, '-', '+', 'BYLEX', 'LIMIT', 0, 1)[1]
    else
      nxt = redis.call('ZRANGE', lanes, '(' .. last, '+', 'BYLEX', 'LIMIT', 0, 1)[1]
    end
    local lane = pending
    if nxt then
      lane = base .. 'g:' .. nxt .. ':pending'
      last = nxt
    else
      last = ''
    end
    local got = redis.call('ZPOPMIN', lane, 1)
    if got[1] then
      ids[#ids + 1] = got[1]
      misses = 0
    elseif nxt then
      redis.call('ZREM', lanes, nxt)
    else
      -- The default lane was empty: one more empty turn after it means every lane is.
      misses = misses + 1
    end
    if nxt and redis.call('EXISTS', lane) == 0 then
      redis.call('ZREM', lanes, nxt)
    end
  end
  redis.call('SET', cursor, last)
end

local out = {}
for _, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'payload', 'stalled')
  -- A row can be missing only when an expiring queue's keys timed out apart.
  if row[1] then
    local deliveries = redis.call('HINCRBY', job, 'deliveries', 1)
    if no_ack then
      redis.call('DEL', job)
    else
      redis.call('HSET', job, 'state', 'active', 'owner', owner, 'claimed_ms', now_ms)
      redis.call('ZADD', active, now_ms + lease_ms, id)
    end
    out[#out + 1] = id
    out[#out + 1] = row[1]
    out[#out + 1] = tonumber(row[2] or '0')
    out[#out + 1] = deliveries
  end
end
local claimed = #out / 4

if redis.call('ZCARD', pending) == 0 and redis.call('EXISTS', lanes) == 0 then
  -- Nothing left to order: drop the markers, sequences and cursor, so a
  -- drained queue (a reply queue, say) leaves no keys behind.
  redis.call('DEL', wake, seq, head, cursor)
else
  -- Keep the wake list in step with pending: one marker leaves per claimed job.
  local extra = claimed - held
  if extra > 0 then
    redis.call('RPOP', wake, extra)
  end
end
return out
