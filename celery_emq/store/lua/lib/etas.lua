-- The revoke index holds, per Celery task id, the space-separated ids of its delayed jobs:
-- one leaving the delayed set leaves the index; the others stay revocable.
local function unindex_eta(etas, task, id)
  local ids = redis.call('HGET', etas, task)
  if not ids then
    return
  end
  local kept = {}
  for other in string.gmatch(ids, '%S+') do
    if other ~= id then
      kept[#kept + 1] = other
    end
  end
  if #kept == 0 then
    redis.call('HDEL', etas, task)
  else
    redis.call('HSET', etas, task, table.concat(kept, ' '))
  end
end
