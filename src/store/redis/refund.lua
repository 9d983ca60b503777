-- ratelimitd: give back hits a Cluster slot consumed for a request that another slot denied.
--
-- KEYS[i]   counter key the hits were added to.
-- ARGV[i]   hits to take back from KEYS[i].
--
-- A counter that has expired in the meantime is left alone rather than created negative.
-- Reply: 0.

for i = 1, #KEYS do
  local hits = tonumber(ARGV[i])
  if hits > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('DECRBY', KEYS[i], hits)
  end
end
return 0
