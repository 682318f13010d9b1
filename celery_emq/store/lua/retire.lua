--[[ retire: settle a job the sweep doomed: into the morgue, or deleted as done.
  The sweep (sweep.lua) counts nothing for a job past its budget of stalls or lapses:
  it leaves it lapsed in `active`, its row marked `doomed` with its claim id, and
  returns it. Its caller asks the result backend whether the task succeeded after all
  (an ack the server lost) and then calls this script. A caller that dies before it
  leaves the job where the next sweep finds it again.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[3] job       <p>:{q}:job:<id> (HASH)
  KEYS[4] base      <p>:{q}: (msg:<id> and metrics:<name> derive from it)
  ARGV[1] id
  ARGV[2] succeeded 1: its task is known to have succeeded
  ARGV[3] now_ms    '' takes the Redis server's clock
  Returns 0 OK (dead-lettered with the reason its row holds: counted in
  metrics:failed, and in metrics:stalled unless the reason is never_started),
  7 COMPLETED (its task succeeded, or an older claim completed it: deleted and
  counted completed, never dead-lettered), 1 NOT_FOUND (no live claim marked
  doomed: the job was settled since, or retired by another sweep).
]]
--@include clock
--@include live
local active, dead, job, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, succeeded = ARGV[1], ARGV[2] == '1'
local now_ms = clock(ARGV[3])

-- A counter ends this long after its last change (30 days): a queue gone for good leaves none.
local COUNTER_TTL_MS = 2592000000

local function count(name, reason)
  local key = base .. 'metrics:' .. name
  redis.call('HINCRBY', key, 'count', 1)
  if reason then
    redis.call('HINCRBY', key, 'reason:' .. reason, 1)
  end
  redis.call('PEXPIRE', key, COUNTER_TTL_MS)
end

local row = redis.call('HMGET', job, 'state', 'deliveries', 'claim', 'doomed', 'completed', 'reason')
local live = live_claim(row[2], row[3])
if row[1] ~= 'active' or not row[4] or row[4] ~= live
    or not redis.call('ZSCORE', active, id) then
  return 1
end
redis.call('ZREM', active, id)
if succeeded or row[5] then
  redis.call('DEL', job, base .. 'msg:' .. id)
  count('completed')
  return 7
end
local reason = row[6] or 'lease_expired'
redis.call('HSET', job, 'state', 'dead', 'owner', '', 'died_ms', now_ms)
redis.call('HDEL', job, 'doomed')
redis.call('ZADD', dead, now_ms, id)
if reason ~= 'never_started' then
  count('stalled', reason)
end
count('failed', reason)
return 0
