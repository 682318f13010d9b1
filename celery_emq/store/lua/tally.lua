--[[ tally: a queue's counts, and one page of its fair lanes, in one call.
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane)
  KEYS[2] active    <p>:{q}:active (ZSET)
  KEYS[3] delayed   <p>:{q}:delayed (ZSET)
  KEYS[4] dead      <p>:{q}:dead (ZSET)
  KEYS[5] lanes     <p>:{q}:lanes (ZSET of groups with a lane, by name)
  KEYS[6] base      <p>:{q}: (lane keys and job rows derive from it)
  ARGV[1] offset    first lane of the page (in name order)
  ARGV[2] limit     most lanes in the page (the caller pages through the rest)
  ARGV[3] heads     1: also give each lane's next job's enqueued_ms (for ages)
  Returns {pending (default lane), active, delayed, dead, lanes, group, size, head, ...}:
  the counts, the number of lanes, then per lane of the page its group, its pending
  count and (with heads) the enqueued_ms of its next job, else false.
]]
local pending, active, delayed, dead, lanes, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local offset, limit, heads = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'

local out = {
  redis.call('ZCARD', pending), redis.call('ZCARD', active), redis.call('ZCARD', delayed),
  redis.call('ZCARD', dead), redis.call('ZCARD', lanes)
}
if limit > 0 then
  for _, group in ipairs(redis.call('ZRANGE', lanes, offset, offset + limit - 1)) do
    local lane = base .. 'g:' .. group .. ':pending'
    out[#out + 1] = group
    out[#out + 1] = redis.call('ZCARD', lane)
    local head = false
    if heads then
      local first = redis.call('ZRANGE', lane, 0, 0)[1]
      if first then
        head = redis.call('HGET', base .. 'job:' .. first, 'enqueued_ms') or false
      end
    end
    out[#out + 1] = head
  end
end
return out
