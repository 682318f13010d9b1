--[[ start: record that the task of a claim has started, so a lapse of that claim is a stall.
  A lapsed claim whose task never started (prefetched, waiting for its ETA) is
  requeued without a stall by the sweep, counted in `lapsed`; a start clears
  that count (the job's message was received whole).
  `started` takes the claim's delivery count (the part of its id before the dot), as
  0.2.0 wrote it, so a sweep of that version (`started` == `deliveries`) also reads
  the claim as started during a rolling upgrade. The start itself is fenced by the
  claim id: the count a lost claim leaves is reused only after that claim (and
  any start of it) is lost, and the worker of the lost claim cannot start the new one.
  Received: with ARGV[2] 'received', the claim's message was received whole by its
  consumer (decoded, handed to the worker) and nothing else is recorded: a suspect so
  received is no message that kills its worker before its task starts, so its
  `lapsed` count is cleared, and with it the suspect's blame (sweep.lua).
  KEYS[1] job       <p>:{q}:job:<id> (HASH)
  KEYS[2] fenced    <p>:{q}:metrics:fenced (HASH, fields count and reason:<verb>)
  ARGV[1] token     the claim's id
  ARGV[2] what      'started' (the default) or 'received'
  Returns 0 OK, 1 NOT_FOUND (no row, or not active), 5 FENCED (another claim holds
  it; counted, reason:start).
]]
--@include live
-- A counter ends this long after its last change (30 days).
local COUNTER_TTL_MS = 2592000000
local job, fenced = KEYS[1], KEYS[2]
local token, what = ARGV[1], ARGV[2] or 'started'

local row = redis.call('HMGET', job, 'state', 'deliveries', 'claim')
if row[1] ~= 'active' then
  return 1
end
local live = live_claim(row[2], row[3])
if live ~= token then
  redis.call('HINCRBY', fenced, 'count', 1)
  redis.call('HINCRBY', fenced, 'reason:start', 1)
  redis.call('PEXPIRE', fenced, COUNTER_TTL_MS)
  return 5
end
if what ~= 'received' then
  redis.call('HSET', job, 'started', row[2])
end
redis.call('HDEL', job, 'lapsed')
return 0
