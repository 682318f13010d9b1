-- A waiting job taken out of its queue or lane (acked or buried before a claim): one
-- fewer claimable job, one fewer wake marker; a group with no lane left leaves `lanes`,
-- so claims and wake-ups no longer look at it.
local function unqueue(base, pending, wake, id, group)
  local lane = pending
  if group then
    lane = base .. 'g:' .. group .. ':pending'
  end
  if redis.call('ZREM', lane, id) == 1 then
    redis.call('RPOP', wake)
  end
  if group and redis.call('EXISTS', lane) == 0 then
    redis.call('ZREM', base .. 'lanes', group)
  end
end
