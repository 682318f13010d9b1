-- The lane a job waits in: its group's fair lane when it has a group (the group is then
-- listed in `lanes`, where claims look for it), else the queue's default lane.
local function lane_of(base, pending, lanes, group)
  if group and group ~= '' then
    redis.call('ZADD', lanes, 0, group)
    return base .. 'g:' .. group .. ':pending'
  end
  return pending
end
