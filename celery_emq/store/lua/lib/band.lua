-- A pending job's score is its priority band, 2^40 wide, plus its sequence: lower priority
-- numbers first, FIFO within a band by the tail sequence (the head counts down from it).
local BAND = 1099511627776
