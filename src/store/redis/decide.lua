-- ratelimitd: decide the checks of one or more requests, each request atomically and all-or-nothing,
-- in the order given. Requests that arrive while an earlier call is in flight travel together in one
-- call; each sees the counters as the requests before it in the call left them.
--
-- KEYS      the state keys the call declares. Standalone and Sentinel: every key of the call. Cluster:
--           the keys of one hash slot, by which Redis routes the call; the other keys of the same server
--           follow in ARGV (the script reads and writes every key of one slot with its own commands).
-- ARGV: the integers (packed in one msgpack array, or one decimal argument each: see below), then the
-- keys that are not in KEYS. The integers, in order:
--   jitter            extra seconds of TTL for fixed-window counters this call creates
--   K                 distinct keys in the call (KEYS, then the ones at the end of ARGV)
--   G, G integers     read groups: the index of the last key of each group. Keys are numbered by group,
--                     and the string keys of one group are read with one MGET (a group is one hash slot)
--   S, 8 per spec     limit specs: algorithm (0 fixed window, 1 sliding window, 2 sliding log,
--                     3 token bucket, 4 GCRA), limit, window (ms), burst, fixed-window start (s; 0 for
--                     the others), role of its checks (0 enforce, 1 shadow, 2 quota, 3 quota: a further
--                     limit of the descriptor of the check before it, which is over when any of its
--                     limits is and counts once among the quota descriptors), counts over its
--                     limit (1/0), debt (how far past its capacity such a limit's state may go: see below)
--   R, per request    flags (scope + 4 x consume_on_deny), n checks, then n times: key index, spec index,
--                     cost
--                     scope 1: these are all the checks of the request (quota checks may deny); 0: a part
--                     of them; 2: a part of them, and a check elsewhere already denies the request
--                     (decide, and consume only what a denied request consumes). consume_on_deny: consume
--                     every allowed check (and count every fixed-window hit) even when denied.
--   W, 2 per want     quota leases wanted (fixed and sliding window): a check's number in the call (from
--                     1, in order), and the hits it wants beyond its cost when its request consumes
--   B, 4 per return   leased hits given back before any request is decided: key index, spec index, hits,
--                     the server time (ms) of the grant they came from (a sliding window takes them off
--                     the grant's window: its state's current count while the state is in that window,
--                     its previous count once the state has moved on to the next). A counter
--                     an operator reset since that grant takes nothing back: the reset's mark (a key
--                     in the counter's slot, see reset_mark below and src/store/keys.rs) holds when.
--   then K - #KEYS key names
--
-- Reply: { server time (ms), then per request: status, denied (1/0), and when decided, per check:
--          a fixed window's one number, remaining + 1 when allowed and 0 when denied (its reset is the
--          window's end from the server time, and so is its retry when denied); any other algorithm's
--          four, allowed (1/0), remaining, reset (ms), retry (ms); then per lease wanted, the hits
--          granted }
--   status 0: decided. status 1: a fixed-window start of the request disagrees with this server's clock;
--   nothing of that request was counted, and the caller retries it with keys for the server time.
--   A call whose integers came packed is answered packed: the same integers as one msgpack array, one
--   bulk string for the client to read, not one RESP integer each.
--
-- Every integer must be a whole number from 0 to 2^53 (costs arrive bounded by what the limit could ever
-- allow), and every index must point at what it names; anything else is refused before anything is read
-- or written. Every key is read before anything is written, so a call refused while reading (a Cluster
-- key that moved away) has changed nothing.
--
-- A lease is granted only to a check that is allowed and consumed, and only while it is at most a
-- sixteenth of what is left after it: the hits are counted now, as if admitted, and the replica that holds
-- them admits them itself, so that counted hits plus what replicas hold never exceed the limit, and the
-- last sixteenth of a limit is always counted request by request.
--
-- A sliding-log key is a sorted set of entries `<time>:<seq>:<hits>` scored by their time (members
-- `<time>:<seq>` of earlier versions count 1 each). One call adds at most one entry per key, holding every
-- hit the call counted on it at that instant: memory follows calls, never the hits they carry. Beside the
-- entries, the member `hits` is scored minus the hits they hold, so that it sorts before all of them: a
-- call reads it together with the entries that have left the window (and removes those), so a decision
-- costs the entries that left since the last call, not the whole log. The oldest live entries are read
-- only to tell a denied request its wait, and only as many as that wait needs, 256 at most. A log
-- without `hits` (new, or written by an earlier version, which drops it) is read whole once and gets it.
--
-- A check of a limit that counts over its limit (usage reported after the fact) is counted whatever its
-- request's decision: also when it is over its limit, and when another check denies the request (it is
-- then decided again on the state the requests before left, and that is kept). Its state goes past the
-- limit by at most the spec's debt: fixed and sliding windows count up to limit + debt, a sliding log
-- records up to limit + debt hits (its new hits go into its newest entry when that one was counted at
-- the same millisecond or the log holds 2 x limit entries; that entry then moves to now), a token bucket
-- goes down to -debt tokens, GCRA's arrival time up to (burst + debt) intervals ahead. Such a limit is
-- never leased: its hits must reach the counter even when its request is denied.
--
-- A call is decided in the time Redis is busy with it: the integers are read once, state lives in one
-- array per kind (not a table per check or key), and each key is read and written once.
--
-- The arithmetic mirrors src/algorithm/mod.rs operation for operation, so the memory store and Redis
-- give the same answers. Time is the Redis server's (TIME, read once per call), so replicas with skewed
-- clocks agree. The client side of this contract is src/store/redis/script.rs; change both together.

