-- share.lua: recomputes one bucket of the rate limit quota service: computes the pool from the rule's
-- limits, forgets expired members, takes the listed members' reports, computes every member's max-min
-- fair target and moves the listed members' grants towards theirs without the grants ever adding up to
-- more than the pool. The arithmetic of src/quota/share.rs (`apply`), operation for operation, members
-- in id order; one table of tests runs on both.
--
-- KEYS[1]   the bucket: a hash; field = member id, value = "<demand> <grant> <expires_ms> <version>"
--           (demand "-" while unknown); field "^<member id>" = "<held> <until ms>": what the member
--           held before its grant last came down, counted as its own until then; field "~<k>" =
--           "<window start ms> <hits reports added> <rate others spend it at> <their rate in the
--           previous window>" for the fixed window of limit k. Numbers are written with %.17g, so that
--           they read back exactly.
-- ARGV[1]   counts_for_ms: how long an assignment sent now counts (its TTL plus a margin)
-- ARGV[2]   hold_ms: how long a member that comes down still counts at its old grant
-- ARGV[3]   max_members: a newcomer past it is refused
-- ARGV[4]   n: the rule's limits, then seven values each: its rate (tokens per second); for a fixed
--           window its start (ms), the hits its counter holds, the hits this report added, its length,
--           the time it has run and the least time a rate is measured over (ms), else six empty strings
-- then      four per listed member: its id; its demand ("" keeps it, "-" unknown, else requests per
--           second); its listing ("r": it reported and is answered now, "p": pushed if its grant changes);
--           the version its stream last sent it (a member lost with the key starts above it)
-- Returns   { members, granted, pool, then one per listed member: "full" | "gone" |
--           "<grant> <target> <changed 0|1> <version>" } (numbers as text: Redis would cut a Lua number
--           to an integer)
-- Writes: the listed members whose fields changed (a reporter always, a pushed member whose grant
-- changed; with its hold when it came down), the windows, the key's expiry; expired members and holds
-- are deleted. Nothing else, so that a call
-- that lists few members of a large bucket writes little.
-- Time is the server's (TIME), so that replicas with skewed clocks expire members alike.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local counts_for = tonumber(ARGV[1])
local hold_for = tonumber(ARGV[2])
local max_members = tonumber(ARGV[3])
local n_limits = tonumber(ARGV[4])
local first_listed = 5 + 7 * n_limits

local function num(x)
  return string.format('%.17g', x)
end

