-- ratelimitd: clear a counter that quota leases may hold hits of (an operator's reset), and mark when,
-- in one step.
--
-- KEYS[1]   the counter (a fixed or sliding window).
-- KEYS[2]   its reset mark, in the same hash slot (src/store/keys.rs, reset_mark).
-- ARGV[1]   how long the mark lasts (ms): longer than any lease granted before the reset can be held.
--
-- The mark holds this server's time (ms, as decide.lua reads it). Hits a replica gives back from a
-- lease granted before it were counted in the counter deleted here, so decide.lua gives none of them
-- to the counter requests create again after the reset. Replies 1 if the counter existed, else 0.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[2], string.format('%d', now), 'PX', ARGV[1])
return redis.call('DEL', KEYS[1])