local tonumber, unpack, type = tonumber, unpack, type
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local A, declared = ARGV, #KEYS
-- The integers: ratelimitd packs them into ARGV[1] as one msgpack array, unpacked here in one C call,
-- and the key names follow from ARGV[2]; a call written by hand (redis-cli, redis-benchmark) may give
-- them one decimal argument each, the key names after them. A decimal starts with a digit or a sign,
-- never with a msgpack array's first byte. A packed call is answered packed the same way.
local N, K, numbers, names
local lead = A[1] and A[1]:byte(1)
local packed_call = lead and ((lead >= 0x90 and lead <= 0x9f) or lead == 0xdc or lead == 0xdd)
if packed_call then
  local ok, packed = pcall(cmsgpack.unpack, A[1])
  if not ok or type(packed) ~= 'table' then return redis.error_reply('ratelimitd: the packed integers do not parse') end
  N, K, numbers, names = packed, packed[2], #packed, 1
  if type(K) ~= 'number' or K < declared or #A - 1 ~= K - declared then
    return redis.error_reply('ratelimitd: key count does not match the call')
  end
else
  K = tonumber(A[2])
  if K == nil or K < declared then return redis.error_reply('ratelimitd: key count does not match the call') end
  numbers = #A - (K - declared)
  names = numbers
  N = {}
  for i = 1, numbers do N[i] = tonumber(A[i]) end
end
if numbers < 7 then return redis.error_reply('ratelimitd: the call ends early') end

-- Every integer is a whole number from 0 to 2^53, checked in one pass of locals only (`not_whole`: the
-- first that is not, or nil); anything that is no number (a string, nil, a table) fails the comparison
-- with Lua's own error, and is then found by its type.
local function not_whole(N, numbers)
  for i = 1, numbers do
    local v = N[i]
    if v < 0 or v > 9007199254740992 or v % 1 ~= 0 then return i end
  end
  return nil
end
local compared, bad = pcall(not_whole, N, numbers)
if not compared then
  bad = 1
  while type(N[bad]) == 'number' do bad = bad + 1 end
end
if bad then
  return redis.error_reply('ratelimitd: argument ' .. bad .. ' is not a whole number from 0 to 2^53')
end
local at = 0

-- A cursor over the integers (`upto`: an index from 1 to upto). The first fault is kept, and refuses
-- the call once everything is read, before any key is touched.
local fault = nil
local function int(upto, what)
  at = at + 1
  local v = N[at]
  if v == nil then
    fault = fault or 'the call ends early'
    return 0
  end
  if upto and (v < 1 or v > upto) then
    fault = fault or ('argument ' .. at .. ' is not a ' .. what)
    return 0
  end
  return v
end
-- A code from 0 to n - 1.
local function code(n, what)
  local v = int()
  if v >= n then
    fault = fault or ('argument ' .. at .. ' is not a ' .. what)
    return 0
  end
  return v
end
-- A count of what follows, never more than the integers left.
local function count(per)
  local v = int()
  if v * per > numbers - at then
    fault = fault or ('argument ' .. at .. ' counts more than the call holds')
    return 0
  end
  return v
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
local now_s = floor(now / 1000)

local jitter = int()
int()
local groups = {}
for g = 1, count(1) do groups[g] = int(K, 'key index') end
-- Specs as parallel arrays; a fixed-window spec is valid only for the window the server is in.
local alg, limit, win, burst, role, valid, over, debt = {}, {}, {}, {}, {}, {}, {}, {}
local specs = count(8)
for s = 1, specs do
  alg[s], limit[s], win[s], burst[s] = code(5, 'known algorithm'), int(), int(), int()
  local start = int()
  role[s] = code(4, 'role')
  over[s], debt[s] = code(2, 'flag (0 or 1)') == 1, int()
  valid[s] = alg[s] ~= 0 or (win[s] >= 1000 and now_s - now_s % (win[s] / 1000) == start)
