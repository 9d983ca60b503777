-- ratelimitd: decide every check of one request (or of one Cluster hash slot) atomically.
--
-- KEYS[i]   counter key of check i: the fixed-window key, ending with the window start.
-- ARGV[1]   1: consume every check even when the request is denied; 0: consume only if allowed.
-- ARGV[2]   1: these are all the checks of the request (quota checks may deny); 0: a part of them.
-- ARGV[3]   extra seconds of TTL for counters this call creates (expiry jitter).
-- ARGV[4..] five integers per check i: limit, window (seconds), cost, role (0 enforce, 1 shadow,
--           2 quota), window start the caller computed.
--
-- Reply: { status, denied, server time in ms, then per check: allowed (1/0), remaining, reset seconds }.
--   status 0: decided. status 1: a window start disagrees with this server's clock; nothing was
--   read or written, and the caller retries with keys for the server time it is given.
-- Time is the Redis server's (TIME), so replicas with skewed clocks count in the same windows.

local consume_on_deny = ARGV[1] == '1'
local complete = ARGV[2] == '1'
local jitter = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1])
local now_ms = now * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS

local limit, window, cost, role = {}, {}, {}, {}
for i = 1, n do
  local a = 3 + (i - 1) * 5
  limit[i] = tonumber(ARGV[a + 1])
  window[i] = tonumber(ARGV[a + 2])
  cost[i] = tonumber(ARGV[a + 3])
  role[i] = tonumber(ARGV[a + 4])
  if now - (now % window[i]) ~= tonumber(ARGV[a + 5]) then
    return { 1, 0, now_ms }
  end
end

-- Counts as they stand, with earlier checks on the same key in this call added.
local count, allowed, pending = {}, {}, {}
for i = 1, n do
  local key = KEYS[i]
  local current = pending[key]
  if current == nil then
    current = tonumber(redis.call('GET', key) or '0')
  end
  count[i] = current
  allowed[i] = current + cost[i] <= limit[i]
  pending[key] = current + cost[i]
end

local denied = false
local quota, quota_over = 0, 0
for i = 1, n do
  if role[i] == 0 and not allowed[i] then
    denied = true
  elseif role[i] == 2 then
    quota = quota + 1
    if not allowed[i] then quota_over = quota_over + 1 end
  end
end
if complete and quota > 0 and quota == quota_over then denied = true end

local consume = consume_on_deny or not denied
if consume then
  for i = 1, n do
    if cost[i] > 0 then
      local after = redis.call('INCRBY', KEYS[i], cost[i])
      -- The TTL is set once, when this call created the counter.
      if after == cost[i] then
        redis.call('EXPIRE', KEYS[i], window[i] + jitter)
      end
    end
  end
end

local reply = { 0, denied and 1 or 0, now_ms }
for i = 1, n do
  local remaining = 0
  if allowed[i] then
    local used = count[i]
    if consume then used = used + cost[i] end
    remaining = math.max(limit[i] - used, 0)
  end
  reply[#reply + 1] = allowed[i] and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = window[i] - (now % window[i])
end
return reply
