-- leasehold: replay. Sets this replica's own count for (counter, window)
-- pairs to what the replica knows it granted, and fences out any of its
-- older calls that Redis might still execute. Setting (not adding) is what
-- makes replay idempotent: running it twice, or after a lost reply, changes
-- nothing; it also re-asserts counts that Redis lost.
--
-- KEYS[i]  base key of entry i (all with one hash tag, so one slot)
-- ARGV[1]  this replica's field (index), ARGV[2] its current epoch (the fence),
-- ARGV[3]  expiry margin in ms
-- ARGV[4 + 6*(i-1) ...] per entry: algorithm (1 fixed, 2 sliding window,
--          4 token bucket), unit_ms, window index, own count, limit, burst
--
-- Reply: {entries applied, now_ms}. Windows that are no longer live (their
-- key would have expired) are skipped: their usage can no longer matter.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, epoch, margin = ARGV[1], ARGV[2], tonumber(ARGV[3])
local fence = 'f' .. me
local applied = 0
for i = 1, #KEYS do
  local o = 4 + 6 * (i - 1)
  local algo = tonumber(ARGV[o])
  local unit = tonumber(ARGV[o + 1])
  local w = tonumber(ARGV[o + 2])
  local own = tonumber(ARGV[o + 3])
  local limit = tonumber(ARGV[o + 4])
  local burst = tonumber(ARGV[o + 5])
  local base = KEYS[i]
  local key = base .. '@' .. w
  local life = (w + 1) * unit + margin
  if algo == 2 then life = life + unit end
  if life > now then
    if algo == 4 then
      -- Token bucket: draw the tokens Redis has not seen yet, once. The
      -- consumption field is the replay marker: it is set to own in the
      -- same step, so a second run finds nothing left to draw.
      local seen = tonumber(redis.call('HGET', key, me)) or 0
      local draw = own - seen
      if draw > 0 then
        local v = redis.call('HMGET', base, 't', 'u')
        local tokens = tonumber(v[1])
        local updated = tonumber(v[2]) or now
        if tokens then
          tokens = math.min(burst, tokens + math.max(0, now - updated) * limit / unit)
        else
          tokens = burst
        end
        tokens = math.max(0, tokens - draw)
        local full_in = 0
        if limit > 0 and tokens < burst then
          full_in = math.ceil((burst - tokens) * unit / limit)
        elseif limit == 0 then
          full_in = unit
        end
        redis.call('HSET', base, 't', string.format('%.17g', tokens), 'u', now)
        redis.call('PEXPIRE', base, full_in + margin)
      end
      if redis.call('EXISTS', base) == 1 then
        redis.call('HSET', base, fence, epoch)
      end
      redis.call('HSET', key, me, own, fence, epoch)
      redis.call('PEXPIREAT', key, life)
    elseif algo == 1 or algo == 2 then
      redis.call('HSET', key, me, own, fence, epoch)
      redis.call('PEXPIREAT', key, life)
    end
    applied = applied + 1
  end
end
return {applied, now}
