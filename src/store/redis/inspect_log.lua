-- ratelimitd: read a sliding log for the operators' API (inspect) as decide.lua reads it for a decision,
-- in one step, changing nothing: the member `hits` (minus the hits of all entries) with the oldest
-- entries; when every one of those has left the window, the entries beyond them that have too; and the
-- newest entry.
--
-- KEYS[1]  the log.
-- ARGV[1]  the time (ms) at or before which an entry has left the window.
-- ARGV[2]  the last place the first read takes (decide.lua's LOG_HEAD: `hits` and that many entries).
--
-- Reply: { head, gone, newest }, each member and score pairs. `gone` is empty unless every entry of
-- `head` has left the window. A Redis user without ZRANGE (set up for earlier versions) gets the whole
-- log as `head`, as decide.lua then reads it, and nothing else.

local name, gone_at, last = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local head = redis.pcall('ZRANGE', name, 0, last, 'WITHSCORES')
if head.err then
  return { redis.call('ZRANGEBYSCORE', name, '-inf', '+inf', 'WITHSCORES'), {}, {} }
end
local gone = {}
if #head == 2 * (last + 1) and head[1] == 'hits' then
  local all_gone = true
  for i = 4, #head, 2 do
    if tonumber(head[i]) > gone_at then all_gone = false end
  end
  if all_gone then
    gone = redis.call('ZRANGEBYSCORE', name, '-inf', gone_at, 'WITHSCORES', 'LIMIT', last + 1, -1)
  end
end
return { head, gone, redis.call('ZRANGE', name, -1, -1, 'WITHSCORES') }
