-- ratelimitd: decide every check of one request (or of one Cluster hash slot) atomically.
--
-- KEYS[i]   state key of check i. Fixed window: the counter key, ending with the window start (the
--           reference layout). Other algorithms: one key per descriptor and limit.
-- ARGV[1]   1: consume every allowed check (and count every fixed-window hit) even when the request is
--           denied; 0: consume only if the request is allowed.
-- ARGV[2]   1: these are all the checks of the request (quota checks may deny); 0: a part of them;
--           2: a part of them, and the request is already denied by a check elsewhere (decide, and consume
--           only what a denied request consumes).
-- ARGV[3]   extra seconds of TTL for fixed-window counters this call creates (expiry jitter).
-- ARGV[4..] seven integers per check i: algorithm (0 fixed window, 1 sliding window, 2 sliding log,
--           3 token bucket, 4 GCRA), limit, window (ms), cost, role (0 enforce, 1 shadow, 2 quota),
--           burst, fixed-window start (s; 0 for the other algorithms).
--
-- Reply: { status, denied, server time (ms), then per check: allowed (1/0), remaining, reset (ms),
--          retry (ms) }.
--   status 0: decided. status 1: a fixed-window start disagrees with this server's clock; nothing was
--   read or written, and the caller retries with keys for the server time it is given.
--
-- Every number must be a whole number from 0 to 2^53 (costs arrive bounded by what the limit could
-- ever allow); anything else is refused before anything is read or written.
--
-- A sliding-log key is a sorted set with one member per counted request, `<time>:<seq>:<cost>` scored
-- by its time (members `<time>:<seq>` of earlier versions count 1 each): its memory follows requests,
-- never the hits they carry.
--
-- The arithmetic mirrors src/algorithm/mod.rs operation for operation, so the memory store and Redis
-- give the same answers. Time is the Redis server's (TIME), so replicas with skewed clocks agree.
--
-- The client side of this contract (argument layout, codes, reply parsing) is src/store/redis/script.rs;
-- change both together. Each algorithm is one block below: how its state is read, decided and written.

for i = 3, #ARGV do
  local v = tonumber(ARGV[i])
  if v == nil or v < 0 or v > 9007199254740992 or v ~= math.floor(v) then
    return redis.error_reply('ratelimitd: argument ' .. i .. ' is not a whole number from 0 to 2^53')
  end
end

local consume_on_deny = ARGV[1] == '1'
local complete = ARGV[2] == '1'
local known_denied = ARGV[2] == '2'
local jitter = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS

local function ceil0(x)
  if x < 0 then return 0 end
  return math.ceil(x)
end

-- The algorithms by id, one block each. A check `c` carries alg, limit, w (window, ms), cost, role,
-- burst and key.
--   load(c)            the state stored under c.key, or nil when the key holds nothing
--   decide(c, s, cost) allowed, remaining, reset (ms), retry (ms), and the state after (s may be nil)
--   save(c, s)         writes the state after back under c.key, with its expiry
--   in_window(c, start) (fixed window only) whether the key's window start (s) is this server's
--   counts_denied      (fixed window only) a denied hit is counted too
local algorithms = {}

-- 0: fixed window. An integer counter per window; its key ends with the window start.
algorithms[0] = {
  counts_denied = true,

  in_window = function(c, start)
    local ws = c.w / 1000
    local now_s = math.floor(now / 1000)
    return now_s - (now_s % ws) == start
  end,

  load = function(c)
    local count = redis.call('GET', c.key)
    if not count then return nil end
    return { start = now - now % c.w, count = tonumber(count), stored = tonumber(count) }
  end,

  decide = function(c, s, cost)
    local start = now - now % c.w
    local count = 0
    if s and s.start == start then count = s.count end
    local after = count + cost
    local allowed = after <= c.limit
    local reset = c.w - now % c.w
    local remaining, retry = 0, reset
    if allowed then remaining = math.max(c.limit - after, 0); retry = 0 end
    return allowed, remaining, reset, retry,
      { start = start, count = after, stored = s and s.stored or 0 }
  end,

  save = function(c, s)
    local after = redis.call('INCRBY', c.key, s.count - s.stored)
    -- The TTL is set once, when this call created the counter.
    if after == s.count - s.stored then
      redis.call('EXPIRE', c.key, c.w / 1000 + jitter)
    end
  end,
}

-- 1: sliding window. A hash: window start `s`, its count `c`, the previous window's count `p`.
local function sliding_window_wait(c, current, previous, elapsed, cost)
  local w, limit = c.w, c.limit
  if cost > limit then return c.w * 2 - elapsed end
  local left = w - elapsed
  if current + cost <= limit and previous > 0 then
    return ceil0(left - (limit - current - cost) * w / previous)
  end
  local t = 0
  if current > 0 then t = math.max(w - (limit - cost) * w / current, 0) end
  return math.ceil(left + t)
