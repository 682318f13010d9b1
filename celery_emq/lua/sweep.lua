--[[ sweep: count a stall on each lapsed (or named) active job, then recover or dead-letter.
  KEYS[1] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[7] base      <p>:{q}: (job rows, lane keys and metrics:<name> derive from it)
  ARGV[1] now_ms
  ARGV[2] limit       most jobs examined by this call (1..1000)
  ARGV[3] max_stalled stalls forgiven when the row names no budget; -1 never dead-letters
  ARGV[4] reason      why these jobs stalled: lease_expired | worker_lost
  ARGV[5] owner       with ids: only jobs leased to this owner are examined
  ARGV[6..] ids       optional: examine these active jobs instead of the lapsed ones
  Returns a flat array: id, outcome (recovered | dead), stalled, payload, ... per job.
  Budget: stalled <= max_stalled recovers (to the front of its queue or lane),
  stalled > max_stalled dead-letters.
]]
local active, pending, wake, head, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, base = KEYS[6], KEYS[7]
local now_ms, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local default_budget, reason, owner = tonumber(ARGV[3]), ARGV[4], ARGV[5]

local BAND = 1099511627776
local HISTORY = 20

local ids
if #ARGV >= 6 then
  ids = {}
  for i = 6, math.min(#ARGV, 5 + limit) do
    ids[#ids + 1] = ARGV[i]
  end
else
  ids = redis.call('ZRANGE', active, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
end

local out = {}
for _, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'state', 'owner', 'priority', 'max_stalled', 'payload',
    'history', 'group')
  local examine = redis.call('ZSCORE', active, id) and (#ARGV < 6 or row[2] == owner)
  if examine and not row[1] then
    -- A lease without a row (an expiring queue timed out): drop the lease.
    redis.call('ZREM', active, id)
  elseif examine then
    local stalled = redis.call('HINCRBY', job, 'stalled', 1)
    local budget = default_budget
    if row[4] and row[4] ~= '' then
      budget = tonumber(row[4])
    end
    local history = {}
    if row[6] then
      history = cjson.decode(row[6])
    end
    history[#history + 1] = {at = now_ms, reason = reason, owner = row[2] or '', stalled = stalled}
    while #history > HISTORY do
      table.remove(history, 1)
    end
    redis.call('ZREM', active, id)
    redis.call('HINCRBY', base .. 'metrics:stalled', 'count', 1)
    local outcome
    if budget >= 0 and stalled > budget then
      redis.call('HSET', job, 'state', 'dead', 'owner', '', 'last_error', 'stalled',
        'reason', reason, 'died_ms', now_ms, 'history', cjson.encode(history),
        'error', reason .. ': stalled ' .. stalled .. ' times, max_stalled=' .. budget)
      redis.call('ZADD', dead, now_ms, id)
      redis.call('HINCRBY', base .. 'metrics:failed', 'count', 1)
      outcome = 'dead'
    else
      local n = redis.call('INCR', head)
      local lane = pending
      if row[7] and row[7] ~= '' then
        lane = base .. 'g:' .. row[7] .. ':pending'
        redis.call('ZADD', lanes, 0, row[7])
      end
      redis.call('ZADD', lane, tonumber(row[3] or '0') * BAND - n, id)
      redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', reason,
        'history', cjson.encode(history))
      redis.call('LPUSH', wake, 1)
      redis.call('HINCRBY', base .. 'metrics:recovered', 'count', 1)
      outcome = 'recovered'
    end
    out[#out + 1] = id
    out[#out + 1] = outcome
    out[#out + 1] = stalled
    out[#out + 1] = row[5]
  end
end
return out
