--[[ oldest: when the longest-waiting pending job was enqueued, and the longest-held claim made.
  KEYS[1] pending   <p>:{q}:pending (ZSET, the default lane; score = priority band + sequence)
  KEYS[2] active    <p>:{q}:active (ZSET, score = lease deadline ms)
  KEYS[3] lanes     <p>:{q}:lanes (ZSET of groups with a lane, by name)
  KEYS[4] base      <p>:{q}: (lane keys and job rows derive from it)
  ARGV[1] lane_offset    first lane (in name order) read; the default lane is read when 0
  ARGV[2] lane_limit     most lanes read (0: none)
  ARGV[3] active_offset  first active job read (in deadline order)
  ARGV[4] active_limit   most active jobs read (0: none)
  Returns {enqueued_ms, claimed_ms}: the least `enqueued_ms` of the lanes read and the least
  `claimed_ms` of the active jobs read, each false when none. The caller pages through more
  lanes or active jobs than one call reads.
  Pending: a lane orders its jobs by priority band (BAND wide), then, within a band, behind
  the recovered jobs (scores below the band's base, latest recovery first) in FIFO order
  (scores above it): the first job behind the front is the band's oldest. Each band in use
  costs one ZRANGE from the previous band's end, plus the FRONT recovered longest ago.
  Active: a deadline says nothing of when the job was claimed (renewals move it), so every
  row of the page is read.
]]
--@include band
local pending, active, lanes, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lane_offset, lane_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local active_offset, active_limit = tonumber(ARGV[3]), tonumber(ARGV[4])

local FRONT = 100
-- Priorities are 0..9: more bands than that cannot be in use.
local MAX_BANDS = 16

local oldest = false
local function consider(id, field)
  local ms = tonumber(redis.call('HGET', base .. 'job:' .. id, field))
  if ms and (not oldest or ms < oldest) then
    oldest = ms
  end
end

local function num(x)
  return string.format('%.0f', x)
end

local function walk(lane)
  local from = '-inf'
  for _ = 1, MAX_BANDS do
    local first = redis.call('ZRANGE', lane, from, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
    if not first[1] then
      return
    end
    local score = tonumber(first[2])
    local band = math.floor(score / BAND + 0.5)
    local base_score, top = band * BAND, band * BAND + BAND / 2
    if score < base_score then
      for _, id in ipairs(redis.call('ZRANGE', lane, '(' .. num(base_score), num(score), 'BYSCORE',
          'REV', 'LIMIT', 0, FRONT)) do
        consider(id, 'enqueued_ms')
      end
      local tail = redis.call('ZRANGE', lane, num(base_score), num(top), 'BYSCORE', 'LIMIT', 0, 1)
      if tail[1] then
        consider(tail[1], 'enqueued_ms')
      end
    else
      consider(first[1], 'enqueued_ms')
    end
    from = '(' .. num(top)
  end
end

if lane_offset == 0 then
  walk(pending)
end
if lane_limit > 0 then
  for _, group in ipairs(redis.call('ZRANGE', lanes, lane_offset, lane_offset + lane_limit - 1)) do
    walk(base .. 'g:' .. group .. ':pending')
  end
end
local enqueued = oldest

oldest = false
if active_limit > 0 then
  for _, id in ipairs(redis.call('ZRANGE', active, active_offset, active_offset + active_limit - 1)) do
    consider(id, 'claimed_ms')
  end
end
return {enqueued, oldest}