end

algorithms[1] = {
  load = function(c)
    local v = redis.call('HMGET', c.key, 's', 'c', 'p')
    if not v[1] then return nil end
    return { start = tonumber(v[1]), current = tonumber(v[2]), previous = tonumber(v[3]) }
  end,

  decide = function(c, s, cost)
    local w = c.w
    local start = now - now % w
    local current, previous = 0, 0
    if s then
      if s.start == start then current, previous = s.current, s.previous
      elseif s.start + w == start then previous = s.current end
    end
    local elapsed = now - start
    local weight = (w - elapsed) / w
    local estimate = previous * weight + current
    local allowed = estimate + cost <= c.limit
    local after_current, after_estimate = current, estimate
    if allowed then after_current, after_estimate = current + cost, estimate + cost end
    local reset = 0
    if after_current > 0 then reset = start + 2 * w - now
    elseif previous > 0 then reset = start + w - now end
    local remaining, retry = 0, 0
    if allowed then remaining = math.floor(math.max(c.limit - after_estimate, 0))
    else retry = sliding_window_wait(c, current, previous, elapsed, cost) end
    return allowed, remaining, reset, retry, { start = start, current = after_current, previous = previous }
  end,

  save = function(c, s)
    redis.call('HSET', c.key, 's', s.start, 'c', s.current, 'p', s.previous)
    redis.call('PEXPIRE', c.key, s.start + 2 * c.w - now)
  end,
}

