--[[ look: one call over many queues of one server: which need a sweep pass this time.
  KEYS[1] expiring  <p>:expiring (SET, the x-expires registry)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] pending   <p>:{q}:pending (ZSET)
  KEYS[4] wake      <p>:{q}:wake (LIST)
  KEYS[5] head      <p>:{q}:head (STRING)
  KEYS[6] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[7] lanes     <p>:{q}:lanes (ZSET)
  KEYS[8] base      <p>:{q}: (delayed, seq, cursor and swept derive from it)
  More queues: their seven keys again, in that order, after the first's.
  ARGV[1] now_ms           '' takes the Redis server's clock
  ARGV[2] lease_ms         the queues' lease (the outage rule's half lease)
  ARGV[3] dead_max_age_ms  morgue retention by age (0: any age)
  ARGV[4] dead_max_size    morgue retention by size (0: any number)
  ARGV[5..] since_ms, one per queue in KEYS order, as sweep.lua's ARGV[9]
  Returns {now_ms, registered, need_1, ..., need_N}: the server's clock, how many
  queues the x-expires registry holds, and per queue 1 when a sweep pass has work
  there, else 0. A queue needs its pass when a lease lapsed, a delayed job is due,
  the morgue is past its retention, claimable jobs wait with an empty wake list, a
  queue with nothing pending keeps ordering keys, or the caller's evidence is not a
  recent pass of its own (no pass, a failure, a gap of over half a lease, or a
  sweep record older than its pass: the outage rule decides those). A queue that
  needs none is recorded swept now (`swept` `at`), as its pass would have been.
  An idle worker sends this one call a sweep interval, whatever its queues.
]]
--@include clock
local SWEPT_TTL_MS = 86400000
local registry = KEYS[1]
local now_ms = clock(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local dead_max_age_ms, dead_max_size = tonumber(ARGV[3]), tonumber(ARGV[4])
local n = math.floor((#KEYS - 1) / 7)
local since_of = {}
for i = 5, #ARGV do
  since_of[#since_of + 1] = ARGV[i]
end

local function needs(g, since)
  local active, pending, wake, head, dead, lanes, base =
    KEYS[g + 1], KEYS[g + 2], KEYS[g + 3], KEYS[g + 4], KEYS[g + 5], KEYS[g + 6], KEYS[g + 7]
  since = tonumber(since)
  if not since or since == 0 or now_ms - since > lease_ms / 2 then
    return true
  end
  local at = tonumber(redis.call('HGET', base .. 'swept', 'at'))
  if at and at < since then
    return true
  end
  if #redis.call('ZRANGE', active, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, 1) > 0 then
    return true
  end
  local first = redis.call('ZRANGE', base .. 'delayed', 0, 0, 'WITHSCORES')
  if first[2] and tonumber(first[2]) <= now_ms then
    return true
  end
  if dead_max_size > 0 and redis.call('ZCARD', dead) > dead_max_size then
    return true
  end
  if dead_max_age_ms > 0 then
    local oldest = redis.call('ZRANGE', dead, 0, 0, 'WITHSCORES')
    if oldest[2] and tonumber(oldest[2]) < now_ms - dead_max_age_ms then
      return true
    end
  end
  if redis.call('EXISTS', pending, lanes) > 0 then
    return redis.call('LLEN', wake) == 0
  end
  return redis.call('EXISTS', wake, head, base .. 'seq', base .. 'cursor') > 0
end

local out = {now_ms, redis.call('SCARD', registry)}
for i = 1, n do
  local g = 1 + (i - 1) * 7
  if needs(g, since_of[i]) then
    out[#out + 1] = 1
  else
    local swept = KEYS[g + 7] .. 'swept'
    redis.call('HSET', swept, 'at', now_ms)
    redis.call('PEXPIRE', swept, SWEPT_TTL_MS)
    out[#out + 1] = 0
  end
end
return out
