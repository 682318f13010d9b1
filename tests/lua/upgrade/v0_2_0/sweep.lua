--[[ sweep: count a stall on each lapsed (or charged) claim that started; recover or dead-letter.
  KEYS[1] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[7] base      <p>:{q}: (job rows, lane keys and metrics:<name> derive from it)
  ARGV[1] now_ms      '' takes the Redis server's clock
  ARGV[2] limit       most jobs examined by this call (1..1000)
  ARGV[3] max_stalled stalls forgiven when the row names no budget; -1 never dead-letters
  ARGV[4] reason      why these jobs stalled: lease_expired | worker_lost
  ARGV[5] lease_ms    the queue's lease: an outage is a gap between sweeps of over half of it
  ARGV[6..] id, token pairs: charge these live claims (a worker lost the process
            running them) instead of examining the lapsed ones
  Returns a flat array: id, outcome (recovered | dead | requeued | completed | graced),
  stalled, message (as stored; false unless recovered or dead), ... A job an older claim completed (its ack was fenced, `completed`
  is set) is deleted and counted completed instead (outcome completed).
  Outage rule: `<base>swept` (HASH at, from, to) keeps when sweeps ran. A live worker
  renews at least every half lease, so its lease lapses only if Redis did not hear from
  it for half a lease; a pass finding that no sweep ran for over half a lease takes the
  gap (from, to) as an outage. A live worker renewed before `from` (Redis answered then),
  so its lease lapses after from + lease/2: a lease with a deadline in
  (from + lease/2, to + lease/2] (in the outage, or so soon after it that its keeper had
  no time to renew) is granted one more lease uncounted, once per deadline (`graced`
  holds the deadline granted): outcome graced.
  A lapsed claim whose task never started (`started` is not its token) is
  requeued uncounted (outcome requeued). A charged claim has started.
  Counters: metrics:stalled, :recovered and :failed count each event in field `count`
  and by its reason in field `reason:<reason>`.
  Budget: stalled <= max_stalled recovers (to the front of its queue or lane),
  stalled > max_stalled dead-letters. A batch keeps its order at the front.
]]
local active, pending, wake, head, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, base = KEYS[6], KEYS[7]
local limit = tonumber(ARGV[2])
local default_budget, reason = tonumber(ARGV[3]), ARGV[4]
local lease_ms = tonumber(ARGV[5])
local now_ms = tonumber(ARGV[1])
if not now_ms then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local BAND = 1099511627776
local HISTORY = 20
local SWEPT_TTL_MS = 86400000

