--[[ extend: renew the leases a live worker holds.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] jobs      <p>:{q}:job: (prefix of job rows, same hash tag)
  ARGV[1] owner     worker identity renewing
  ARGV[2] deadline  new lease deadline (ms)
  ARGV[3..] ids     the job ids to renew (the caller sends at most 512)
  Returns the array of ids whose lease is lost (no longer active, or active
  under another owner); those are left untouched.
]]
local active, jobs = KEYS[1], KEYS[2]
local owner, deadline = ARGV[1], tonumber(ARGV[2])

local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', active, id)
      and redis.call('HGET', jobs .. id, 'owner') == owner then
    redis.call('ZADD', active, 'XX', deadline, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
