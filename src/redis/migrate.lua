-- leasehold: move one counter key of an older layout to its current name.
--
-- KEYS[1]  the key under its old name, KEYS[2] under its current name
-- ARGV[#ARGV] (last) the call's token, returned as the reply's last item
--
-- Only run on one Redis (or a Sentinel primary), never on a Cluster: the
-- two names may hash to different slots, and the older layout never ran on
-- a Cluster. Reply: {0} nothing to move (gone meanwhile), {1} renamed, {2}
-- merged into a key that already had the current name (replicas of the
-- older layout ran again after a migration, a rollback): then
--   - a window hash's counts ("<idx>" and "o<idx>" of every replica) are
--     added to "o<idx>" and its base "b<idx>" of the same replica, the
--     fields a replica's replay builds on and never lowers, so the total
--     keeps both keys' grants;
--   - a sorted set (sliding log) keeps the members of both;
--   - a token bucket's state keeps the current key's tokens;
-- and the key lives as long as the longer-lived of the two.
local token = tonumber(ARGV[#ARGV])
local old, new = KEYS[1], KEYS[2]
if redis.call('EXISTS', old) == 0 then
  return {0, token}
end
if redis.call('EXISTS', new) == 0 then
  redis.call('RENAME', old, new)
  return {1, token}
end
local ttl = math.max(redis.call('PTTL', old), redis.call('PTTL', new))
local kind = redis.call('TYPE', old)['ok']
if kind == 'zset' then
  redis.call('ZUNIONSTORE', new, 2, new, old, 'AGGREGATE', 'MAX')
elseif kind == 'hash' and string.find(old, '@%d+$') then
  local fields = redis.call('HGETALL', old)
  for i = 1, #fields, 2 do
    local f, v = fields[i], tonumber(fields[i + 1])
    local idx = string.match(f, '^o?(%d+)$')
    if idx and v and v ~= 0 then
      redis.call('HINCRBY', new, 'o' .. idx, v)
      redis.call('HINCRBY', new, 'b' .. idx, v)
    end
  end
end
redis.call('DEL', old)
if ttl > 0 then
  redis.call('PEXPIRE', new, ttl)
end
return {2, token}
