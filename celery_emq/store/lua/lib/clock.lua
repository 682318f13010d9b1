-- The time a transition happens at, in ms: the caller's when it gives one (a test's
-- fixed clock), else the Redis server's, on which every deadline is read.
local function clock(given)
  local now = tonumber(given)
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end
