--[[ sweep: count a stall on each lapsed (or charged) claim that started; recover, or doom.
  KEYS[1] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] head      <p>:{q}:head (STRING, head sequence)
  KEYS[5] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane)
  KEYS[7] base      <p>:{q}: (job rows, lane keys, metrics:<name>, delayed, etas and
                    seq derive from it)
  KEYS[8] expiring  <p>:expiring (SET, the x-expires registry; optional, given on one
                    server, where it shares the queue's node)
  ARGV[1] now_ms      '' takes the Redis server's clock
  ARGV[2] limit       most jobs examined by this call (1..1000)
  ARGV[3] max_stalled stalls forgiven when the row names no budget; -1 never dead-letters
  ARGV[4] reason      why these jobs stalled: lease_expired | worker_lost
  ARGV[5] lease_ms    the queue's lease: an outage is a gap between sweeps of over half of it
  ARGV[6] max_lapsed  lapses before a start forgiven (see below); -1 never dead-letters
  ARGV[7] dead_max_age_ms  morgue retention: dead jobs older than this are deleted (0: any age)
  ARGV[8] dead_max_size    morgue retention: most dead jobs kept (0: any number)
  ARGV[9] since_ms     the caller's evidence of an outage (see the outage rule): the
                       server time of its own last pass on this node; '' for a caller
                       that has none and met no failure; '0' for one that cannot
                       tell (the gap since any sweep is taken)
  ARGV[10..] id, token pairs: charge these live claims (a worker lost the process
            running them) instead of examining the lapsed ones; a pair that names
            no live claim changes nothing and is counted in metrics:fenced
            (reason:charge)
  Returns a flat array: id, outcome (promoted | recovered | doomed | requeued |
  completed | graced | trimmed), stalled, message (as stored; false unless recovered
  or doomed), ... A job an older claim completed (its ack was fenced,
  `completed` is set) is deleted and counted completed instead (outcome completed).
  Doomed: a job past its budget (of stalls, or of lapses before a start) is not moved
  nor counted here: its task may have succeeded after all (an ack the server lost),
  which only the caller can ask the result backend. It stays in `active`, lapsed,
  its row marked `doomed` (its claim id) with the stall or lapse counted in the row
  and the reason and error it would die with; the caller then retires it (retire.lua:
  to the morgue, counted failed and stalled there, or deleted as completed). A pass
  that meets a job already doomed under its live claim (its caller died before the
  retire) returns it again, counting nothing twice (outcome doomed).
  Delayed jobs: a pass that examines lapsed claims (not a charge) first promotes up to
  `limit` due delayed jobs to the tail of their queue or lane, as promote.lua does
  (outcome promoted, stalled 0): the sweep is a queue's one periodic script, the net
  behind the consumers, whose waits end when the earliest delayed job they know of is due.
  Registry: given `expiring`, a pass that examines lapsed claims ends with the entry
  '', expiring, SCARD, false when the x-expires registry holds any queue, so the
  caller runs the expiry pass only then (an idle worker sends nothing beside this call).
  Clock: such a pass ends (after that entry) with '', clock, now_ms, false.
  Retention: a pass that examines lapsed claims (not a charge) then deletes up to `limit`
  dead jobs past the morgue's age or size bounds, oldest deaths first (outcome trimmed,
  stalled 0): every sweep applies it, whether or not a job died since the last. Such a pass
  also drops the ordering keys (wake, head, seq, cursor) of a queue with nothing pending,
  and pushes one wake marker when claimable jobs wait and the wake list is empty.
  Counters end COUNTER_TTL_MS after their last change (every script that counts renews it).
  Outage rule: `<base>swept` (HASH at, from, to) keeps when sweeps ran. A live worker
  renews at least every half lease, so its lease lapses only if Redis did not hear from
  it for half a lease. A caller that swept this node before (since_ms) and finds over
  half a lease since its own last pass (or since `at`, if older: the record rolled
  back) was itself cut off from Redis, or Redis from everyone: it takes the gap
  (from, to) as an outage. A caller with no pass behind it vouches for no gap: when
  every worker died and Redis stayed up, the first sweep of their replacement sees
  their lapses as lapses, not as an outage. A live worker renewed before `from` (Redis answered then),
  so its lease lapses after from + lease/2: a lease with a deadline in
  (from + lease/2, to + lease/2] (in the outage, or so soon after it that its keeper had
  no time to renew) is granted one more lease uncounted, once per deadline (`graced`
  holds the deadline granted): outcome graced.
  A lapsed claim whose task never started (`started` holds neither its delivery
  count, as start.lua writes it, nor its claim id, as earlier builds wrote it) is
  requeued without a stall (outcome requeued), but counted in the row's `lapsed`:
  past max_lapsed such lapses (a message that kills its worker before its task
  starts) the job is doomed, reason never_started (outcome doomed).
  A charged claim has started.
  Blame: a claim handed out as a suspect is noted in `<base>suspects` (owner -> id and
  claim id, claim.lua). When a lapsed claim's owner held a suspect of this queue that
  its consumer had not yet received whole under that claim (start.lua: received), the
  owner died of it (or may have): the suspect's lapse is counted, and the owner's
  other lapsed claims of this queue are requeued uncounted (outcome requeued, no
  stall, no lapse): those not started, and those started if the owner's tasks ran
  elsewhere (`here` 0, prefork children). A task started in the process itself may
  have killed it after the suspect came: it is charged as usual.
  Counters: metrics:stalled and :recovered count each recovery in field `count` and
  by its reason in field `reason:<reason>` (a doomed job's, retire.lua counts).
  Budget: stalled <= max_stalled recovers (to the front of its queue or lane),
  stalled > max_stalled dooms. A batch keeps its order at the front.
]]
--@include band
--@include etas
--@include lane
--@include promote
--@include clock
--@include live
local active, pending, wake, head, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, base, registry = KEYS[6], KEYS[7], KEYS[8]
local limit = tonumber(ARGV[2])
local default_budget, reason = tonumber(ARGV[3]), ARGV[4]
local lease_ms, max_lapsed = tonumber(ARGV[5]), tonumber(ARGV[6])
local dead_max_age_ms, dead_max_size = tonumber(ARGV[7]), tonumber(ARGV[8])
local since = ARGV[9]
local now_ms = clock(ARGV[1])

