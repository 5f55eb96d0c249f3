-- leasehold: the layout migration's lock, held by one incarnation's nonce.
--
-- KEYS[1]  the lock
-- ARGV[1]  this incarnation's nonce
-- ARGV[2]  "take" (take it if free, or keep it if ours), "renew" (only if
--          ours), "release" (only if ours), or "mark": if ours, set
--          KEYS[2] to ARGV[4] (the layout now in place, kept a day) and
--          release
-- ARGV[3]  the lock's lifetime in ms
-- ARGV[#ARGV] (last) the call's token, returned as the reply's last item
--
-- Reply: {1, token} when the lock is (still) ours and the action was done,
-- {0, token} otherwise.
local token = tonumber(ARGV[#ARGV])
local nonce, action, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local holder = redis.call('GET', KEYS[1])
if action == 'take' then
  if holder and holder ~= nonce then return {0, token} end
  redis.call('SET', KEYS[1], nonce, 'PX', ttl)
  return {1, token}
end
if holder ~= nonce then return {0, token} end
if action == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ttl)
elseif action == 'mark' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', 86400000)
  redis.call('DEL', KEYS[1])
else
  redis.call('DEL', KEYS[1])
end
return {1, token}
