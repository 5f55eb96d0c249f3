-- leasehold: replay. Writes what this replica knows it counted, per
-- (counter, window), by setting (never adding) one of its own fields, so
-- running it twice, or again after a lost reply, changes nothing; it also
-- re-asserts counts Redis lost. Usage is written to the window it happened
-- in, never folded into the current one.
--
-- Two kinds of entry:
--   1 (local usage)  set "o<idx>" to this replica's cumulative grants made
--                    locally (on its lease) in that window. No other writer
--                    touches that field, so this needs no coordination.
--   3 (hold)         set "h<idx>" to what is left of this replica's lease in
--                    that window (it is deciding off Redis and may still
--                    grant it); the other replicas' decisions count it as
--                    used. 0 when it is back on Redis. Guarded like kind 1.
--   2 (repair)       set "<idx>" to the sum of the deltas of this replica's
--                    Redis-path calls that Redis confirmed, and the fence
--                    "f<idx>" to the current epoch, so a call this replica
--                    gave up on can neither have counted (overwritten here)
--                    nor count later (the script refuses epochs below the
--                    fence). The caller sends it only when no Redis-path
--                    call for the key can still be in flight.
--
-- Every write is guarded by an epoch (the replica raises it for each replay
-- call): "v<idx>" for the local field, the fence "f<idx>" for the repair. A
-- replay call that Redis executes late (its reply lost, or queued behind a
-- reconnect) finds a newer epoch and writes nothing, so an older value can
-- never overwrite a newer one.
--
-- KEYS[i]  base key of entry i (on a Cluster all in one slot, and the
--          window keys it writes follow as KEYS[n+1...], declared only so
--          that Redis knows them while their slot migrates)
-- ARGV[4]  this replica's incarnation (boot id): local counts restart from
--          zero with each incarnation, so the first local write of a new one
--          keeps what the previous ones wrote as a base ("b<idx>", the
--          writer's incarnation in "i<idx>") and sets "o<idx>" = base +
--          value: a restart never lowers what an earlier run granted.
-- ARGV[1]  this replica's index, ARGV[2] its current epoch, ARGV[3] expiry
--          margin in ms
-- ARGV[#ARGV] (last) the call's token, returned as the reply's last item
-- ARGV[5 + 7*(i-1) ...] per entry: kind, algorithm (1 fixed, 2 sliding
--          window, 4 token bucket), unit_ms, window index, value, limit, burst
--
-- Reply: {entries written, now_ms, fenced, raised}. Windows whose keys would
-- already have expired are skipped: their usage can no longer matter.
-- raised: repairs that found the field below the value written (writes
-- Redis lost). fenced: the highest guard above this call's epoch (0: none), for entries
-- skipped because an epoch this replica never saw (a previous run's, with a
-- clock that stepped back) guards them; the caller raises its epoch above
-- it and replays again, so nothing is dropped without notice.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, epoch, margin = ARGV[1], ARGV[2], tonumber(ARGV[3])
local boot = ARGV[4]
local token = tonumber(ARGV[#ARGV])
local base_field = 'b' .. me
local boot_field = 'i' .. me
local fence = 'f' .. me
local local_field = 'o' .. me
local hold_field = 'h' .. me
local version = 'v' .. me
-- Each window hash written expires up to min(unit, margin) after its
-- natural end (`life`), at a point drawn per hash, as decide.lua does: a
-- window's hashes expiring in one millisecond make Redis delete them all
-- in one go, a stall that a crowd of thousands takes past the budget.
local draw = tonumber(t[2]) + 1
local function spread(unit)
  local span = math.min(unit, margin)
  if span <= 0 then return 0 end
  draw = draw * 16807 % 2147483647
  return draw % span
end
local epoch_n = tonumber(epoch)
local written = 0
local fenced = 0
local raised = 0
for i = 1, math.floor((#ARGV - 4) / 7) do
  local o = 5 + 7 * (i - 1)
  local kind = tonumber(ARGV[o])
  local algo = tonumber(ARGV[o + 1])
  local unit = tonumber(ARGV[o + 2])
  local w = tonumber(ARGV[o + 3])
  local value = tonumber(ARGV[o + 4])
  local limit = tonumber(ARGV[o + 5])
  local burst = tonumber(ARGV[o + 6])
  local base = KEYS[i]
  local key = base .. '@' .. w
  local life = (w + 1) * unit + margin
  if algo == 2 then life = life + unit end
  -- A per-second fixed window's demand window (the last of a block of 5,
  -- see decide.lua's `expiry`) lives, and is replayed, until its block
  -- ends: decisions read it until then.
  if algo == 1 and unit <= 1000 and (w + 1) % 5 == 0 then
    life = math.max(life, (w + 6) * unit)
  end
  local guard = version
  if kind == 2 then guard = fence end
  local current = tonumber(redis.call('HGET', key, guard)) or 0
  if life > now and (algo == 1 or algo == 2 or algo == 4) and epoch_n < current then
    fenced = math.max(fenced, current)
  end
  if life > now and (algo == 1 or algo == 2 or algo == 4) and epoch_n >= current then
    if kind == 1 then
      local prior = tonumber(redis.call('HGET', key, base_field)) or 0
      if redis.call('HGET', key, boot_field) ~= boot then
        prior = tonumber(redis.call('HGET', key, local_field)) or 0
        redis.call('HSET', key, base_field, prior, boot_field, boot)
      end
      value = prior + value
      if algo == 4 then
        -- Draw from the bucket the tokens Redis has not seen yet, once: the
        -- local field is the replay marker, set in the same step.
        local seen = tonumber(redis.call('HGET', key, local_field)) or 0
        local draw = value - seen
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
          local full_in = unit
          if limit > 0 then
            full_in = math.ceil((burst - tokens) * unit / limit)
          end
          redis.call('HSET', base, 't', string.format('%.17g', tokens), 'u', now)
          redis.call('PEXPIRE', base, full_in + margin)
        end
      end
      redis.call('HSET', key, local_field, value, version, epoch)
    elseif kind == 3 then
      redis.call('HSET', key, hold_field, math.max(0, value), version, epoch)
    else
      -- Below what this replica had confirmed: Redis lost writes (a
      -- failover that promoted a replica behind its primary), healed here.
      if value > (tonumber(redis.call('HGET', key, me)) or 0) then
        raised = raised + 1
      end
      redis.call('HSET', key, me, value, fence, epoch)
      if algo == 4 and redis.call('EXISTS', base) == 1 then
        redis.call('HSET', base, fence, epoch)
      end
    end
    redis.call('PEXPIREAT', key, string.format('%d', life + spread(unit)))
    written = written + 1
  end
end
return {written, now, fenced, raised, token}
