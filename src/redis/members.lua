-- leasehold: replica membership. One call registers or refreshes this
-- replica and returns who is alive.
--
-- KEYS[1]  owner key of this replica id (a string: the incarnation nonce, with a TTL)
-- KEYS[2]  members: sorted set, id -> last seen (ms, Redis time)
-- KEYS[3]  index: hash, id -> small numeric index (permanent; the field name
--          this replica writes in counter hashes)
-- KEYS[4]  next index counter
-- KEYS[5]  index owners: hash, index -> id (so an index is never given twice)
-- KEYS[6]  incarnation: a token created once per Redis dataset; when it
--          changes, Redis lost its data (restarted empty or failed over)
-- KEYS[7]  on Redis: sorted set, id -> last beat made while deciding on Redis
-- KEYS[8]  layouts: hash, id -> "<layout>:<time of the beat that said so>"
--          (none, or older than the member's last beat: layout 1, the
--          releases before layout versions)
-- KEYS[9]  the layout whose windows are in place: deleted while a live
--          member counts in an older one, whose windows must then be moved
--          again once it has left
-- ARGV[1]  replica id, ARGV[2] incarnation nonce, ARGV[3] TTL in ms,
-- ARGV[4]  "beat" (register or refresh, deciding on Redis), "away" (the
--          same while deciding off Redis, on leases), "held" (away, and
--          kept off Redis by members of an older layout: recorded as silent
--          at once, so that they hold back its share although it never
--          decided on Redis) or "leave",
-- ARGV[5]  the index this replica used before (0: none): after Redis lost
--          its data, a replica gets its old index back when it is free, so
--          its counter fields keep their meaning
-- ARGV[6]  hold-back horizon in ms: members silent longer than the TTL but
--          not longer than this are reported as silent. Silent means not
--          deciding on Redis: no "beat" within the TTL, whether the member
--          stopped beating (cut off, crashed) or beats "away" (back in
--          touch but still on its lease, its grants not all replayed). A
--          member is silent until its first "beat" after it is back on
--          Redis, so the others never stop holding back its share while
--          it may still grant on its lease unseen.
-- ARGV[7]  the key layout this replica counts in
-- ARGV[8]  the call's token, returned as the reply's last item
--
-- Reply: {1, index, now_ms, incarnation, {live ids}, {their indices},
-- {silent members' indices}, {known members' indices}, {live members'
-- layouts}} on success; {0, other nonce} when
-- another live incarnation owns the id (two writers of one field would
-- corrupt replay, so the caller must not use it).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, nonce, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local holdback = tonumber(ARGV[6]) or 0
local token = tonumber(ARGV[8])
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= nonce then
  return {0, owner, token}
end
if ARGV[4] == 'leave' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZREM', KEYS[7], id)
  redis.call('HDEL', KEYS[8], id)
  return {1, 0, now, token}
end
redis.call('SET', KEYS[1], nonce, 'PX', ttl)
redis.call('ZADD', KEYS[2], now, id)
-- The layout with the time of this beat: an entry older than the
-- member's last beat was not written by it (a release before layout
-- versions, beating under the same id), so it reads as layout 1.
redis.call('HSET', KEYS[8], id, ARGV[7] .. ':' .. now)
if ARGV[4] == 'beat' then
  redis.call('ZADD', KEYS[7], now, id)
elseif ARGV[4] == 'held' then
  redis.call('ZADD', KEYS[7], now - ttl - 1, id)
end
-- Forget members silent for a day; their index stays reserved.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 86400000)
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now - 86400000)
redis.call('SET', KEYS[6], nonce .. '@' .. now, 'NX')
local incarnation = redis.call('GET', KEYS[6])
local idx = redis.call('HGET', KEYS[3], id)
if not idx then
  local want = tonumber(ARGV[5]) or 0
  if want > 0 and redis.call('HSETNX', KEYS[5], want, id) == 1 then
    idx = want
    if (tonumber(redis.call('GET', KEYS[4])) or 0) < want then
      redis.call('SET', KEYS[4], want)
    end
  else
    repeat
      idx = redis.call('INCR', KEYS[4])
    until redis.call('HSETNX', KEYS[5], idx, id) == 1
  end
  redis.call('HSET', KEYS[3], id, idx)
end
-- The registry outlives its members by a day, then disappears.
for k = 2, 9 do
  redis.call('PEXPIRE', KEYS[k], 86400000)
end
local live = redis.call('ZRANGEBYSCORE', KEYS[2], now - ttl, '+inf')
local function indices(ids)
  local out = {}
  if #ids == 0 then return out end
  for _, v in ipairs(redis.call('HMGET', KEYS[3], unpack(ids))) do
    if v then out[#out + 1] = tonumber(v) end
  end
  return out
end
-- Silent: not on Redis for longer than the TTL, within the hold-back horizon.
local silent = {}
if holdback > ttl then
  silent = redis.call('ZRANGEBYSCORE', KEYS[7], now - holdback, '(' .. (now - ttl))
end
-- Known: any beat within the hold-back horizon (the TTL at least), live or
-- not: the members a replica back from trouble presumes until they prove
-- themselves, so a member whose heartbeats lapsed during a flap is not
-- left out.
local known = redis.call('ZRANGEBYSCORE', KEYS[2], now - math.max(holdback, ttl), '+inf')
local layouts = {}
if #live > 0 then
  local mine = tonumber(ARGV[7])
  for i, v in ipairs(redis.call('HMGET', KEYS[8], unpack(live))) do
    local layout, at = 1, nil
    if v then
      local l, t = string.match(v, '^(%d+):(%d+)$')
      layout, at = tonumber(l), tonumber(t)
    end
    local seen = tonumber(redis.call('ZSCORE', KEYS[2], live[i]))
    if not layout or not at or not seen or at < seen then layout = 1 end
    layouts[i] = layout
    if layouts[i] < mine then
      redis.call('DEL', KEYS[9])
    end
  end
end
return {1, tonumber(idx), now, incarnation, live, indices(live), indices(silent),
        indices(known), layouts, token}