end
-- Checks as parallel arrays, requests as ranges of them; a check's three integers are read in place.
-- A request is decided only if every fixed-window spec it uses is for this server's window (`skipped`
-- otherwise). The algorithm of each key (nil: the call does not need the key) is its first check's: a
-- key's name says its algorithm (src/store/keys.rs), so all of its checks have the same one. A key of
-- skipped requests only is read and left as it is (but for sliding-log entries that left the window).
local ckey, cspec, ccost = {}, {}, {}
local rflags, rfirst, rlast = {}, {}, {}
local skipped, kalg, kspec = {}, {}, {}
local requests, c = count(2), 0
for r = 1, requests do
  -- The request's flags and its number of checks, read in place (this loop runs for every request).
  if at + 2 > numbers then fault = fault or 'the call ends early'; break end
  local flags, n = N[at + 1], N[at + 2]
  if flags > 6 or flags % 4 > 2 then fault = fault or ('argument ' .. (at + 1) .. ' is not a request flag') end
  at = at + 2
  if n * 3 > numbers - at then
    fault = fault or ('argument ' .. at .. ' counts more than the call holds')
    n = 0
  end
  local first, skip = c + 1, false
  for _ = 1, n do
    local k, s = N[at + 1], N[at + 2]
    if k < 1 or k > K then fault = fault or ('argument ' .. (at + 1) .. ' is not a key index') end
    if s < 1 or s > specs then fault = fault or ('argument ' .. (at + 2) .. ' is not a spec index') end
    c = c + 1
    ckey[c], cspec[c], ccost[c] = k, s, N[at + 3]
    at = at + 3
    if kalg[k] == nil then kalg[k], kspec[k] = alg[s], s end
    if not valid[s] then skip = true end
  end
  rflags[r], rfirst[r], rlast[r] = flags, first, c
  if skip then skipped[r] = true end
end
local want, wants = {}, {}
for w = 1, count(2) do
  local check = int(c, 'check number')
  wants[w] = check
  want[check] = int()
end
local returns = {}
for b = 1, count(4) do
  returns[b] = { int(K, 'key index'), int(specs, 'spec index'), int(), int() }
end
if not fault and at ~= numbers then fault = (numbers - at) .. ' arguments left over' end
if fault then return redis.error_reply('ratelimitd: ' .. fault) end

local key = KEYS
for i = declared + 1, K do key[i] = A[names + i - declared] end

for b = 1, #returns do
  local k = returns[b][1]
  if kalg[k] == nil then kalg[k] = alg[returns[b][2]] end
end

-- The state of each key, as up to three numbers (nil: nothing stored).
--   fixed window: count | sliding window: window start, count, previous count | sliding log: (the
--   second) hits this call added, (the third) how many of the newest stored entries this call's entry
--   took in | token bucket: tokens, time counted | GCRA: theoretical arrival (us)
-- `base`: a string key's value as read (nil: none).
local s1, s2, s3, has = {}, {}, {}, {}
local base = {}

-- A sliding log as stored, which never changes in the call: `lg_w` the window it was read for,
-- `lg_total` the hits of all its entries, `lg_gone` and `lg_gone_n` the hits and number of those that
-- have left the window, `lg_fix` whether the `hits` member is missing or wrong. `lg_all` holds every
-- entry (times ascending: times, hits, members) when the log is short or was read whole; else `lg_old`
-- holds the oldest entries still in the window that were read, and the others are read when needed.
local lg_w, lg_total, lg_gone, lg_gone_n, lg_fix, lg_all, lg_old = {}, {}, {}, {}, {}, {}, {}
-- Entries read with the `hits` member: a short log is read whole in that one command.
local LOG_HEAD = 8
-- A denied cost's wait is looked for among this many of the oldest entries at most; past them it is
-- when the last of them leaves (algorithm::sliding_log::WAIT_ENTRIES).
local LOG_WAIT = 256

-- The hits an entry holds, from its member `<time>:<seq>:<hits>` (`<time>:<seq>` of earlier versions: 1).
local function entry_hits(member)
  return tonumber(string.match(member, '^%d+:%d+:(%d+)$')) or 1
end

-- The entries of a sliding log's reply `v` (member, score pairs) from its item `j` on.
local function log_entries(v, j)
  local times, costs, members = {}, {}, {}
  for i = j, #v, 2 do
    local n = #times + 1
    times[n], costs[n], members[n] = tonumber(v[i + 1]), entry_hits(v[i]), v[i]
  end
  return times, costs, members
end

