--[[ start: record that the task of a claim has started, so a lapse of that claim is a stall.
  A lapsed claim whose task never started (prefetched, waiting for its ETA) is
  requeued uncounted by the sweep.
  KEYS[1] job       <p>:{q}:job:<id> (HASH)
  KEYS[2] fenced    <p>:{q}:metrics:fenced (HASH, fields count and reason:<verb>)
  ARGV[1] token     the claim's id
  Returns 0 OK, 1 NOT_FOUND (no row, or not active), 5 FENCED (another claim holds
  it; counted, reason:start).
]]
local job, fenced = KEYS[1], KEYS[2]
local token = ARGV[1]

-- The live claim's token: its claim id; the delivery count for a claim made by a
-- version that kept no claim id (or whose id a later such claim left behind).
local function live_token(claim, deliveries)
  if claim and deliveries and string.match(claim, '^%d+') == deliveries then
    return claim
  end
  return deliveries
end
-- A settle naming a claim that is not the live one: counted by verb, changes nothing.
local function count_fenced(verb)
  redis.call('HINCRBY', fenced, 'count', 1)
  redis.call('HINCRBY', fenced, 'reason:' .. verb, 1)
end

local row = redis.call('HMGET', job, 'state', 'deliveries', 'claim')
if row[1] ~= 'active' then
  return 1
end
if live_token(row[3], row[2]) ~= token then
  count_fenced('start')
  return 5
end
redis.call('HSET', job, 'started', token)
return 0
