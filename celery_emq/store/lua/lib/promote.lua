-- A delayed job made claimable: it leaves `delayed` and the revoke index, joins the tail
-- of its queue or lane (in ETA order, as promotions come), and pushes one wake marker.
-- Returns false if it was no longer delayed. (Include band, etas and lane first.)
local function promote_one(base, delayed, etas, pending, lanes, seq, wake, id)
  if redis.call('ZREM', delayed, id) == 0 then
    return false
  end
  local job = base .. 'job:' .. id
  local row = redis.call('HMGET', job, 'priority', 'group', 'task')
  if row[3] then
    unindex_eta(etas, row[3], id)
  end
  local lane = lane_of(base, pending, lanes, row[2])
  redis.call('ZADD', lane, tonumber(row[1] or '0') * BAND + redis.call('INCR', seq), id)
  redis.call('HSET', job, 'state', 'pending')
  redis.call('HDEL', job, 'task')
  redis.call('LPUSH', wake, 1)
  return true
end