local function read_log(k, w)
  local name = key[k]
  -- A Redis ACL user set up for earlier versions may lack ZRANGE (ZRANGEBYSCORE is what they used):
  -- the log is then read whole, as they read it, and decided the same.
  local v = redis.pcall('ZRANGE', name, 0, LOG_HEAD, 'WITHSCORES')
  local whole = v.err ~= nil or #v < 2 * (LOG_HEAD + 1)
  if v.err or (v[1] ~= 'hits' and not whole) then
    v, whole = redis.call('ZRANGEBYSCORE', name, '-inf', '+inf', 'WITHSCORES'), true
  end
  local kept = v[1] == 'hits'
  local total = 0
  if kept then total = -tonumber(v[2]) end
  local times, costs, members = log_entries(v, kept and 3 or 1)
  local gone, gone_n, sum = 0, 0, 0
  for j = 1, #times do
    sum = sum + costs[j]
    if times[j] + w <= now then gone, gone_n = gone + costs[j], j end
  end
  -- Every entry read: their sum is the truth, and `hits` is set again if it says otherwise (a Cluster
  -- refund by an earlier version leaves it as it was, during an upgrade).
  local fix = not kept and sum > 0
  if whole then
    fix, total = sum ~= total, sum
    lg_all[k] = { times, costs, members }
  else
    if gone_n == #times then
      -- More may have left: they are counted (and go when the log is written), not kept.
      local more = redis.call('ZRANGEBYSCORE', name, '-inf', now - w, 'WITHSCORES', 'LIMIT', LOG_HEAD + 1, -1)
      for j = 1, #more, 2 do
        gone, gone_n = gone + entry_hits(more[j]), gone_n + 1
      end
    end
    lg_old[k] = { { unpack(times, gone_n + 1) }, { unpack(costs, gone_n + 1) } }
  end
  lg_w[k], lg_total[k], lg_gone[k], lg_gone_n[k], lg_fix[k] = w, total, gone, gone_n, fix
end

-- The newest stored entry still in the window: its time, hits and member (nil: none).
local lg_newest = {}
local function log_newest(k)
  local e = lg_newest[k]
  if e == nil then
    e = false
    local all = lg_all[k]
    if all then
      local n = #all[1]
      if n > lg_gone_n[k] then e = { all[1][n], all[2][n], all[3][n] } end
    else
      local v = redis.call('ZRANGE', key[k], -1, -1, 'WITHSCORES')
      if v[1] and v[1] ~= 'hits' and tonumber(v[2]) + lg_w[k] > now then
        e = { tonumber(v[2]), entry_hits(v[1]), v[1] }
      end
    end
    lg_newest[k] = e
  end
  if e then return e[1], e[2], e[3] end
  return nil
end

-- How many stored entries are still in the window.
local function log_live_n(k)
  local all = lg_all[k]
  if all then return #all[1] - lg_gone_n[k] end
  return redis.call('ZCARD', key[k]) - 1 - lg_gone_n[k]
end

-- The oldest stored entries still in the window, at least `n` of them when there are as many: their
-- times and hits, and the first and last place of them in those arrays.
local function log_oldest(k, n)
  local all = lg_all[k]
  if all then return all[1], all[2], lg_gone_n[k] + 1, #all[1] end
  local old = lg_old[k]
  if #old[1] < n then
    local v = redis.call('ZRANGEBYSCORE', key[k], '(' .. (now - lg_w[k]), '+inf', 'WITHSCORES', 'LIMIT', 0, n)
    local times, costs = log_entries(v, 1)
    old = { times, costs }
    lg_old[k] = old
  end
  return old[1], old[2], 1, #old[1]
end

-- Read every needed key: string keys one MGET per group, the others one command each.
local first = 1
for g = 1, #groups do
  local last = groups[g]
  local n = 0
  for k = first, last do
    local a = kalg[k]
    if a == 0 or a == 4 then n = n + 1 end
  end
  -- The keys read, by number: the whole group when every key of it is a string (a group of fixed
  -- windows, the usual call), else gathered.
  local strings, names = nil, key
  if n < last - first + 1 and n > 0 then
    strings, names = {}, {}
    for k = first, last do
      local a = kalg[k]
      if a == 0 or a == 4 then strings[#strings + 1] = k; names[#names + 1] = key[k] end
    end
  end
  if n > 0 then
    local from = strings and 1 or first
    -- A Redis ACL user without MGET (set up for earlier versions) reads them one by one: MGET fails for
    -- no other reason.
    local v = redis.pcall('MGET', unpack(names, from, from + n - 1))
    if v.err then
      v = {}
      for j = 1, n do v[j] = redis.call('GET', names[from + j - 1]) end
    end
    for j = 1, n do
      local k = strings and strings[j] or first + j - 1
      local value = tonumber(v[j])
      if value then has[k], s1[k], base[k] = true, value, value
      elseif kalg[k] == 0 then s1[k] = 0 end
    end
  end
  if n < last - first + 1 then
    for k = first, last do
      local a = kalg[k]
      if a == 1 then
        local v = redis.call('HMGET', key[k], 's', 'c', 'p')
        if v[1] then has[k] = true; s1[k], s2[k], s3[k] = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]) end
      elseif a == 3 then
        local v = redis.call('HMGET', key[k], 't', 'l')
        if v[1] then has[k] = true; s1[k], s2[k] = tonumber(v[1]), tonumber(v[2]) end
      elseif a == 2 then
        read_log(k, win[kspec[k]])
        -- Its state starts with nothing added by this call, whether or not the key existed.
        has[k], s2[k], s3[k] = true, 0, 0
      end
    end
  end
  first = last + 1
