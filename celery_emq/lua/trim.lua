--[[ trim: keep the morgue within its retention, by age then by size.
  KEYS[1] dead      <p>:{q}:dead (ZSET, score = time of death ms)
  KEYS[2] base      <p>:{q}: (job rows derive from it)
  ARGV[1] now_ms    '' takes the Redis server's clock
  ARGV[2] max_age_ms  dead jobs older than this are deleted; 0 keeps every age
  ARGV[3] max_size    most dead jobs kept; 0 keeps any number
  ARGV[4] limit       most jobs deleted by this call (1..1000)
  Returns the number of dead jobs deleted; the caller repeats while it equals limit.
]]
local dead, base = KEYS[1], KEYS[2]
local max_age_ms = tonumber(ARGV[2])
local now_ms = tonumber(ARGV[1])
if not now_ms then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local max_size, limit = tonumber(ARGV[3]), tonumber(ARGV[4])

local doomed = {}
if max_age_ms > 0 then
  doomed = redis.call('ZRANGE', dead, '-inf', '(' .. (now_ms - max_age_ms), 'BYSCORE', 'LIMIT', 0, limit)
end
if max_size > 0 and #doomed < limit then
  local excess = redis.call('ZCARD', dead) - #doomed - max_size
  if excess > 0 then
    local more = redis.call('ZRANGE', dead, #doomed, #doomed + math.min(excess, limit - #doomed) - 1)
    for _, id in ipairs(more) do
      doomed[#doomed + 1] = id
    end
  end
end
for _, id in ipairs(doomed) do
  redis.call('ZREM', dead, id)
  redis.call('DEL', base .. 'job:' .. id, base .. 'msg:' .. id)
end
return #doomed
