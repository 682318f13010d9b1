--[[ ack: jobs are done; delete them. Fenced by each claim's token.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] dead      <p>:{q}:dead (ZSET)
  KEYS[5] completed <p>:{q}:metrics:completed (HASH, field count)
  KEYS[6] base      <p>:{q}: (job rows, lane keys and lanes derive from it)
  ARGV[1..] id, token pairs (the token is the claim's id; at most 500 pairs)
  Returns one code per pair:
  0 OK        acked under the live claim it names; deleted
  1 NOT_FOUND no such job (already acked or purged), or one waiting for its ETA (a
              claim the server forgot with its last writes: the job runs when due)
  2 LEASE_LOST the claim had lapsed and the job waited in pending again; it has
              completed, so it is deleted and will not run again
  4 DEAD      the claim had lapsed and the job was dead-lettered; it has completed,
              so it leaves the morgue
  5 FENCED    another claim holds the job now; it is left to that claim, and only
              marked `completed`: if that claim is then lost (released, lapsed,
              dead-lettered), the job is deleted as completed instead of run again.
              Counted in <p>:{q}:metrics:fenced (fields count, reason:ack).
]]
--@include unqueue
--@include live
local active, pending, wake, dead, completed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local base = KEYS[6]
-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000

local out = {}
for i = 1, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'state', 'deliveries', 'group', 'claim')
  local live = live_claim(row[2], row[4])
  local code
  if not row[1] or row[1] == 'delayed' then
    code = 1
  elseif row[1] == 'active' and live ~= token then
    redis.call('HSET', job, 'completed', 1)
    redis.call('HINCRBY', base .. 'metrics:fenced', 'count', 1)
    redis.call('HINCRBY', base .. 'metrics:fenced', 'reason:ack', 1)
    redis.call('PEXPIRE', base .. 'metrics:fenced', COUNTER_TTL_MS)
    code = 5
  else
    if row[1] == 'active' then
      redis.call('ZREM', active, id)
      code = 0
    elseif row[1] == 'dead' then
      redis.call('ZREM', dead, id)
      code = 4
    else
      unqueue(base, pending, wake, id, row[3])
      code = 2
    end
    redis.call('DEL', job, base .. 'msg:' .. id)
    redis.call('HINCRBY', completed, 'count', 1)
  end
  out[#out + 1] = code
end
redis.call('PEXPIRE', completed, COUNTER_TTL_MS)
return out