end

local function ceil0(x)
  if x < 0 then return 0 end
  return ceil(x)
end

-- The algorithms but the fixed window, by id: decide(s, k, has, a, b, c, cost) returns allowed,
-- remaining, reset (ms), retry (ms) and the state after (three numbers); a denied hit is counted only by
-- a limit that counts over its limit. 0, the fixed window (an integer counter per window, its key ending
-- with the window start), is decided in place where the requests are, below: a count goes up by the cost
-- and is allowed while it stays within the limit; a denied hit is counted too; counting over the limit,
-- the count stops at the debt past it (and never goes down). The window's end, its reset and (denied)
-- its retry, the client works out from the server time.
local decide = {}

-- 1: sliding window. A hash: window start `s`, its count `c`, the previous window's count `p`.
local function sliding_window_wait(s, current, previous, elapsed, cost)
  local w, lim = win[s], limit[s]
  if cost > lim then return w * 2 - elapsed end
  local left = w - elapsed
  if current + cost <= lim and previous > 0 then
    return ceil0(left - (lim - current - cost) * w / previous)
  end
  local wait = 0
  if current > 0 then wait = max(w - (lim - cost) * w / current, 0) end
  return ceil(left + wait)
end

decide[1] = function(s, k, present, start0, current0, previous0, cost)
  local w = win[s]
  local start = now - now % w
  local current, previous = 0, 0
  if present then
    if start0 == start then current, previous = current0, previous0
    elseif start0 + w == start then previous = current0 end
  end
  local elapsed = now - start
  local weight = (w - elapsed) / w
  local estimate = previous * weight + current
  local allowed = estimate + cost <= limit[s]
  local after_current, after_estimate = current, estimate
  if allowed then after_current, after_estimate = current + cost, estimate + cost
  elseif over[s] then after_current = min(current + cost, max(current, limit[s] + debt[s])) end
  local reset = 0
  if after_current > 0 then reset = start + 2 * w - now
  elseif previous > 0 then reset = start + w - now end
  local remaining, retry = 0, 0
  if allowed then remaining = floor(max(limit[s] - after_estimate, 0))
  else retry = sliding_window_wait(s, current, previous, elapsed, cost) end
  return allowed, remaining, reset, retry, start, after_current, previous
end

-- 2: sliding log. The state is the hits this call added (all at `now`, after every stored entry) and how
-- many of the newest stored entries its entry took in; the stored entries are read in place.
decide[2] = function(s, k, _, _, added, absorbed, cost)
  local w, lim = win[s], limit[s]
  local count = lg_total[k] - lg_gone[k] + added
  local allowed = count + cost <= lim
  local retry = 0
  if not allowed then
    if cost > lim then retry = w
    else
      -- Enough of the oldest hits must leave the window to free `count + cost - limit`; the ones this
      -- call counted (and the entry it took in) leave last, a whole window from now. Each entry holds a
      -- hit at least, so that many entries are enough; past LOG_WAIT of them, the wait is when the
      -- last of those leaves.
      local must_leave, left = count + cost - lim, 0
      local times, costs, first, last = log_oldest(k, min(must_leave, LOG_WAIT + 1))
      if absorbed > 0 then last = min(last, first + log_live_n(k) - absorbed - 1) end
      local scanned = min(last, first + LOG_WAIT - 1)
      retry = w
      for j = first, scanned do
        left = left + costs[j]
        if left >= must_leave then retry = times[j] + w - now; break end
      end
      if left < must_leave and last > scanned then retry = times[scanned] + w - now end
    end
  end
  -- Hits recorded: the cost when allowed; counting over the limit, as much of it as the debt holds.
  local hits = 0
  if allowed then hits = cost
  elseif over[s] then hits = min(cost, max(lim + debt[s] - count, 0)) end
  local after = added
  if hits > 0 then
    if over[s] and added == 0 then
      -- The newest stored entry takes them in when it was counted at this same instant, or when the log
      -- holds 2 x limit entries already (algorithm::SLIDING_LOG_ENTRIES_PER_HIT); it moves to now.
      local newest = log_newest(k)
      if newest and (newest == now or log_live_n(k) >= 2 * lim) then absorbed = 1 end
    end
    after = added + hits
  end
  local reset = 0
  if after > 0 then reset = w
  else
    local newest = log_newest(k)
    if newest then reset = newest + w - now end
  end
  local remaining = 0
  if allowed then remaining = lim - count - cost end
  return allowed, remaining, reset, retry, nil, after, absorbed
