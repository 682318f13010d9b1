--[[ start: record that the task of a claim has started, so a lapse of that claim is a stall.
  A lapsed claim whose task never started (prefetched, waiting for its ETA) is
  requeued uncounted by the sweep.
  KEYS[1] job       <p>:{q}:job:<id> (HASH)
  ARGV[1] token     the claim's delivery count
  Returns 0 OK, 1 NOT_FOUND (no row, or not active), 5 FENCED (another claim holds it).
]]
local job = KEYS[1]
local token = ARGV[1]

local row = redis.call('HMGET', job, 'state', 'deliveries')
if row[1] ~= 'active' then
  return 1
end
if row[2] ~= token then
  return 5
end
redis.call('HSET', job, 'started', token)
return 0
