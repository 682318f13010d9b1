--[[ budget: write a task's own stall budget on its job's row, only while the row exists.
  A row deleted meanwhile (acked, purged, trimmed, expired) is not re-created: a
  plain HSET would leave a one-field row with no TTL, never deleted.
  KEYS[1] job       <p>:{q}:job:<id> (HASH)
  ARGV[1] budget    the task's emq_max_stalled (-1: no limit)
  Returns 1 when written, 0 when the row was gone.
]]
local job = KEYS[1]
local budget = ARGV[1]

if redis.call('EXISTS', job) == 0 then
  return 0
end
redis.call('HSET', job, 'max_stalled', budget)
return 1