local charge = #ARGV >= 6
local ids, tokens = {}, {}
-- The outage window lapses are forgiven in (none unless one was seen).
local outage_from, outage_to
if charge then
  for i = 6, math.min(#ARGV, 5 + 2 * limit), 2 do
    ids[#ids + 1] = ARGV[i]
    tokens[#ids] = ARGV[i + 1]
  end
else
  local swept = base .. 'swept'
  local seen = redis.call('HMGET', swept, 'at', 'from', 'to')
  local last = tonumber(seen[1])
  if last and now_ms - last > lease_ms / 2 then
    outage_from, outage_to = last, now_ms
    redis.call('HSET', swept, 'from', last, 'to', now_ms)
  elseif seen[2] then
    outage_from, outage_to = tonumber(seen[2]), tonumber(seen[3])
  end
  redis.call('HSET', swept, 'at', now_ms)
  redis.call('PEXPIRE', swept, SWEPT_TTL_MS)
  ids = redis.call('ZRANGE', active, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
end

-- Front-of-queue scores count down from the head sequence, taken once for
-- the rest of the batch when the first job goes back: the batch keeps its order.
local top, first
local function front(i, priority)
  if not top then
    top, first = redis.call('INCRBY', head, #ids - i + 1), i
  end
  return tonumber(priority or '0') * BAND - (top - (i - first))
end
local out = {}
for i, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'state', 'owner', 'priority', 'max_stalled', 'payload',
    'history', 'group', 'deliveries', 'started', 'completed', 'graced')
  -- The message is read only for what the caller reports (recovered, dead); rows
  -- written before messages had a key of their own hold it as `payload`.
  local function message()
    return redis.call('GET', base .. 'msg:' .. id) or row[5] or ''
  end
  local deadline = tonumber(redis.call('ZSCORE', active, id))
  local examine = deadline and (not charge or row[8] == tokens[i])
  if examine and row[1] and not row[10] and outage_from and deadline > outage_from + lease_ms / 2
      and deadline <= outage_to + lease_ms / 2 and tonumber(row[11]) ~= deadline then
    -- Lapsed in an outage: its worker may be alive and could not renew. One more lease.
    local granted = now_ms + lease_ms
    redis.call('ZADD', active, 'XX', granted, id)
    redis.call('HSET', job, 'graced', granted)
    out[#out + 1] = id
    out[#out + 1] = 'graced'
    out[#out + 1] = tonumber(redis.call('HGET', job, 'stalled') or '0')
    out[#out + 1] = false
  elseif examine and not row[1] then
    -- A lease without a row (a foreign writer deleted it): drop the lease.
    redis.call('ZREM', active, id)
  elseif examine then
    redis.call('ZREM', active, id)
    local lane = pending
    if row[7] and row[7] ~= '' then
      lane = base .. 'g:' .. row[7] .. ':pending'
    end
    local outcome, stalled
    if row[10] then
      -- An older claim completed the job (its ack was fenced): done, not run again.
      stalled = tonumber(redis.call('HGET', job, 'stalled') or '0')
      redis.call('DEL', job, base .. 'msg:' .. id)
      redis.call('HINCRBY', base .. 'metrics:completed', 'count', 1)
      outcome = 'completed'
    elseif not charge and row[9] ~= row[8] then
      -- Never started under this claim: not the job's fault, so not a stall.
      stalled = tonumber(redis.call('HGET', job, 'stalled') or '0')
      if lane ~= pending then
        redis.call('ZADD', lanes, 0, row[7])
      end
      redis.call('ZADD', lane, front(i, row[3]), id)
      redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', reason)
      redis.call('LPUSH', wake, 1)
      outcome = 'requeued'
    else
      stalled = redis.call('HINCRBY', job, 'stalled', 1)
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
      redis.call('HINCRBY', base .. 'metrics:stalled', 'count', 1)
      redis.call('HINCRBY', base .. 'metrics:stalled', 'reason:' .. reason, 1)
      if budget >= 0 and stalled > budget then
        redis.call('HSET', job, 'state', 'dead', 'owner', '', 'last_error', 'stalled',
          'reason', reason, 'died_ms', now_ms, 'history', cjson.encode(history),
          'error', reason .. ': stalled ' .. stalled .. ' times, max_stalled=' .. budget)
        redis.call('ZADD', dead, now_ms, id)
        redis.call('HINCRBY', base .. 'metrics:failed', 'count', 1)
        redis.call('HINCRBY', base .. 'metrics:failed', 'reason:' .. reason, 1)
        outcome = 'dead'
      else
        if lane ~= pending then
          redis.call('ZADD', lanes, 0, row[7])
        end
        redis.call('ZADD', lane, front(i, row[3]), id)
        redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', reason,
          'history', cjson.encode(history))
        redis.call('LPUSH', wake, 1)
        redis.call('HINCRBY', base .. 'metrics:recovered', 'count', 1)
        redis.call('HINCRBY', base .. 'metrics:recovered', 'reason:' .. reason, 1)
        outcome = 'recovered'
      end
    end
    out[#out + 1] = id
    out[#out + 1] = outcome
    out[#out + 1] = stalled
    if outcome == 'recovered' or outcome == 'dead' then
      out[#out + 1] = message()
    else
      out[#out + 1] = false
    end
  end
end
return out
