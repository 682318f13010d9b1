--[[ enqueue_many: add many new jobs to one queue, each exactly as enqueue.lua would.
  KEYS[1] pending   <p>:{q}:pending (ZSET)
  KEYS[2] wake      <p>:{q}:wake (LIST, one marker per claimable job)
  KEYS[3] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[4] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[5] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[6] base      <p>:{q}: (job rows, messages, lane keys and soon derive from it)
  KEYS[7] delayed   <p>:{q}:delayed (ZSET, score = ETA ms)
  KEYS[8] etas      <p>:{q}:etas (HASH, Celery task id -> its delayed jobs' ids)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] ttl_ms    > 0 for an x-expires queue: a publish is a use, so the queue lives on
  ARGV[3..] seven items per job, in publish order: id, message, priority (0..9),
            max_stalled ('' = the sweep's default, -1 = never), group ('' = the
            default lane), eta_ms ('' or when it is due), task_id ('' if none)
  Returns one code per job, in order: 0 OK, 3 DUPLICATE (a job with this id exists,
  or came earlier in the same call; nothing changed for it).
  One call does the work of as many enqueue.lua calls, in their order: the same row,
  message, lane and FIFO sequence per job. The tail sequence is read and written
  once, and one LPUSH carries the wake markers (still one per claimable job, so as
  many waiting consumers wake as before). Per job only EXISTS and the row's HSET
  are commands of their own: the messages go in one MSET and each lane's members
  in one ZADD (per CHUNK jobs), sent once every job is read, which leaves the same
  keys as a SET and a ZADD per job (a script runs whole, nothing sees between). A
  delayed job due before every delayed job there was pushes the one `soon` marker,
  as in enqueue.lua.
]]
--@include band
--@include clock
local pending, wake, seq, lanes = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local expires, base, delayed, etas = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local ttl_ms = tonumber(ARGV[2])
local now_ms = clock(ARGV[1])

-- Wake markers pushed per LPUSH (bounds the arguments unpacked at once).
local MARKERS = 1000
-- Jobs per MSET of messages and per ZADD of a lane (2 arguments a job).
local CHUNK = 500

-- Arguments of MSET (key, message) and of each lane's ZADD (score, id).
local messages = {}
local members = {}
local lane_order = {}
local function send(command, key, args)
  for i = 1, #args, 2 * CHUNK do
    if key then
      redis.call(command, key, unpack(args, i, math.min(i + 2 * CHUNK - 1, #args)))
    else
      redis.call(command, unpack(args, i, math.min(i + 2 * CHUNK - 1, #args)))
    end
  end
end

-- The revoke index holds, per Celery task id, the space-separated ids of its delayed jobs
-- (a caller may give one task id to several).
local function index_eta(etas, task, id)
  local ids = redis.call('HGET', etas, task)
  redis.call('HSET', etas, task, ids and (ids .. ' ' .. id) or id)
end

local n = tonumber(redis.call('GET', seq) or '0')
local first_n = n
local codes = {}
local grouped = {}
-- The earliest due time before this call (false: nothing delayed), and whether a
-- job of this call comes before it.
local first = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
local earliest, sooner = tonumber(first[2]), false
for i = 3, #ARGV, 7 do
  local id, message, priority = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local max_stalled, group = ARGV[i + 3], ARGV[i + 4]
  local eta_ms, task_id = tonumber(ARGV[i + 5]), ARGV[i + 6]
  local job = base .. 'job:' .. id
  if redis.call('EXISTS', job) == 1 then
    codes[#codes + 1] = 3
  else
    messages[#messages + 1], messages[#messages + 2] = base .. 'msg:' .. id, message
    local row = {'state', 'pending', 'enqueued_ms', now_ms}
    if priority ~= 0 then
      row[#row + 1], row[#row + 2] = 'priority', priority
    end
    if max_stalled ~= '' then
      row[#row + 1], row[#row + 2] = 'max_stalled', max_stalled
    end
    if group ~= '' then
      row[#row + 1], row[#row + 2] = 'group', group
    end
    if eta_ms and eta_ms > now_ms then
      -- Not due yet: promoted into its queue or lane by promote.lua once it is.
      row[2] = 'delayed'
      row[#row + 1], row[#row + 2] = 'eta_ms', eta_ms
      if task_id ~= '' then
        row[#row + 1], row[#row + 2] = 'task', task_id
        index_eta(etas, task_id, id)
      end
      redis.call('HSET', job, unpack(row))
      redis.call('ZADD', delayed, eta_ms, id)
      if not earliest or eta_ms < earliest then
        sooner = true
      end
    else
      redis.call('HSET', job, unpack(row))
      n = n + 1
      local lane = pending
      if group ~= '' then
        lane = base .. 'g:' .. group .. ':pending'
        if not grouped[group] then
          grouped[group] = true
          redis.call('ZADD', lanes, 0, group)
        end
      end
      local these = members[lane]
      if not these then
        these = {}
        members[lane] = these
        lane_order[#lane_order + 1] = lane
      end
      these[#these + 1], these[#these + 2] = priority * BAND + n, id
    end
    codes[#codes + 1] = 0
  end
end

send('MSET', nil, messages)
for _, lane in ipairs(lane_order) do
  send('ZADD', lane, members[lane])
end

local claimable = n - first_n
if claimable > 0 then
  redis.call('SET', seq, n)
  local markers = {}
  for i = 1, math.min(claimable, MARKERS) do
    markers[i] = 1
  end
  local left = claimable
  while left > 0 do
    local now = math.min(left, MARKERS)
    if now < #markers then
      for i = now + 1, #markers do
        markers[i] = nil
      end
    end
    redis.call('LPUSH', wake, unpack(markers))
    left = left - now
  end
end
if sooner and redis.call('EXISTS', base .. 'soon') == 0 then
  redis.call('LPUSH', base .. 'soon', 1)
  redis.call('PEXPIRE', base .. 'soon', 60000)  -- as in enqueue.lua
end
-- Rows never expire one by one: an x-expires queue expires as a whole once
-- unused for ttl_ms (the sweep purges it when this key is gone).
if ttl_ms > 0 then
  redis.call('SET', expires, 1, 'PX', ttl_ms)
end
return codes
