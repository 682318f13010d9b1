-- A job's live claim: its claim id, or its delivery count if a version that keeps no
-- claim id (0.2.0) made it (the claim id then names an older claim).
local function live_claim(deliveries, claim)
  if claim and string.match(claim, '^%d+') == deliveries then
    return claim
  end
  return deliveries
end
