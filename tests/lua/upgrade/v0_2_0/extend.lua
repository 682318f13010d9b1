--[[ extend: renew the leases a live worker holds. Fenced by each claim's token.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] jobs      <p>:{q}:job: (prefix of job rows, same hash tag)
  ARGV[1] lease_ms  the new deadline is now + lease_ms
  ARGV[2] now_ms    '' takes the Redis server's clock
  ARGV[3..] id, token pairs (the caller sends at most 512 pairs)
  Returns a flat array id, token, ... of the claims that are lost (no longer
  active, or active under a newer claim); those are left untouched.
]]
local active, jobs = KEYS[1], KEYS[2]
local lease_ms = tonumber(ARGV[1])
local now_ms = tonumber(ARGV[2])
if not now_ms then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local deadline = now_ms + lease_ms

local lost = {}
for i = 3, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  if redis.call('ZSCORE', active, id)
      and redis.call('HGET', jobs .. id, 'deliveries') == token then
    redis.call('ZADD', active, 'XX', deadline, id)
  else
    lost[#lost + 1] = id
    lost[#lost + 1] = token
  end
end
return lost
