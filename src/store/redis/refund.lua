-- ratelimitd: give back what a Cluster slot consumed for a request that another slot denied.
--
-- KEYS[i]   state key check i consumed from.
-- ARGV[1]   the server time (ms) of the decide call that consumed.
-- ARGV[2..] five integers per key i: algorithm (0 fixed window, 1 sliding window, 2 sliding log,
--           3 token bucket, 4 GCRA), hits to give back, window (ms), limit, burst.
--
-- State that has expired or moved on in the meantime is left alone rather than made negative.
-- Reply: 0.

local stamp = tonumber(ARGV[1])
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 5
  local alg, hits, w = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local limit, burst = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local key = KEYS[i]
  if hits > 0 and redis.call('EXISTS', key) == 1 then
    if alg == 0 then
      redis.call('DECRBY', key, hits)
    elseif alg == 1 then
      local start = stamp - stamp % w
      local v = redis.call('HMGET', key, 's', 'c', 'p')
      if tonumber(v[1]) == start then
        redis.call('HSET', key, 'c', math.max(tonumber(v[2]) - hits, 0))
      elseif tonumber(v[1]) == start + w then
        redis.call('HSET', key, 'p', math.max(tonumber(v[3]) - hits, 0))
      end
    elseif alg == 2 then
      -- The call's entry: counted at the stamp, holding every hit that call added to the key (this
      -- request's among them). Take this request's hits out of it.
      local members = redis.call('ZRANGEBYSCORE', key, stamp, stamp)
      for j = 1, #members do
        local seq, held = string.match(members[j], '^%d+:(%d+):(%d+)$')
        held = tonumber(held) or 1
        if held >= hits then
          redis.call('ZREM', key, members[j])
          if held > hits then
            redis.call('ZADD', key, stamp, stamp .. ':' .. (seq or 0) .. ':' .. (held - hits))
          end
          -- The log's `hits` member, scored minus the hits it holds (see decide.lua), follows. A Redis
          -- ACL user set up for earlier versions may lack ZSCORE or ZINCRBY: the member then goes, and the
          -- next call counts the log whole.
          local held_sum = redis.pcall('ZSCORE', key, 'hits')
          if type(held_sum) == 'table' and held_sum.err then
            redis.call('ZREM', key, 'hits')
          elseif held_sum then
            local moved = redis.pcall('ZINCRBY', key, hits, 'hits')
            if type(moved) == 'table' and moved.err then redis.call('ZREM', key, 'hits') end
          end
          break
        end
      end
    elseif alg == 3 then
      local tokens = tonumber(redis.call('HGET', key, 't'))
      redis.call('HSET', key, 't', string.format('%.17g', math.min(tokens + hits, burst)))
    else
      local tat = tonumber(redis.call('GET', key))
      local interval = math.ceil(w * 1000 / math.max(limit, 1))
      redis.call('SET', key, string.format('%d', math.ceil(tat - hits * interval)), 'KEEPTTL')
    end
  end
end
return 0
