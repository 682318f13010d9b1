--[[ claim: move up to `count` jobs from pending (and the fair lanes) to active, each leased.
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] wake      <p>:{q}:wake (LIST)
  KEYS[4] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[5] head      <p>:{q}:head (STRING, head sequence)
  KEYS[6] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[7] cursor    <p>:{q}:cursor (STRING, the lane served last)
  KEYS[8] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[9] base      <p>:{q}: (job rows, lane keys and `suspects` derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] lease_ms
  ARGV[3] owner     worker identity that will renew the leases
  ARGV[4] count     most jobs to claim (1..1000)
  ARGV[5] held      wake markers the caller already popped (BRPOP): 0 or 1
  ARGV[6] ttl_ms    > 0 for an x-expires queue: a claim is a use, so the queue lives on
  ARGV[7] nonce     a random value the caller made for this call (never reused)
  ARGV[8] suspects  1 when the caller may take one suspect, else 0
  ARGV[9] here      1 when the caller's tasks run in the process that claims (a task
                    that kills it shares a suspect's blame: see sweep.lua), else 0
  Returns a flat array: id, message, stalled, deliveries, revoked, suspect, ... per
  claimed job (the message as stored, see celery_emq/codec.py; revoked is 1 for a
  delayed job promoted by a revoke, else 0; suspect is 1 for a job that lapsed before
  its task started, else 0), and one more item, 'suspect', when the call passed over
  a suspect it could not take (see below).
  Each claim's fencing token is its claim id, `<deliveries>.<nonce>`, kept in the
  row's `claim` field: every later settle names it. The delivery count alone can
  repeat when the server loses its last writes; the nonce cannot.
  With lanes, claims rotate one job at a time over the default lane and each
  group's lane (in name order), so no group can starve another.
  Suspects: a job whose lease lapsed before its task started (`lapsed` on its row)
  may be a message that kills its worker as it is received. A call takes at most one
  (none if the caller says it may not); a suspect it may not take stays where it is,
  in its place, and the claim takes the jobs behind it (at most LOOK suspects are
  passed over per call). A suspect handed out is noted in `<base>suspects` (owner ->
  id, claim id and `here`): should its owner die before its consumer received it whole
  (start.lua, received), the sweep blames it alone, and forgives the owner's other
  claims of this queue (sweep.lua).
]]
--@include clock
local pending, active, wake, seq, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lanes, cursor, expires, base = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local lease_ms, owner = tonumber(ARGV[2]), ARGV[3]
local count, held, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local nonce = ARGV[7]
local may_take_suspect = ARGV[8] == '1'
local here = ARGV[9] == '1' and '1' or '0'
local now_ms = clock(ARGV[1])
if ttl_ms > 0 then
  redis.call('SET', expires, 1, 'PX', ttl_ms)
end

-- Most suspects one call passes over (each is popped and put back).
local LOOK = 32
-- A suspect's note ends this long after the last suspect handed out (one day).
local SUSPECTS_TTL_MS = 86400000

-- Each id taken, with its row, its score and its group (false: the default lane);
-- each suspect passed over, with its score and lane, to put back.
local ids, rows, scores, groups = {}, {}, {}, {}
local passed = {}
local suspect_taken = false