-- The members still counting (the others are forgotten), their holds, and the windows reports added to.
local raw = redis.call('HGETALL', KEYS[1])
local members = {}
local windows = {}
local holds = {}
local count = 0
local expired = {}
for i = 1, #raw, 2 do
  local d, g, e, v = string.match(raw[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
  local first = string.sub(raw[i], 1, 1)
  if first == '^' then
    local held, until_ms = string.match(raw[i + 1], '^(%S+) (%S+)$')
    if held and tonumber(until_ms) and tonumber(until_ms) > now then
      holds[string.sub(raw[i], 2)] = { tonumber(held), tonumber(until_ms) }
    else
      expired[#expired + 1] = raw[i]
    end
  elseif first == '~' then
    local start, added, rate, previous = string.match(raw[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
    if start then
      windows[string.sub(raw[i], 2)] = { tonumber(start), tonumber(added), tonumber(rate), tonumber(previous) }
    end
  elseif d and tonumber(e) and tonumber(e) > now then
    local demand = false
    if d ~= '-' then
      demand = tonumber(d)
    end
    -- The stored text too: a member whose fields did not change is not written again.
    members[raw[i]] = { demand, tonumber(g), tonumber(e), tonumber(v), raw[i + 1] }
    count = count + 1
  else
    expired[#expired + 1] = raw[i]
  end
end
-- A hold goes with its member.
for id in pairs(holds) do
  if not members[id] then
    holds[id] = nil
    expired[#expired + 1] = '^' .. id
  end
end
for i = 1, #expired, 500 do
  redis.call('HDEL', KEYS[1], unpack(expired, i, math.min(i + 499, #expired)))
end

-- The pool: each limit's rate, less the rate others spend its fixed window at; the smallest.
local pool = nil
for k = 0, n_limits - 1 do
  local a = 5 + 7 * k
  local rate = tonumber(ARGV[a])
  if ARGV[a + 1] ~= '' then
    local start, used, added = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local window, elapsed, floor = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    local w = windows[tostring(k)] or { 0, 0, 0, 0 }
    local spent
    if start + window <= w[1] then
      -- A report of a window that ended before the one recorded began (it waited behind reports of
      -- the next): the recorded window stands, and others spend at its rate. A window of another
      -- length (the rule changed) is not one before.
      spent = w[3]
    else
      local previous
      if w[1] == start then
        added = w[2] + added
        previous = w[4]
      else
        previous = w[3]
      end
      local others = math.max(used - added, 0)
      local current = others * 1000 / math.max(math.max(elapsed, floor), 1)
      local weight = math.min(elapsed / math.max(window / 4, 1), 1)
      spent = weight * current + (1 - weight) * previous
      redis.call('HSET', KEYS[1], '~' .. k, num(start) .. ' ' .. num(added) .. ' ' .. num(spent) .. ' ' .. num(previous))
    end
    rate = math.max(rate - spent, 0)
  end
  if pool == nil or rate < pool then
    pool = rate
  end
end
if pool == nil then
  pool = 0
end

-- The listed members' reports; newcomers join while there is room.
local listed = {}
for a = first_listed, #ARGV, 4 do
  local id, demand, listing, sent = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local m = members[id]
  local slot = 'gone'
  if m then
    if demand == '-' then
      m[1] = false
    elseif demand ~= '' then
      m[1] = tonumber(demand)
    end
    m[4] = math.max(m[4], sent)
    slot = 'share'
  elseif listing == 'r' then
    if count >= max_members then
      slot = 'full'
    else
      local d = false
      if demand ~= '' and demand ~= '-' then
        d = tonumber(demand)
      end
      members[id] = { d, 0, now + counts_for, sent }
      count = count + 1
      slot = 'share'
    end
  end
  listed[#listed + 1] = { id, listing, slot }
end

local reserve = pool / 16
local shared_pool = pool - reserve
local ids = {}
for id in pairs(members) do
  ids[#ids + 1] = id
end
table.sort(ids)
local n = #ids
local estimate = shared_pool / math.max(n, 1)
local demands, grants, before, counted, pos = {}, {}, {}, {}, {}
for i, id in ipairs(ids) do
  local m = members[id]
  demands[i] = m[1] or estimate
  grants[i] = m[2]
  before[i] = m[2]
  counted[i] = m[2]
  if holds[id] then
    counted[i] = math.max(m[2], holds[id][1])
  end
  pos[id] = i
end

-- Targets, in the pool less the reserve: demand plus an equal part of what is left (one part kept
-- free), or a level for the busy ones.
local targets = {}
local asked = 0
for i = 1, n do
  asked = asked + demands[i]
end
if asked <= shared_pool then
  local extra = (shared_pool - asked) / (n + 1)
  for i = 1, n do
    targets[i] = demands[i] + extra
  end
else
  local order = {}
  for i = 1, n do
    order[i] = i
  end
  table.sort(order, function(x, y)
    if demands[x] ~= demands[y] then
      return demands[x] < demands[y]
    end
    return x < y
  end)
  local left, cnt, level = shared_pool, n, nil
  for _, i in ipairs(order) do
    local share = level or left / cnt
    if level == nil and demands[i] <= share then
      targets[i] = demands[i]
      left = left - demands[i]
      cnt = cnt - 1
    else
      level = share
      targets[i] = share
    end
  end
end

-- Grants: the listed ones above their target come down, then those below go up out of what was free
-- before the call beyond half the reserve (one that holds nothing: all but half of what was free). A
-- member counts for the larger of its grant and its hold: what a decrease frees is given only once the
-- hold has run out, when the lower grant has had time to arrive. While more than half the reserve is
-- spent or owed, one above its target by less than an eighth comes down by an eighth.
local function significant(old, new)
  return new ~= old and (old == 0 or new == 0 or math.abs(new - old) * 8 > old)
end
local shared = {}
for _, l in ipairs(listed) do
  if l[3] == 'share' then
    shared[#shared + 1] = pos[l[1]]
  end
end
local total = 0
local need = 0
for i = 1, n do
  total = total + counted[i]
  if targets[i] > grants[i] and significant(grants[i], targets[i]) then
    need = need + (targets[i] - grants[i])
  end
end
local short = total + need > pool - reserve / 2
local lowered = {}
for _, j in ipairs(shared) do
  local grant, target = grants[j], targets[j]
  if target < grant then
    local new = nil
    if significant(grant, target) then
      new = target
    elseif short then
      new = math.min(target, grant - grant / 8)
    end
    if new then
      -- total keeps what it counted for: its room is for a later call
      grants[j] = new
      lowered[j] = true
    end
  end
end
for _, j in ipairs(shared) do
  local grant, target = grants[j], targets[j]
  if target > grant and not lowered[j] then
    local room
    if grant == 0 then
      local free = pool - total
      room = math.max(free - reserve / 2, free / 2)
    else
      room = pool - reserve / 2 - total
    end
    -- up to what it is held at costs nothing more: its Envoy may enforce that already
    local new = math.min(target, counted[j] + math.max(room, 0))
    if new > grant and significant(grant, new) then
      total = total + (math.max(new, counted[j]) - counted[j])
      grants[j] = new
    end
  end
end

local out = { count, '', num(pool) }
for _, l in ipairs(listed) do
  if l[3] ~= 'share' then
    out[#out + 1] = l[3]
  else
    local i = pos[l[1]]
    local m = members[l[1]]
    local changed = grants[i] ~= before[i]
    m[2] = grants[i]
    if l[2] == 'r' or changed then
      m[4] = m[4] + 1
      m[3] = now + counts_for
    end
    local demand = '-'
    if m[1] then
      demand = num(m[1])
    end
    local record = demand .. ' ' .. num(m[2]) .. ' ' .. num(m[3]) .. ' ' .. num(m[4])
    if grants[i] < before[i] and hold_for > 0 then
      -- held from its last decrease on, and never for less than a hold still running
      local until_ms = now + hold_for
      if holds[l[1]] then
        until_ms = math.max(until_ms, holds[l[1]][2])
      end
      redis.call('HSET', KEYS[1], l[1], record, '^' .. l[1], num(counted[i]) .. ' ' .. num(until_ms))
    elseif record ~= m[5] then
      redis.call('HSET', KEYS[1], l[1], record)
    end
    local flag = '0'
    if changed then
      flag = '1'
    end
    out[#out + 1] = num(grants[i]) .. ' ' .. num(targets[i]) .. ' ' .. flag .. ' ' .. num(m[4])
  end
end
local granted = 0
for i = 1, n do
  granted = granted + grants[i]
end
out[2] = num(granted)
if n > 0 then
  redis.call('PEXPIRE', KEYS[1], counts_for)
else
  redis.call('DEL', KEYS[1])
end
return out
