--[[ claim: move up to `count` jobs from pending to active, each with a lease.
  KEYS[1] pending   <p>:{q}:pending (ZSET)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] jobs      <p>:{q}:job: (prefix of job rows, same hash tag)
  KEYS[5] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[6] head      <p>:{q}:head (STRING, head sequence)
  ARGV[1] now_ms
  ARGV[2] lease_ms
  ARGV[3] owner     worker identity that will renew the leases
  ARGV[4] count     most jobs to claim (1..1000)
  ARGV[5] held      wake markers the caller already popped (BRPOP): 0 or 1
  ARGV[6] no_ack    1: the consumer never acks, so the job is deleted on claim
  Returns a flat array: id, payload, stalled, deliveries, ... per claimed job.
]]
local pending, active, wake, jobs, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now_ms, lease_ms, owner = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local count, held, no_ack = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'

local out = {}
local claimed = 0
local popped = redis.call('ZPOPMIN', pending, count)
for i = 1, #popped, 2 do
  local id = popped[i]
  local job = jobs .. id
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
    claimed = claimed + 1
  end
end
if redis.call('ZCARD', pending) == 0 then
  -- Nothing left to order: drop the markers and sequences, so a drained
  -- queue (a reply queue, say) leaves no keys behind.
  redis.call('DEL', wake, seq, head)
else
  -- Keep the wake list in step with pending: one marker leaves per claimed job.
  local extra = claimed - held
  if extra > 0 then
    redis.call('RPOP', wake, extra)
  end
end
return out
