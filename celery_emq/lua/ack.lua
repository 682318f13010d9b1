--[[ ack: a job is done; delete it.
  KEYS[1] active    <p>:{q}:active (ZSET)
  KEYS[2] pending   <p>:{q}:pending (ZSET)
  KEYS[3] job       <p>:{q}:job:<id> (HASH)
  KEYS[4] completed <p>:{q}:metrics:completed (HASH, field count)
  KEYS[5] base      <p>:{q}: (lane keys derive from it)
  ARGV[1] id
  ARGV[2] owner     worker identity that acks
  Returns 0 OK (acked under this owner's lease), 1 NOT_FOUND,
  2 LEASE_LOST (the lease had lapsed or passed to another owner; the job is
  deleted anyway, since it has completed), 4 DEAD (in the morgue; kept).
]]
local active, pending, job, completed, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, owner = ARGV[1], ARGV[2]

local row = redis.call('HMGET', job, 'state', 'owner', 'group')
if not row[1] then
  return 1
end
if row[1] == 'dead' then
  return 4
end
redis.call('ZREM', active, id)
if row[1] == 'pending' then
  -- Acked after a reaper put it back: it is done, so it must not run again.
  if row[3] then
    redis.call('ZREM', base .. 'g:' .. row[3] .. ':pending', id)
  else
    redis.call('ZREM', pending, id)
  end
end
redis.call('DEL', job)
redis.call('HINCRBY', completed, 'count', 1)
if row[1] == 'active' and row[2] == owner then
  return 0
end
return 2
