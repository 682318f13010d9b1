--[[ claim: move up to `count` jobs from pending (and the fair lanes) to active, each leased.
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[5] head      <p>:{q}:head (STRING, head sequence)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[7] cursor    <p>:{q}:cursor (STRING, the lane served last)
  KEYS[8] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[9] base      <p>:{q}: (job rows and lane keys derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] lease_ms
  ARGV[3] owner     worker identity that will renew the leases
  ARGV[4] count     most jobs to claim (1..1000)
  ARGV[5] held      wake markers the caller already popped (BRPOP): 0 or 1
  ARGV[6] ttl_ms    > 0 for an x-expires queue: a claim is a use, so the queue lives on
  Returns a flat array: id, message, stalled, deliveries, revoked, ... per claimed job
  (the message as stored, see celery_emq/codec.py; revoked is 1 for a delayed job
  promoted by a revoke, else 0).
  The delivery count is the claim's fencing token: every later settle names it.
  With lanes, claims rotate one job at a time over the default lane and each
  group's lane (in name order), so no group can starve another.
]]
local pending, active, wake, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, cursor, expires, base = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local lease_ms, owner = tonumber(ARGV[2]), ARGV[3]
local count, held, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now_ms = tonumber(ARGV[1])
if not now_ms then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
if ttl_ms > 0 then
  redis.call('SET', expires, 1, 'PX', ttl_ms)
end

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
  local row = redis.call('HMGET', job, 'state', 'stalled', 'payload', 'revoked')
  -- A row can be missing only when a foreign writer deleted it: skip the id.
  if row[1] then
    -- Rows written before messages had a key of their own hold it as `payload`.
    local message = redis.call('GET', base .. 'msg:' .. id) or row[3] or ''
    local deliveries = redis.call('HINCRBY', job, 'deliveries', 1)
    redis.call('HSET', job, 'state', 'active', 'owner', owner, 'claimed_ms', now_ms)
    redis.call('ZADD', active, now_ms + lease_ms, id)
    out[#out + 1] = id
    out[#out + 1] = message
    out[#out + 1] = tonumber(row[2] or '0')
    out[#out + 1] = deliveries
    out[#out + 1] = row[4] and 1 or 0
  end
end
local claimed = #out / 5

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