-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000
local HISTORY = 20
local SWEPT_TTL_MS = 86400000

local charge = #ARGV >= 10
local ids, tokens = {}, {}
-- The outage window lapses are forgiven in (none unless one was seen).
local outage_from, outage_to
if charge then
  for i = 10, math.min(#ARGV, 9 + 2 * limit), 2 do
    ids[#ids + 1] = ARGV[i]
    tokens[#ids] = ARGV[i + 1]
  end
else
  local swept = base .. 'swept'
  local seen = redis.call('HMGET', swept, 'at', 'from', 'to')
  local last = tonumber(seen[1])
  -- Where the gap this caller vouches for began (false: it vouches for none).
  local gap_from = false
  if since == '0' then
    gap_from = last
  elseif since ~= '' then
    gap_from = tonumber(since)
    if last and last < gap_from then
      gap_from = last
    end
  end
  if gap_from and now_ms - gap_from > lease_ms / 2 then
    outage_from, outage_to = gap_from, now_ms
    redis.call('HSET', swept, 'from', gap_from, 'to', now_ms)
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
-- Lanes a sweep looks at for a claimable job when the wake list is empty.
local LANES_LOOKED = 8
local out = {}
local delayed = base .. 'delayed'
if not charge and redis.call('EXISTS', delayed) == 1 then
  local etas, tail = base .. 'etas', base .. 'seq'
  local due = redis.call('ZRANGE', delayed, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
  for _, id in ipairs(due) do
    promote_one(base, delayed, etas, pending, lanes, tail, wake, id)
    out[#out + 1] = id
    out[#out + 1] = 'promoted'
    out[#out + 1] = 0
    out[#out + 1] = false
  end
end
-- Back at the front of its queue or lane, pending, uncounted (a lapse before a start,
-- or a claim forgiven beside a suspect).
local function requeue(i, id, job, row, lane)
  if lane ~= pending then
    redis.call('ZADD', lanes, 0, row[7])
  end
  redis.call('ZADD', lane, front(i, row[3]), id)
  redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', reason)
  redis.call('LPUSH', wake, 1)
end
-- The suspect each owner held unreceived in this queue (false: none), read once a call.
local suspects, held_suspect = base .. 'suspects', {}
local function suspect_of(holder)
  if not holder or holder == '' then
    return false
  end
  if held_suspect[holder] == nil then
    local found = false
    local note = redis.call('HGET', suspects, holder)
    if note then
      local sid, sclaim, shere = string.match(note, '^(%S+) (%S+) ?(%d?)$')
      local srow = sid and redis.call('HMGET', base .. 'job:' .. sid, 'claim', 'started', 'owner',
        'lapsed')
      -- Neither received whole nor started under that claim (either clears `lapsed`;
      -- `started` holds neither its count nor its id).
      if srow and srow[1] == sclaim and srow[2] ~= sclaim and srow[2] ~= string.match(sclaim, '^%d+')
          and srow[3] == holder and tonumber(srow[4] or '0') > 0 then
        found = {sid, shere ~= '0'}
      else
        redis.call('HDEL', suspects, holder)
      end
    end
    held_suspect[holder] = found
  end
  return held_suspect[holder]
end
for i, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'state', 'owner', 'priority', 'max_stalled', 'payload',
    'history', 'group', 'deliveries', 'started', 'completed', 'graced', 'claim')
  local token = live_claim(row[8], row[12])
  -- The message is read only for what the caller reports (recovered, doomed); rows
  -- written before messages had a key of their own hold it as `payload`.
  local function message()
    return redis.call('GET', base .. 'msg:' .. id) or row[5] or ''
  end
  local deadline = tonumber(redis.call('ZSCORE', active, id))
  local examine = deadline and (not charge or token == tokens[i])
  if deadline and not examine then
    redis.call('HINCRBY', base .. 'metrics:fenced', 'count', 1)
    redis.call('HINCRBY', base .. 'metrics:fenced', 'reason:charge', 1)
    redis.call('PEXPIRE', base .. 'metrics:fenced', COUNTER_TTL_MS)
  end
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
    -- Read before the claim leaves `active`: its owner's suspect may be this job.
    local blamed = not charge and suspect_of(row[2])
    -- Forgiven beside it: an unstarted claim, or a started one that ran elsewhere (a
    -- prefork child cannot kill the process that received the suspect).
    local forgiven = blamed and blamed[1] ~= id
      and (not blamed[2] or (row[9] ~= row[8] and row[9] ~= token))
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
      redis.call('PEXPIRE', base .. 'metrics:completed', COUNTER_TTL_MS)
      outcome = 'completed'
    elseif redis.call('HGET', job, 'doomed') == token then
      -- Doomed by an earlier pass whose caller died before it retired the job.
      stalled = tonumber(redis.call('HGET', job, 'stalled') or '0')
      redis.call('ZADD', active, deadline, id)
      outcome = 'doomed'
    elseif forgiven then
      -- Its owner died holding a suspect it had not received: the suspect is blamed,
      -- this claim forgiven, back at the front uncounted.
      stalled = tonumber(redis.call('HGET', job, 'stalled') or '0')
      requeue(i, id, job, row, lane)
      outcome = 'requeued'
    elseif not charge and row[9] ~= row[8] and row[9] ~= token then
      -- Never started under this claim: not the job's fault, so not a stall. Yet a
      -- message that kills its worker before its task starts lapses like this every
      -- time: such lapses are counted apart, and bounded.
      stalled = tonumber(redis.call('HGET', job, 'stalled') or '0')
      local lapsed = redis.call('HINCRBY', job, 'lapsed', 1)
      if max_lapsed >= 0 and lapsed > max_lapsed then
        redis.call('HSET', job, 'doomed', token, 'last_error', 'never_started',
          'reason', 'never_started', 'error', 'never_started: lapsed '
          .. lapsed .. ' times before its task started, max_lapsed=' .. max_lapsed)
        redis.call('ZADD', active, deadline, id)
        outcome = 'doomed'
      else
        requeue(i, id, job, row, lane)
        outcome = 'requeued'
      end
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
      if budget >= 0 and stalled > budget then
        redis.call('HSET', job, 'doomed', token, 'last_error', 'stalled',
          'reason', reason, 'history', cjson.encode(history),
          'error', reason .. ': stalled ' .. stalled .. ' times, max_stalled=' .. budget)
        redis.call('ZADD', active, deadline, id)
        outcome = 'doomed'
      else
        redis.call('HINCRBY', base .. 'metrics:stalled', 'count', 1)
        redis.call('PEXPIRE', base .. 'metrics:stalled', COUNTER_TTL_MS)
        redis.call('HINCRBY', base .. 'metrics:stalled', 'reason:' .. reason, 1)
        if lane ~= pending then
          redis.call('ZADD', lanes, 0, row[7])
        end
        redis.call('ZADD', lane, front(i, row[3]), id)
        redis.call('HSET', job, 'state', 'pending', 'owner', '', 'reason', reason,
          'history', cjson.encode(history))
        redis.call('LPUSH', wake, 1)
        redis.call('HINCRBY', base .. 'metrics:recovered', 'count', 1)
        redis.call('PEXPIRE', base .. 'metrics:recovered', COUNTER_TTL_MS)
        redis.call('HINCRBY', base .. 'metrics:recovered', 'reason:' .. reason, 1)
        outcome = 'recovered'
      end
    end
    out[#out + 1] = id
    out[#out + 1] = outcome
    out[#out + 1] = stalled
    if outcome == 'recovered' or outcome == 'doomed' then
      out[#out + 1] = message()
    else
      out[#out + 1] = false
    end
  end
end

local in_morgue = 0
if not charge and (dead_max_age_ms > 0 or dead_max_size > 0) then
  in_morgue = redis.call('ZCARD', dead)
end
if in_morgue > 0 then
  -- Morgue retention, by age then by size, at most `limit` deletions per call.
  local doomed = {}
  if dead_max_age_ms > 0 then
    doomed = redis.call('ZRANGE', dead, '-inf', '(' .. (now_ms - dead_max_age_ms), 'BYSCORE',
      'LIMIT', 0, limit)
  end
  if dead_max_size > 0 and #doomed < limit then
    local excess = in_morgue - #doomed - dead_max_size
    if excess > 0 then
      local more = redis.call('ZRANGE', dead, #doomed, #doomed + math.min(excess, limit - #doomed) - 1)
      for _, id in ipairs(more) do
        doomed[#doomed + 1] = id
      end
    end
  end
  for _, id in ipairs(doomed) do
    redis.call('ZREM', dead, id)
    redis.call('DEL', base .. 'job:' .. id, base .. 'msg:' .. id)
    out[#out + 1] = id
    out[#out + 1] = 'trimmed'
    out[#out + 1] = 0
    out[#out + 1] = false
  end
end
-- Nothing waits: the ordering keys go, as a claim that drains the queue drops them.
-- Jobs wait but no marker says so (a consumer popped one and died before its claim):
-- one marker wakes a waiting consumer, so a lost marker delays a job by a sweep
-- interval at most, however long the consumers' idle waits. (Lanes: the first
-- LANES_LOOKED groups are looked at; a marker is pushed only for a claimable job.)
local seq, cursor = base .. 'seq', base .. 'cursor'
if not charge then
  local claimable = redis.call('ZCARD', pending) > 0
  if not claimable and redis.call('EXISTS', lanes) == 0 then
    if redis.call('EXISTS', wake, head, seq, cursor) > 0 then
      redis.call('DEL', wake, head, seq, cursor)
    end
  elseif redis.call('LLEN', wake) == 0 then
    if not claimable then
      for _, group in ipairs(redis.call('ZRANGE', lanes, 0, LANES_LOOKED - 1)) do
        if redis.call('ZCARD', base .. 'g:' .. group .. ':pending') > 0 then
          claimable = true
          break
        end
      end
    end
    if claimable then
      redis.call('LPUSH', wake, 1)
    end
  end
end
if not charge and registry then
  local registered = redis.call('SCARD', registry)
  if registered > 0 then
    out[#out + 1] = ''
    out[#out + 1] = 'expiring'
    out[#out + 1] = registered
    out[#out + 1] = false
  end
end
if not charge then
  -- The server's clock at this pass: the caller's evidence of its contact (since_ms).
  out[#out + 1] = ''
  out[#out + 1] = 'clock'
  out[#out + 1] = now_ms
  out[#out + 1] = false
end
return out
