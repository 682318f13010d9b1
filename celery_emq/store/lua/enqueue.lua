--[[ enqueue: add a new job, claimable now or, with an ETA in the future, when it is due.
  KEYS[1] pending   <p>:{q}:pending (ZSET)
  KEYS[2] wake      <p>:{q}:wake (LIST, one marker per claimable job)
  KEYS[3] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[4] job       <p>:{q}:job:<id> (HASH, the job's small fields)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[6] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[7] base      <p>:{q}: (lane keys g:<group>:pending and soon derive from it)
  KEYS[8] msg       <p>:{q}:msg:<id> (STRING, the stored message)
  KEYS[9] delayed   <p>:{q}:delayed (ZSET, score = ETA ms)
  KEYS[10] etas     <p>:{q}:etas (HASH, Celery task id -> its delayed jobs' ids)
  ARGV[1] id        job id (the message's delivery tag)
  ARGV[2] message   the stored message (see celery_emq/codec.py)
  ARGV[3] priority  0..9, lower is claimed first
  ARGV[4] now_ms    '' takes the Redis server's clock
  ARGV[5] ttl_ms    > 0 for an x-expires queue: a publish is a use, so the queue lives on
  ARGV[6] max_stalled  this job's own stall budget ('' = the sweep's default, -1 = never)
  ARGV[7] group     fair-lane group ('' = the queue's default lane, pending)
  ARGV[8] eta_ms    '' or the time the job is due; a job not yet due waits in `delayed`
  ARGV[9] task_id   the Celery task id ('' if none): a delayed job is found by it (revoke)
  A delayed job due before every other delayed job of the queue pushes a marker on
  <p>:{q}:soon (LIST, one marker at most): consumers wait until the earliest due
  time they know of, and one of them scans again when it pops it.
  Returns 0 OK, 3 DUPLICATE (a job with this id exists; nothing changed).
  The row holds only what is not implied elsewhere: the queue is in the key, a stall
  count and a claim count appear on first use, a zero priority is not written.
]]
--@include band
--@include clock
local pending, wake, seq, job, lanes = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local expires, base, msg, delayed, etas = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local id, message = ARGV[1], ARGV[2]
local priority, ttl_ms = tonumber(ARGV[3]), tonumber(ARGV[5])
local now_ms = clock(ARGV[4])
local max_stalled, group = ARGV[6], ARGV[7]
local eta_ms, task_id = tonumber(ARGV[8]), ARGV[9]

if redis.call('EXISTS', job) == 1 then
  return 3
end
redis.call('SET', msg, message)
redis.call('HSET', job, 'state', 'pending', 'enqueued_ms', now_ms)
if priority ~= 0 then
  redis.call('HSET', job, 'priority', priority)
end
if max_stalled ~= '' then
  redis.call('HSET', job, 'max_stalled', max_stalled)
end
if group ~= '' then
  redis.call('HSET', job, 'group', group)
end
-- The revoke index holds, per Celery task id, the space-separated ids of its delayed jobs
-- (a caller may give one task id to several).
local function index_eta(etas, task, id)
  local ids = redis.call('HGET', etas, task)
  redis.call('HSET', etas, task, ids and (ids .. ' ' .. id) or id)
end
if eta_ms and eta_ms > now_ms then
  -- Not due yet: promoted into its queue or lane by promote.lua once it is.
  redis.call('HSET', job, 'state', 'delayed', 'eta_ms', eta_ms)
  if task_id ~= '' then
    redis.call('HSET', job, 'task', task_id)
    index_eta(etas, task_id, id)
  end
  local first = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
  if (not first[2] or eta_ms < tonumber(first[2])) and redis.call('EXISTS', base .. 'soon') == 0 then
    redis.call('LPUSH', base .. 'soon', 1)
    -- Not popped (no consumer waits) it goes: a consumer's next look, or the
    -- sweep, finds the due time anyway.
    redis.call('PEXPIRE', base .. 'soon', 60000)
  end
  redis.call('ZADD', delayed, eta_ms, id)
else
  local n = redis.call('INCR', seq)
  local lane = pending
  if group ~= '' then
    lane = base .. 'g:' .. group .. ':pending'
    redis.call('ZADD', lanes, 0, group)
  end
  redis.call('ZADD', lane, priority * BAND + n, id)
  redis.call('LPUSH', wake, 1)
end
-- Rows never expire one by one: an x-expires queue expires as a whole once
-- unused for ttl_ms (the sweep purges it when this key is gone).
if ttl_ms > 0 then
  redis.call('SET', expires, 1, 'PX', ttl_ms)
end
return 0
