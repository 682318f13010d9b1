--[[ extend: renew the leases a live worker holds. Fenced by each claim's token.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] jobs      <p>:{q}:job: (prefix of job rows, same hash tag)
  KEYS[3] fenced    <p>:{q}:metrics:fenced (HASH, fields count and reason:<verb>)
  ARGV[1] lease_ms  the new deadline is now + lease_ms
  ARGV[2] now_ms    '' takes the Redis server's clock
  ARGV[3..] id, token pairs (the caller sends at most 512 pairs)
  Returns a flat array id, token, ... of the claims that are lost (no longer
  active, or active under another claim: counted fenced); those are left untouched.
]]
--@include clock
--@include live
-- A counter ends this long after its last change (30 days).
local COUNTER_TTL_MS = 2592000000
local active, jobs, fenced = KEYS[1], KEYS[2], KEYS[3]
local lease_ms = tonumber(ARGV[1])
local now_ms = clock(ARGV[2])
local deadline = now_ms + lease_ms

local lost = {}
for i = 3, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local live = false
  if redis.call('ZSCORE', active, id) then
    local row = redis.call('HMGET', jobs .. id, 'deliveries', 'claim')
    live = live_claim(row[1], row[2]) == token
    if not live then
      redis.call('HINCRBY', fenced, 'count', 1)
      redis.call('HINCRBY', fenced, 'reason:extend', 1)
      redis.call('PEXPIRE', fenced, COUNTER_TTL_MS)
    end
  end
  if live then
    redis.call('ZADD', active, 'XX', deadline, id)
  else
    lost[#lost + 1] = id
    lost[#lost + 1] = token
  end
end
return lost
