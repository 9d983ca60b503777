-- ratelimitd: change the operators' runtime limit records and move their generation on, in one step, so
-- that no replica sees the records change without the generation moving.
--
-- KEYS[1]   the records hash (runtime limit id -> record text).
-- KEYS[2]   the generation: each change replaces it with a new random number, so that a Redis that lost
--           it, or a replica promoted before it saw the last changes, never shows a value a ratelimitd
--           replica already knows beside other records.
-- ARGV[1]   the new generation (decimal digits).
-- ARGV[2]   the change: 'put' (ARGV[3] the id, ARGV[4] the record, ARGV[5] the most records not expired
--           by ARGV[6], a time in ms since the epoch, that may be held beside it: a new id past that
--           changes nothing and replies -1, so that replicas setting limits at once never hold more
--           than runtime_limits.max_limits), 'delete' (ARGV[3..] the ids),
--           'purge' (ARGV[3] a time in ms since the epoch, ARGV[4..] ids: each is deleted only if its
--           record as stored now has expired by then, so that a limit set again meanwhile, on another
--           replica, under the same id, stays), or 'announce' (no record changes: after a reset, so
--           that replicas forget what they remember).
--
-- The generation is written first: a command this Redis user may not run leaves at worst a generation
-- moved on with the records unchanged, never records that no replica reads. A delete of ids none of
-- which is held changes nothing, the generation included: every replica would otherwise read the
-- records again and forget what it remembers of the counters (denials, leases) for nothing.
-- Reply: how many records were deleted (0 for 'put' and 'announce'; -1 for a 'put' refused).

local change = ARGV[2]
if change ~= 'put' and change ~= 'delete' and change ~= 'purge' and change ~= 'announce' then
  return redis.error_reply('ERR records.lua: unknown change ' .. tostring(change))
end
-- The ids a delete or a purge deletes, read first (HGET rather than HEXISTS: the ACL users set up for
-- earlier versions allow it).
local doomed = {}
if change == 'delete' then
  for i = 3, #ARGV do
    if redis.call('HGET', KEYS[1], ARGV[i]) then doomed[#doomed + 1] = ARGV[i] end
  end
elseif change == 'purge' then
  local now = tonumber(ARGV[3])
  for i = 4, #ARGV do
    local text = redis.call('HGET', KEYS[1], ARGV[i])
    if text then
      local read, record = pcall(cjson.decode, text)
      local at = read and type(record) == 'table' and record['expires_at_ms']
      if type(at) == 'number' and now and at <= now then doomed[#doomed + 1] = ARGV[i] end
    end
  end
end
if (change == 'delete' or change == 'purge') and #doomed == 0 then return 0 end
if change == 'put' and not redis.call('HGET', KEYS[1], ARGV[3]) then
  local most, now = tonumber(ARGV[5]), tonumber(ARGV[6])
  -- Expired records count in HLEN until purged: below the bound, nothing needs decoding (an ACL user
  -- set up without +hlen, as earlier versions documented it, reads them all instead).
  local counted, len = pcall(redis.call, 'HLEN', KEYS[1])
  if most and now and (not counted or len >= most) then
    local held, all = 0, redis.call('HGETALL', KEYS[1])
    for i = 2, #all, 2 do
      -- Counted as the replicas count them: a record that does not read is in force nowhere.
      local read, record = pcall(cjson.decode, all[i])
      if read and type(record) == 'table' then
        local at = record['expires_at_ms']
        if type(at) ~= 'number' or at > now then held = held + 1 end
      end
    end
    if held >= most then return -1 end
  end
end
redis.call('SET', KEYS[2], ARGV[1])
local deleted = 0
if change == 'put' then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
else
  for _, id in ipairs(doomed) do
    deleted = deleted + redis.call('HDEL', KEYS[1], id)
  end
end
return deleted