-- 2: sliding log. A sorted set with one member per counted request, `<time>:<seq>:<cost>` scored by its
-- time (members `<time>:<seq>` of earlier versions count 1 each). `new` holds the costs this call adds.
algorithms[2] = {
  load = function(c)
    local v = redis.call('ZRANGEBYSCORE', c.key, '(' .. (now - c.w), '+inf', 'WITHSCORES')
    local entries = {}
    for j = 1, #v, 2 do
      entries[#entries + 1] = { tonumber(v[j + 1]), tonumber(string.match(v[j], '^%d+:%d+:(%d+)$')) or 1 }
    end
    return { entries = entries, new = {} }
  end,

  decide = function(c, s, cost)
    local entries, new, count = {}, {}, 0
    if s then
      for j = 1, #s.entries do
        local e = s.entries[j]
        if e[1] + c.w > now then
          entries[#entries + 1] = e
          count = count + e[2]
        end
      end
      for j = 1, #s.new do new[j] = s.new[j] end
    end
    local allowed = count + cost <= c.limit
    local retry = 0
    if not allowed then
      if cost > c.limit then retry = c.w
      else
        -- Enough of the oldest requests must leave the window to free `count + cost - limit` hits.
        local must_leave, left = count + cost - c.limit, 0
        retry = c.w
        for j = 1, #entries do
          left = left + entries[j][2]
          if left >= must_leave then
            retry = entries[j][1] + c.w - now
            break
          end
        end
      end
    elseif cost > 0 then
      entries[#entries + 1] = { now, cost }
      new[#new + 1] = cost
    end
    local reset = 0
    if #entries > 0 then reset = entries[#entries][1] + c.w - now end
    local remaining = 0
    if allowed then remaining = c.limit - count - cost end
    return allowed, remaining, reset, retry, { entries = entries, new = new }
  end,

  save = function(c, s)
    redis.call('ZREMRANGEBYSCORE', c.key, '-inf', now - c.w)
    local card = redis.call('ZCARD', c.key)
    for j = 1, #s.new do
      redis.call('ZADD', c.key, now, now .. ':' .. (card + j) .. ':' .. s.new[j])
    end
    redis.call('PEXPIRE', c.key, c.w)
  end,
}

-- 3: token bucket. A hash: tokens `t` (a float) and the time they were counted `l`.
algorithms[3] = {
  load = function(c)
    local v = redis.call('HMGET', c.key, 't', 'l')
    if not v[1] then return nil end
    return { tokens = tonumber(v[1]), last = tonumber(v[2]) }
  end,

  decide = function(c, s, cost)
    local capacity = c.burst
    local per_ms = c.limit / c.w
    local tokens = capacity
    if s then tokens = math.min(s.tokens + math.max(now - s.last, 0) * per_ms, capacity) end
    local allowed = cost <= tokens
    local after = tokens
    if allowed then after = tokens - cost end
    local function refill(missing)
      if per_ms > 0 then return ceil0(missing / per_ms) end
      return c.w
    end
    local retry = 0
    if not allowed then
      if cost > capacity then retry = c.w else retry = refill(cost - tokens) end
    end
    local remaining = 0
    if allowed then remaining = math.floor(after) end
    return allowed, remaining, refill(capacity - after), retry, { tokens = after, last = now }
  end,

  save = function(c, s)
    -- Until the bucket is full again (as the memory store keeps it): one that never refills
    -- (requests_per_unit 0) keeps its state for burst x window, not for a moment.
    local full_in = ceil0((c.burst - s.tokens) * c.w / math.max(c.limit, 1)) + 1
    redis.call('HSET', c.key, 't', string.format('%.17g', s.tokens), 'l', s.last)
    redis.call('PEXPIRE', c.key, full_in)
  end,
}

-- 4: GCRA. A string: the theoretical arrival time in microseconds.
algorithms[4] = {
  load = function(c)
    local tat = redis.call('GET', c.key)
    if not tat then return nil end
    return { tat = tonumber(tat) }
  end,

  decide = function(c, s, cost)
    local interval = c.w * 1000.0 / math.max(c.limit, 1)
    local capacity = interval * c.burst
    local now_us = now * 1000.0
    local tat = now_us
    if s then tat = math.max(s.tat, now_us) end
    local new_tat = tat + cost * interval
    local allowed = c.limit > 0 and new_tat - now_us <= capacity
    local kept = tat
    if allowed then kept = new_tat end
    local remaining = math.max(math.floor((capacity - (kept - now_us)) / interval), 0)
    local retry = 0
    if not allowed then
      if c.limit == 0 or cost > c.burst then retry = c.w
      else retry = ceil0((new_tat - capacity - now_us) / 1000.0) end
      remaining = 0
    end
    return allowed, remaining, ceil0((kept - now_us) / 1000.0), retry, { tat = math.ceil(kept) }
  end,

  save = function(c, s)
    redis.call('SET', c.key, string.format('%d', s.tat), 'PX', ceil0(s.tat / 1000 - now) + 1)
  end,
}

-- The checks, refused before anything is read when an algorithm is unknown or a key's window is not
-- this server's.
local checks = {}
for i = 1, n do
  local a = 3 + (i - 1) * 7
  local c = {
    alg = tonumber(ARGV[a + 1]), limit = tonumber(ARGV[a + 2]), w = tonumber(ARGV[a + 3]),
    cost = tonumber(ARGV[a + 4]), role = tonumber(ARGV[a + 5]), burst = tonumber(ARGV[a + 6]),
    key = KEYS[i],
  }
  local algorithm = algorithms[c.alg]
  if algorithm == nil then
    return redis.error_reply('ratelimitd: argument ' .. (a + 1) .. ' is not a known algorithm')
  end
  if algorithm.in_window and not algorithm.in_window(c, tonumber(ARGV[a + 7])) then
    return { 1, 0, now }
  end
  c.algorithm = algorithm
  checks[i] = c
end

-- A copy of a state, so that the state as loaded survives the decisions made on it.
local function copy(s)
  if s == nil then return nil end
  local c = {}
  for k, v in pairs(s) do c[k] = v end
  if s.entries then
    c.entries, c.new = {}, {}
    for j = 1, #s.entries do c.entries[j] = s.entries[j] end
    for j = 1, #s.new do c.new[j] = s.new[j] end
  end
  return c
end

-- Decide in order; a key checked twice in one call sees the earlier checks' costs.
local state, loaded, original = {}, {}, {}
local allowed, results = {}, {}
for i = 1, n do
  local c = checks[i]
  if not loaded[c.key] then
    state[c.key] = c.algorithm.load(c)
    original[c.key] = copy(state[c.key])
    loaded[c.key] = true
  end
  local ok, remaining, reset, retry, next_state = c.algorithm.decide(c, state[c.key], c.cost)
  allowed[i] = ok
  results[i] = { remaining, reset, retry }
  if c.cost > 0 and (ok or c.algorithm.counts_denied) then
    state[c.key] = next_state
    c.changed = true
  end
end

local denied = known_denied
local quota, quota_over = 0, 0
for i = 1, n do
  if checks[i].role == 0 and not allowed[i] then
    denied = true
  elseif checks[i].role == 2 then
    quota = quota + 1
    if not allowed[i] then quota_over = quota_over + 1 end
  end
end
if complete and quota > 0 and quota == quota_over then denied = true end
local consume = consume_on_deny or not denied

if consume then
  local written = {}
  for i = 1, n do
    local c = checks[i]
    if c.changed and not written[c.key] then
      written[c.key] = true
      c.algorithm.save(c, state[c.key])
    end
  end
end

local reply = { 0, denied and 1 or 0, now }
for i = 1, n do
  local c = checks[i]
  local remaining, reset, retry = results[i][1], results[i][2], results[i][3]
  if allowed[i] and not consume then
    -- Allowed but not consumed: the quota as it stands.
    local _, r, z = c.algorithm.decide(c, original[c.key], 0)
    remaining, reset = r, z
  end
  reply[#reply + 1] = allowed[i] and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
return reply