-- Take `id` (popped with `score` from the lane of `group`) unless it is a suspect
-- the caller may not take: then it is noted to go back. Returns whether taken.
local function offer(id, score, group)
  local row = redis.call('HMGET', base .. 'job:' .. id, 'state', 'stalled', 'payload', 'revoked',
    'lapsed')
  if tonumber(row[5] or '0') > 0 then
    if suspect_taken or not may_take_suspect then
      passed[#passed + 1] = {id, score, group}
      return false
    end
    suspect_taken = true
  end
  ids[#ids + 1] = id
  rows[#ids], scores[#ids], groups[#ids] = row, score, group
  return true
end

if redis.call('EXISTS', lanes) == 0 then
  local want = count
  while want > 0 do
    local popped = redis.call('ZPOPMIN', pending, want)
    if #popped == 0 then
      break
    end
    for i = 1, #popped, 2 do
      offer(popped[i], popped[i + 1], false)
    end
    want = count - #ids
    if #passed >= LOOK then
      break
    end
    want = math.min(want, LOOK - #passed)
  end
else
  -- The rotation is: default lane (''), then each group in name order, around.
  local last = redis.call('GET', cursor) or ''
  local misses = 0
  while #ids < count and misses <= 1 and #passed < LOOK do
    local nxt
    if last == '' then
      nxt = redis.call('ZRANGE', lanes, '-', '+', 'BYLEX', 'LIMIT', 0, 1)[1]
    else
      nxt = redis.call('ZRANGE', lanes, '(' .. last, '+', 'BYLEX', 'LIMIT', 0, 1)[1]
    end
    local lane = pending
    if nxt then
      lane = base .. 'g:' .. nxt .. ':pending'
      last = nxt
    else
      last = ''
    end
    -- This lane's turn: its first job the caller may take.
    local got = false
    while not got and #passed < LOOK do
      local popped = redis.call('ZPOPMIN', lane, 1)
      if not popped[1] then
        break
      end
      got = offer(popped[1], popped[2], nxt or false)
    end
    if got then
      misses = 0
    elseif not nxt then
      -- The default lane gave nothing: one more such turn after it means every lane did.
      misses = misses + 1
    end
    if nxt and redis.call('EXISTS', lane) == 0 then
      redis.call('ZREM', lanes, nxt)
    end
  end
  redis.call('SET', cursor, last)
end

-- Suspects passed over go back where they were: their place in line is kept.
for _, p in ipairs(passed) do
  local lane = pending
  if p[3] then
    lane = base .. 'g:' .. p[3] .. ':pending'
    redis.call('ZADD', lanes, 0, p[3])
  end
  redis.call('ZADD', lane, p[2], p[1])
end

local out = {}
for i, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local row = rows[i]
  local suspect = tonumber(row[5] or '0') > 0
  -- A row can be missing only when a foreign writer deleted it: skip the id.
  if row[1] then
    -- Rows written before messages had a key of their own hold it as `payload`.
    local message = redis.call('GET', base .. 'msg:' .. id) or row[3] or ''
    local deliveries = redis.call('HINCRBY', job, 'deliveries', 1)
    local claim = deliveries .. '.' .. nonce
    redis.call('HSET', job, 'state', 'active', 'owner', owner, 'claimed_ms', now_ms,
      'claim', claim)
    redis.call('ZADD', active, now_ms + lease_ms, id)
    if suspect then
      local suspects = base .. 'suspects'
      redis.call('HSET', suspects, owner, id .. ' ' .. claim .. ' ' .. here)
      redis.call('PEXPIRE', suspects, SUSPECTS_TTL_MS)
    end
    out[#out + 1] = id
    out[#out + 1] = message
    out[#out + 1] = tonumber(row[2] or '0')
    out[#out + 1] = deliveries
    out[#out + 1] = row[4] and 1 or 0
    out[#out + 1] = suspect and 1 or 0
  end
end
local claimed = #out / 6

if redis.call('ZCARD', pending) == 0 and redis.call('EXISTS', lanes) == 0 then
  -- Nothing left to order: drop the markers, sequences and cursor, so a
  -- drained queue (a reply queue, say) leaves no keys behind.
  redis.call('DEL', wake, seq, head, cursor)
else
  -- Keep the wake list in step with pending: one marker leaves per claimed job,
  -- and a marker popped for a job this call could not take goes back.
  local extra = claimed - held
  if extra > 0 then
    redis.call('RPOP', wake, extra)
  elseif extra < 0 then
    redis.call('LPUSH', wake, 1)
  end
end
if #passed > 0 then
  out[#out + 1] = 'suspect'
end
return out
