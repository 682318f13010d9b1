--[[ enqueue: make a new job claimable.
  KEYS[1] pending   <p>:{q}:pending (ZSET)
  KEYS[2] wake      <p>:{q}:wake (LIST, one marker per claimable job)
  KEYS[3] seq       <p>:{q}:seq (STRING, tail sequence)
  KEYS[4] job       <p>:{q}:job:<id> (HASH)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane, score 0)
  KEYS[6] expires   <p>:{q}:expires (STRING, present while an x-expires queue is in use)
  KEYS[7] base      <p>:{q}: (lane keys g:<group>:pending derive from it)
  ARGV[1] id        job id (the message's delivery tag)
  ARGV[2] payload   the kombu message, JSON
  ARGV[3] queue     queue name, stored on the row
  ARGV[4] priority  0..9, lower is claimed first
  ARGV[5] now_ms    '' takes the Redis server's clock
  ARGV[6] ttl_ms    > 0 for an x-expires queue: a publish is a use, so the queue lives on
  ARGV[7] max_stalled  this job's own stall budget ('' = the sweep's default, -1 = never)
  ARGV[8] group     fair-lane group ('' = the queue's default lane, pending)
  Returns 0 OK, 3 DUPLICATE (a job with this id exists; nothing changed).
]]
local pending, wake, seq, job, lanes = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local expires, base = KEYS[6], KEYS[7]
local id, payload, queue = ARGV[1], ARGV[2], ARGV[3]
local priority, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[6])
local now_ms = tonumber(ARGV[5])
if not now_ms then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local max_stalled, group = ARGV[7], ARGV[8]

-- Priority bands are 2^40 wide: FIFO within a band by the tail sequence.
local BAND = 1099511627776

if redis.call('EXISTS', job) == 1 then
  return 3
end
local n = redis.call('INCR', seq)
redis.call('HSET', job, 'payload', payload, 'queue', queue, 'state', 'pending',
  'priority', priority, 'stalled', 0, 'deliveries', 0, 'enqueued_ms', now_ms)
if max_stalled ~= '' then
  redis.call('HSET', job, 'max_stalled', max_stalled)
end
local lane = pending
if group ~= '' then
  lane = base .. 'g:' .. group .. ':pending'
  redis.call('HSET', job, 'group', group)
  redis.call('ZADD', lanes, 0, group)
end
redis.call('ZADD', lane, priority * BAND + n, id)
redis.call('LPUSH', wake, 1)
-- Rows never expire one by one: an x-expires queue expires as a whole once
-- unused for ttl_ms (the sweep purges it when this key is gone).
if ttl_ms > 0 then
  redis.call('SET', expires, 1, 'PX', ttl_ms)
end
return 0