end

-- 3: token bucket. A hash: tokens `t` (a float) and the time they were counted `l`.
decide[3] = function(s, k, present, tokens0, last0, _, cost)
  local capacity = burst[s]
  local per_ms = limit[s] / win[s]
  local tokens = capacity
  if present then tokens = min(tokens0 + max(now - last0, 0) * per_ms, capacity) end
  local allowed = cost <= tokens
  local after = tokens
  if allowed then after = tokens - cost
  elseif over[s] then after = max(tokens - cost, min(-debt[s], tokens)) end
  local function refill(missing)
    if per_ms > 0 then return ceil0(missing / per_ms) end
    return win[s]
  end
  local retry = 0
  if not allowed then
    if cost > capacity then retry = win[s] else retry = refill(cost - tokens) end
  end
  local remaining = 0
  if allowed then remaining = floor(after) end
  return allowed, remaining, refill(capacity - after), retry, after, now, nil
end

-- 4: GCRA. A string: the theoretical arrival time in microseconds; the emission interval is whole
-- microseconds, rounded up.
decide[4] = function(s, k, present, tat0, _, _, cost)
  local interval = ceil(win[s] * 1000 / max(limit[s], 1))
  local capacity = interval * burst[s]
  local now_us = now * 1000.0
  local tat = now_us
  if present then tat = max(tat0, now_us) end
  local new_tat = tat + cost * interval
  local allowed = limit[s] > 0 and new_tat - now_us <= capacity
  local kept = tat
  if allowed then kept = new_tat
  elseif over[s] then kept = min(new_tat, max(tat, now_us + interval * (burst[s] + debt[s]))) end
  local remaining = max(floor((capacity - (kept - now_us)) / interval), 0)
  local retry = 0
  if not allowed then
    if limit[s] == 0 or cost > burst[s] then retry = win[s]
    else retry = ceil0((new_tat - capacity - now_us) / 1000.0) end
    remaining = 0
  end
  return allowed, remaining, ceil0((kept - now_us) / 1000.0), retry, ceil(kept), nil, nil
end

-- A whole number as a command argument. Lua would format every number it passes with `%.14g`, a
-- double's slow path; the few distinct values of a call (costs, expiries, window starts) are formatted
-- once each, as integers.
local text = {}
local function str(n)
  local s = text[n]
  if s == nil then
    s = n
    if n % 1 == 0 then s = string.format('%d', n) end
    text[n] = s
  end
  return s
end

-- Writes a sliding log back: the entries that left the window go, the hits this call `added` get an
-- entry at now (taking in the newest stored one when `absorbed`), and `hits` is set to what is left. A
-- log read without entries added or gone is left as it is, unless `hits` was missing or wrong.
local function save_log(k, added, absorbed)
  local name, w = key[k], lg_w[k]
  local total = lg_total[k]
  if added == 0 and lg_gone_n[k] == 0 and not lg_fix[k] then return end
  if lg_gone_n[k] > 0 then
    redis.call('ZREMRANGEBYSCORE', name, '(0', now - w)
    total = total - lg_gone[k]
  end
  if added > 0 then
    local held = added
    if absorbed > 0 then
      local _, hits, member = log_newest(k)
      held = held + hits
      redis.call('ZREM', name, member)
    end
    total = total + added
    redis.call('ZADD', name, now, now .. ':' .. t[2] .. ':' .. held, -total, 'hits')
    redis.call('PEXPIRE', name, str(w))
  elseif total > 0 then redis.call('ZADD', name, -total, 'hits')
  else redis.call('DEL', name) end
end

-- Writes a key's state back, with its expiry; `s` is the spec of the last check that changed it. A
-- fixed window's counter is written where this is called.
local function save(k, s)
  local a, name, w = alg[s], key[k], win[s]
  if a == 1 then
    redis.call('HSET', name, 's', str(s1[k]), 'c', str(s2[k]), 'p', str(s3[k]))
    redis.call('PEXPIRE', name, str(s1[k] + 2 * w - now))
  elseif a == 2 then
    save_log(k, s2[k], s3[k])
  elseif a == 3 then
    -- Until the bucket is full again (as the memory store keeps it): one that never refills
    -- (requests_per_unit 0) keeps its state for burst x window, not for a moment.
    local full_in = ceil0((burst[s] - s1[k]) * w / max(limit[s], 1)) + 1
    redis.call('HSET', name, 't', string.format('%.17g', s1[k]), 'l', str(s2[k]))
    redis.call('PEXPIRE', name, str(full_in))
  else
    redis.call('SET', name, string.format('%d', s1[k]), 'PX', str(ceil0(s1[k] / 1000 - now) + 1))
  end
end

-- Decide the requests in order. A request's changes are tentative (t1..t3, marked with the request in
-- `tr`) until it is known to consume; a key checked twice in one request sees the earlier check's cost.
-- Leased hits given back (fixed and sliding window), before any request is decided; state that has
-- expired or moved on is left alone.
-- The mark an operator's reset leaves beside a counter, in its Cluster slot: the key with its hash
-- tag, or the key followed by itself as the tag (nil for a key without a tag that holds a brace, which
-- is never leased).
local function reset_mark(name)
  local open = string.find(name, '{', 1, true)
  if open then
    local close = string.find(name, '}', open + 1, true)
    if close and close > open + 1 then return name .. ':reset' end
  end
  if name == '' or string.find(name, '[{}]') then return nil end
  return name .. '{' .. name .. '}:reset'
end

local dirty = {}
for b = 1, #returns do
  local k, s, hits = returns[b][1], returns[b][2], returns[b][3]
  if has[k] and hits > 0 then
    local mark = reset_mark(key[k])
    local reset_at = mark and tonumber(redis.call('GET', mark))
    if mark == nil or (reset_at and reset_at >= returns[b][4]) then hits = 0 end
  end
  if has[k] and hits > 0 then
    if alg[s] == 0 then
      s1[k] = max(s1[k] - hits, 0)
      dirty[k] = s
    elseif alg[s] == 1 then
      -- The window the hits were counted in is the grant's, not this call's: its count is the state's
      -- current one while the state is in that window, its previous one once the state has moved on
      -- to the next (as refund.lua finds a decision's window by its stamp).
      local w = win[s]
      local granted_in = returns[b][4] - returns[b][4] % w
      if s1[k] == granted_in then s2[k] = max(s2[k] - hits, 0); dirty[k] = s
      elseif s1[k] == granted_in + w then s3[k] = max(s3[k] - hits, 0); dirty[k] = s end
    end
  end
end

-- A fixed window's count (the usual check) changes in place and is marked to be written; both go back
-- when its request does not consume (`undo_k`, `undo_v`, `undo_d`: the key, its count and its mark
-- before, newest first). A fixed window's `has` is not kept past the reads: nothing after them needs it.
-- The other algorithms' changes are tentative (t1..t3, marked with the request in `tr`) until it is known
-- to consume. A key checked twice in one request sees the earlier check's cost.
local t1, t2, t3, tr = {}, {}, {}, {}
local undo_k, undo_v, undo_d = {}, {}, {}
local granted, leasing = {}, #wants > 0
-- Each check's answer goes straight into its place in the reply (`o`: the last place written).
local reply, rn = { now }, 1
for r = 1, requests do
  if skipped[r] then
    reply[rn + 1], reply[rn + 2] = 1, 0
    rn = rn + 2
  else
    local flags = rflags[r]
    local scope, consume_on_deny = flags % 4, flags >= 4
    local first_check, last_check = rfirst[r], rlast[r]
    -- The request's status and denied (filled in once known) at head + 1 and + 2, then its checks'.
    local head = rn
    reply[head + 1], reply[head + 2] = 0, 0
    local o, undone, tentative = head + 2, 0, false
    local denied = scope == 2
    local quota, quota_over, this_over = 0, 0, false
    for i = first_check, last_check do
      local k, s, cost = ckey[i], cspec[i], ccost[i]
      local ok
      if alg[s] == 0 then
        local count = s1[k]
        local after, lim = count + cost, limit[s]
        ok = after <= lim
        -- Counting over the limit, the count stops at the debt past it (and never goes down).
        if over[s] then after = min(after, max(count, lim + debt[s])) end
        o = o + 1
        if ok then reply[o] = lim - after + 1 else reply[o] = 0 end
        if cost > 0 then
          undone = undone + 1
          undo_k[undone], undo_v[undone], undo_d[undone] = k, count, dirty[k]
          s1[k], dirty[k] = after, s
        end
      else
        local a, b, c3, present
        if tr[k] == r then a, b, c3, present = t1[k], t2[k], t3[k], true
        else a, b, c3, present = s1[k], s2[k], s3[k], has[k] end
        local rem, res, ret, n1, n2, n3
        ok, rem, res, ret, n1, n2, n3 = decide[alg[s]](s, k, present, a, b, c3, cost)
        reply[o + 1], reply[o + 2], reply[o + 3], reply[o + 4] = ok and 1 or 0, rem, res, ret
        o = o + 4
        if cost > 0 and (ok or over[s]) then
          t1[k], t2[k], t3[k], tr[k] = n1, n2, n3, r
          tentative = true
        end
      end
      local role_i = role[s]
      if role_i == 0 and not ok then denied = true
      elseif role_i >= 2 then
        if role_i == 2 or quota == 0 then quota, this_over = quota + 1, false end
        if not ok and not this_over then quota_over, this_over = quota_over + 1, true end
      end
    end
    rn = o
    if scope == 1 and quota > 0 and quota == quota_over then denied = true end
    local consume = consume_on_deny or not denied
    if denied then reply[head + 2] = 1 end
    if consume then
      if tentative then
        for i = first_check, last_check do
          local k = ckey[i]
          if tr[k] == r then
            s1[k], s2[k], s3[k], has[k] = t1[k], t2[k], t3[k], true
            tr[k] = nil
            dirty[k] = cspec[i]
          end
        end
      end
      -- Leases ride on consuming requests, granted whole while they are at most a sixteenth of what is
      -- left after the request, and only beside hits counted: a check of cost 0 left its state as read
      -- (absent, or in a window that has passed).
      if leasing then
        o = head + 2
        for i = first_check, last_check do
          local k, s = ckey[i], cspec[i]
          local a, allowed = alg[s], nil
          if a == 0 then o = o + 1; allowed = reply[o] > 0 else allowed = reply[o + 1] == 1; o = o + 4 end
          local wanted = want[i]
          if wanted and wanted > 0 and allowed and ccost[i] > 0 then
            local give = 0
            if a == 0 then
              if limit[s] - s1[k] >= 16 * wanted then give = wanted; s1[k] = s1[k] + give end
            elseif a == 1 then
              local w = win[s]
              local estimate = s3[k] * (w - (now - s1[k])) / w + s2[k]
              if limit[s] - estimate >= 16 * wanted then give = wanted; s2[k] = s2[k] + give end
            end
            if give > 0 then dirty[k] = s end
            granted[i] = give
          end
        end
      end
    else
      -- Nothing consumed: fixed windows go back, newest change first, and the tentative changes go.
      for u = undone, 1, -1 do
        local k = undo_k[u]
        s1[k], dirty[k] = undo_v[u], undo_d[u]
      end
      if tentative then
        for i = first_check, last_check do tr[ckey[i]] = nil end
      end
      -- Allowed checks answer the quota as it stands.
      o = head + 2
      for i = first_check, last_check do
        local k, s = ckey[i], cspec[i]
        if alg[s] == 0 then
          o = o + 1
          if reply[o] > 0 and not over[s] then reply[o] = max(limit[s] - s1[k], 0) + 1 end
        else
          if reply[o + 1] == 1 and not over[s] then
            local _, rem, res = decide[alg[s]](s, k, has[k], s1[k], s2[k], s3[k], 0)
            reply[o + 2], reply[o + 3] = rem, res
          end
          o = o + 4
        end
      end
      -- Checks that count over their limit are counted all the same: each decided again on the state
      -- the requests before left (and its earlier such checks in this request), and that is kept.
      local counted = false
      for i = first_check, last_check do
        local k, s, cost = ckey[i], cspec[i], ccost[i]
        if over[s] and cost > 0 then
          if alg[s] == 0 then
            local count = s1[k]
            s1[k], dirty[k] = min(count + cost, max(count, limit[s] + debt[s])), s
          else
            local a, b, c3, present
            if tr[k] == r then a, b, c3, present = t1[k], t2[k], t3[k], true
            else a, b, c3, present = s1[k], s2[k], s3[k], has[k] end
            local _, _, _, _, n1, n2, n3 = decide[alg[s]](s, k, present, a, b, c3, cost)
            t1[k], t2[k], t3[k], tr[k] = n1, n2, n3, r
            counted = true
          end
        end
      end
      if counted then
        for i = first_check, last_check do
          local k = ckey[i]
          if tr[k] == r and over[cspec[i]] then
            s1[k], s2[k], s3[k], has[k] = t1[k], t2[k], t3[k], true
            tr[k] = nil
            dirty[k] = cspec[i]
          end
        end
      end
    end
  end
end

-- A fixed window's counter (the usual key) is written here, the others by save.
local call = redis.call
for k, s in pairs(dirty) do
  if alg[s] == 0 then
    local was = base[k]
    if was == nil then call('SET', key[k], str(s1[k]), 'EX', str(win[s] / 1000 + jitter))
    else
      local add = s1[k] - was
      call('INCRBY', key[k], text[add] or str(add))
    end
  else
    save(k, s)
  end
end
-- Sliding logs the call only read: what left the window goes now, not on every later call.
for k in pairs(lg_w) do
  if not dirty[k] then save_log(k, 0, 0) end
end
for w = 1, #wants do rn = rn + 1; reply[rn] = granted[wants[w]] or 0 end
if packed_call then return cmsgpack.pack(reply) end
return reply
