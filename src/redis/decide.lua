-- leasehold: evaluate and (unless denied) apply one request's charges,
-- atomically, on Redis time. The arithmetic mirrors src/limit/algorithms.rs.
--
-- KEYS[i]  base key of charge i (i up to the number of charges, which the
--          ARGV count gives). The keys derived from it below only append to
--          it outside its hash tag, so a charge touches one slot. On a
--          Redis Cluster the keys a charge reads and writes follow as
--          KEYS[n+1...] too, only so that Redis knows them while their slot
--          migrates (the script derives them itself).
-- ARGV[1]  this replica's field name (its small numeric index)
-- ARGV[2]  this replica's epoch (see the fence below)
-- ARGV[3]  never_deny: "1" in global shadow mode
-- ARGV[4]  expiry margin in ms, added to every key's natural lifetime
-- ARGV[5]  call id, unique per replica incarnation (sliding-log member ids)
-- ARGV[6]  failure-episode token of this replica ("" when it had no Redis
--          failure recently), see "presumed holds" below
-- ARGV[7]  presumed peers: comma-separated field indices ("" none)
-- ARGV[8]  silent members: comma-separated field indices ("" none)
-- ARGV[#ARGV] (last) the call's token, returned as the reply's last item so
--          the caller can tell its reply from another call's
-- ARGV[9 + 11*(i-1) ...] per charge i: algorithm (1 fixed, 2 sliding window,
--          3 sliding log, 4 token bucket), limit, unit_ms, burst, hits,
--          flags (bit 0 refund; bits 1-2 role: 0 enforce, 1 shadow, 2 quota;
--          bit 3: the caller holds the demand of the previous window, so a
--          fixed window need not read it; bit 4: a take-back, decided in
--          window expected_w rather than the current one),
--          expected: this replica's confirmed count in window `expected_w`
--          (-1 unknown), expected_w (when the call lands in that window and
--          the field is below it, Redis lost data), the fraction of the
--          limit presumed per member, "1" when this replica may prove
--          itself in the window (it granted nothing there Redis lacks), and
--          its own local count in the window that it has not replayed yet
--          (counted as used, never written).
--
-- Reply: {status, now_ms, denied, lost, then per charge: over, remaining,
--         reset_ms, own, total, delta}. own/total: this replica's count and
--         the key's total in the previous (complete) window, for demand
--         shares (own -1 when some replica decided off Redis in it). status 1 = applied or denied; -1 =
--         stale: this replica's epoch is below a fence on one of the keys, so
--         nothing was written and the caller must not count this call. lost
--         = 1 when an own field was below what the replica knew it to be
--         (Redis restarted empty or failed over): the replica re-asserts its
--         counts. delta: what the charge changed this replica's field by
--         (0 when denied).
--
-- Counter layout (fixed and sliding window): one hash per (counter, window),
-- "<base>@<window index>". Field "<idx>": replica idx's net count of
-- Redis-path grants (this script adds to it); field "o<idx>": its grants
-- made locally while Redis was away (replay sets it); "f<idx>": a fence, the
-- epoch at which replica idx last rewrote its "<idx>" field; "h<idx>": what
-- replica idx, deciding off Redis, has not granted yet of its lease (replay
-- sets it). The total is the sum of all "<idx>" and "o<idx>" fields; a
-- decision also counts the other replicas' "h" fields as used.
--
-- Presumed holds (fixed and sliding window). A replica deciding on its
-- lease writes nothing until Redis answers it again, so a replica that is
-- back on Redis cannot see what the others granted meanwhile. After a
-- failure of its own (ARGV[6] set), a replica therefore counts each peer as
-- holding `fraction × limit` of the window unless that peer has proved
-- itself since: "x" holds the token of the latest failure episode any
-- replica announced in this window ("y<idx>": the one replica idx announced
-- last, so each episode is announced once), and "g<idx>" = "x" says replica
-- idx decided this key on Redis after it, with nothing unreplayed. Any
-- replica's call proves itself when "x" is set and it may. Silent members
-- (not deciding on Redis for longer than the membership TTL) are presumed
-- in every window, proved or not. A presumed member's own "h" counts
-- towards its presumption, not on top.
-- One request's decision; KEYS and ARGV are that request's (the script's
-- own in a single call, its slices in a batch).
-- `now`: Redis's time in ms, read once per script call. `shared`: the
-- state of the call's keys as its requests so far left it (each key read
-- once per call), and the window increments they made, written once per
-- key at the end of the call (`flush`).
local function decide(KEYS, ARGV, now, shared)
  local me = ARGV[1]
  local epoch = tonumber(ARGV[2])
  local fence_field = 'f' .. me
  local never_deny = ARGV[3] == '1'
  local margin = tonumber(ARGV[4])
  local call_id = ARGV[5]
  local episode = ARGV[6]
  local n = math.floor((#ARGV - 8) / 11)

  local function indices(list)
    local out = {}
    for v in string.gmatch(list, '[^,]+') do
      if v ~= me then out[#out + 1] = v end
    end
    return out
  end
  local peers = indices(ARGV[7])
  local silent = indices(ARGV[8])
  local is_silent = {}
  for _, j in ipairs(silent) do is_silent[j] = true end
  local announce = ''
  if episode ~= '' then announce = me .. ':' .. episode end

  -- Sum of the count fields of a window hash, this replica's Redis-path
  -- field, its local (outage) field, and its fence.
  local local_field = 'o' .. me
  local hold_field = 'h' .. me
  local announced_field = 'y' .. me
  local function read_window(key)
    local flat = redis.call('HGETALL', key)
    local total, own, own_local, fence, held = 0, 0, 0, 0, 0
    -- Every writer sets the hash's expiry when it creates it, to the same
    -- window end plus margin: an existing hash needs it no more.
    local exists = #flat > 0
    local holds, proofs, x, mine = {}, {}, nil, nil
    -- Some replica decided off Redis in this window (it replayed, held, or
    -- announced a failure episode): its totals may be incomplete.
    local troubled = false
    for i = 1, #flat, 2 do
      local f = flat[i]
      local b = string.byte(f, 1)
      if b and b >= 48 and b <= 57 then
        local v = tonumber(flat[i + 1]) or 0
        total = total + v
        if f == me then own = v end
      elseif b == 111 then -- 'o'
        local v = tonumber(flat[i + 1]) or 0
        total = total + v
        troubled = true
        if f == local_field then own_local = v end
      elseif b == 104 then -- 'h': another replica's unspent lease
        troubled = true
        if f ~= hold_field then
          local v = tonumber(flat[i + 1]) or 0
          held = held + v
          holds[string.sub(f, 2)] = v
        end
      elseif b == 103 then -- 'g': a proof
        proofs[string.sub(f, 2)] = flat[i + 1]
      elseif f == 'x' then
        x = flat[i + 1]
        troubled = true
      elseif f == announced_field then
        mine = flat[i + 1]
      elseif f == fence_field then
        fence = tonumber(flat[i + 1]) or 0
      end
    end
    return {total = total, own = own, own_local = own_local, fence = fence, held = held,
            holds = holds, proofs = proofs, x = x, mine = mine, troubled = troubled,
            exists = exists}
  end

  -- What the presumed members may grant in window `cur` unseen, beyond
  -- their holds (see "presumed holds"); also queues this call's
  -- announcement and proof for the window.
  local meta = {}
  local function presumed(key, cur, fraction, limit, prove, expire_at)
    if announce ~= '' and fraction > 0 and cur.mine ~= episode then
      cur.x = announce
      cur.mine = episode
      cur.proofs = {}
      cur.troubled = true
      meta[#meta + 1] = {key, 'x', announce, announced_field, episode, expire_at}
    elseif prove and cur.x and cur.proofs[me] ~= cur.x then
      cur.proofs[me] = cur.x
      meta[#meta + 1] = {key, 'g' .. me, cur.x, nil, nil, expire_at}
    end
    if fraction <= 0 then return 0 end
    local share = math.floor(fraction * limit)
    local extra = 0
    -- A presumed member's unspent lease "h" counts towards its presumption,
    -- not on top. Its replayed local grants "o" do count on top: they may
    -- come from a lease larger than the share presumed, so leaving them out
    -- would undercount.
    local function unseen(j)
      return math.max(0, share - (cur.holds[j] or 0))
    end
    for _, j in ipairs(silent) do
      extra = extra + unseen(j)
    end
    if announce ~= '' then
      for _, j in ipairs(peers) do
        if not is_silent[j] and (cur.x == nil or cur.proofs[j] ~= cur.x) then
          extra = extra + unseen(j)
        end
      end
    end
    return extra
  end

  -- Per-key state, shared by the requests of one call: a key charged
  -- again (in this request or a later one of the batch) sees the charges
  -- before. A request notes what it changes on first touch, to undo it if
  -- it is denied or stale.
  local windows = shared.windows[me]
  if not windows then
    windows = {}
    shared.windows[me] = windows
  end
  local touched = {}
  local function touch(st)
    if not touched[st] then
      touched[st] = {total = st.total, own = st.own, count = st.count, tokens = st.tokens,
                     updated = st.updated, x = st.x, mine = st.mine, proofs = st.proofs,
                     proof = st.proofs and st.proofs[me], troubled = st.troubled}
    end
    return st
  end
  -- Undoes this request's changes: its counts when it is denied (its
  -- announcements and proofs are written all the same), everything when
  -- it is stale (nothing is written).
  local function undo(all)
    for st, b in pairs(touched) do
      st.total, st.own, st.count = b.total, b.own, b.count
      st.tokens, st.updated = b.tokens, b.updated
      if all then
        st.x, st.mine, st.proofs, st.troubled = b.x, b.mine, b.proofs, b.troubled
        if b.proofs then b.proofs[me] = b.proof end
      end
    end
  end
  local function window(key)
    local w = windows[key]
    if not w then
      w = read_window(key)
      windows[key] = w
    end
    return touch(w)
  end

  local stale = false
  local lost = false
  local results = {}
  local writes = {}
  local roles = {}

  for i = 1, n do
    local o = 9 + 11 * (i - 1)
    local algo = tonumber(ARGV[o])
    local limit = tonumber(ARGV[o + 1])
    local unit = tonumber(ARGV[o + 2])
    local burst = tonumber(ARGV[o + 3])
    local hits = tonumber(ARGV[o + 4])
    local flags = tonumber(ARGV[o + 5])
    local refund = flags % 2 == 1
    local demand_known = math.floor(flags / 8) % 2 == 1
    -- bit 4: a take-back (fixed and sliding window): decided in window
    -- expected_w, the one the charge it reverses landed in, whatever the
    -- time now.
    local pinned = math.floor(flags / 16) % 2 == 1
    local expected = tonumber(ARGV[o + 6])
    local expected_w = tonumber(ARGV[o + 7])
    local fraction = tonumber(ARGV[o + 8]) or 0
    local prove = ARGV[o + 9] == '1'
    local pending = tonumber(ARGV[o + 10]) or 0
    roles[i] = math.floor(flags / 2) % 4
    local base = KEYS[i]
    local r = {over = 0, rem_now = 0, rem_after = 0, reset = 0, own = 0, total = 0, delta = 0}

    if algo == 1 or algo == 2 then
      local w = math.floor(now / unit)
      if pinned then w = expected_w end
      local key = base .. '@' .. w
      local cur = window(key)
      if cur.fence > epoch then stale = true end
      if expected >= 0 and w == expected_w and cur.own < expected then lost = true end
      local weighted = 0
      -- The previous window is complete, so every replica reads the same
      -- totals for it: demand shares taken from it add up to exactly 1. A
      -- fixed window reads it only for those shares, so not when the caller
      -- has them already (it then gets no demand back, and keeps its own).
      local prev = nil
      if algo == 2 or not demand_known then
        prev = window(base .. '@' .. (w - 1))
      end
      if algo == 2 then
        if prev.fence > epoch then stale = true end
        if prev.total > 0 and not pinned then
          weighted = math.floor(prev.total * (unit - (now - w * unit)) / unit)
        end
      end
      local expire_at = (w + 1) * unit + margin
      if algo == 2 then expire_at = expire_at + unit end
      -- What the other replicas off Redis still hold of their leases, or may
      -- hold unseen, counts as used here, so it is not granted twice.
      local count = cur.total + pending + cur.held + presumed(key, cur, fraction, limit, prove, expire_at)
      local estimate = weighted + count
      local delta, after
      if refund then
        local c = math.max(0, cur.total - hits)
        delta = c - cur.total
        after = weighted + c + cur.held
      else
        delta = hits
        after = estimate + hits
        if after > limit then r.over = 1 end
      end
      r.rem_now = math.max(0, limit - estimate)
      r.rem_after = (r.over == 1) and 0 or math.max(0, limit - after)
      r.reset = (w + 1) * unit - now
      cur.total = cur.total + delta
      cur.own = cur.own + delta
      r.delta = delta
      -- Demand shares only from a window every replica decided on Redis:
      -- shares taken from incomplete totals could add up to more than 1.
      if prev == nil or prev.troubled then
        r.own = -1
        r.total = 0
      else
        r.own = prev.own + prev.own_local
        r.total = prev.total
      end
      if delta ~= 0 then
        writes[#writes + 1] = {'hincr', key, delta, expire_at, cur.exists}
      end
    elseif algo == 3 then
      -- Sliding log: one member per hit, scored by time; member ids are
      -- "<replica>:<call id>:<charge>:<n>", so replaying a call is a no-op.
      local st = windows[base]
      if not st then
        redis.call('ZREMRANGEBYSCORE', base, '-inf', now - unit)
        st = {count = redis.call('ZCARD', base), added = 0}
        windows[base] = st
      end
      touch(st)
      local count = st.count
      local after
      -- One member per hit: a charge of more than 10000 hits (the
      -- engines' LOG_MAX_HITS_PER_CALL) is over and adds nothing; a
      -- refund takes at most that many.
      if refund then
        local k = math.min(hits, count, 10000)
        after = count - k
        if k > 0 then writes[#writes + 1] = {'zpop', base, k} end
        r.delta = -k
      else
        after = count + hits
        local too_big = hits > 10000
        if after > limit or too_big then r.over = 1 end
        -- Past the limit (shadow) the log saturates at limit + 1 members.
        local m = math.min(hits, math.max(0, limit + 1 - count))
        if too_big then m = 0 end
        if m > 0 then
          writes[#writes + 1] = {'zadd', base, m, i, now + unit + margin}
        end
        r.delta = m
      end
      -- What the log holds now (a charge past the limit adds fewer
      -- members than hits), for the requests after this one.
      st.count = count + r.delta
      r.rem_now = math.max(0, limit - count)
      r.rem_after = (r.over == 1) and 0 or math.max(0, limit - after)
      local oldest = redis.call('ZRANGE', base, 0, 0, 'WITHSCORES')
      local first = tonumber(oldest[2]) or now
      if count == 0 and after > 0 then first = now end
      r.reset = math.max(1, first + unit - now)
      r.own = -1
      r.total = after
    else
      -- Token bucket: hash "<base>" with t (tokens) and u (updated, ms);
      -- consumption per replica goes to a fixed-window hash "<base>@<w>" for
      -- demand shares and replay.
      local st = windows[base]
      if not st then
        local v = redis.call('HMGET', base, 't', 'u', fence_field)
        st = {tokens = tonumber(v[1]) or burst, updated = tonumber(v[2]) or now,
              fence = tonumber(v[3]) or 0}
        windows[base] = st
      end
      touch(st)
      -- Every request of the call checks the fence, not only the first.
      if st.fence > epoch then stale = true end
      local elapsed = math.max(0, now - st.updated)
      local rate = limit / unit
      local tokens_now = math.min(burst, st.tokens + elapsed * rate)
      local after
      if refund then
        after = math.min(burst, tokens_now + hits)
      else
        if hits > tokens_now then r.over = 1 end
        after = math.max(0, tokens_now - hits)
      end
      local full_in
      if limit == 0 then
        full_in = unit
      elseif after >= burst then
        full_in = 0
      else
        full_in = math.ceil((burst - after) * unit / limit)
      end
      st.tokens = after
      st.updated = now
      r.rem_now = math.floor(tokens_now)
      r.rem_after = (r.over == 1) and 0 or math.floor(after)
      r.reset = math.max(1, full_in)
      local w = math.floor(now / unit)
      local ckey = base .. '@' .. w
      local use = window(ckey)
      if expected >= 0 and w == expected_w and use.own < expected then lost = true end
      -- What this charge drew from the bucket: its hits when admitted, what
      -- was left when charged past empty (shadow); always an integer.
      local consumed = 0
      if not refund then
        if r.over == 1 then consumed = math.floor(tokens_now) else consumed = hits end
      end
      use.total = use.total + consumed
      use.own = use.own + consumed
      local prev_use = window(base .. '@' .. (w - 1))
      r.own = prev_use.own + prev_use.own_local
      r.total = prev_use.total
      r.delta = consumed
      writes[#writes + 1] = {'bucket', base, after, now, full_in + margin, ckey, consumed, (w + 1) * unit + margin}
    end
    results[i] = r
  end

  if stale then
    undo(true)
    return {-1, now, 0, 0}
  end

  -- Announcements and proofs are facts about who decides where, written
  -- whether or not the request is admitted.
  for _, m in ipairs(meta) do
    if m[4] then
      redis.call('HSET', m[1], m[2], m[3], m[4], m[5])
    else
      redis.call('HSET', m[1], m[2], m[3])
    end
    if redis.call('PTTL', m[1]) < 0 then redis.call('PEXPIREAT', m[1], m[6]) end
  end

  local enforce_over = false
  local quota_seen = false
  local quota_all_over = true
  for i = 1, n do
    local over = results[i].over == 1
    if roles[i] == 0 then
      if over then enforce_over = true end
    elseif roles[i] == 2 then
      quota_seen = true
      if not over then quota_all_over = false end
    end
  end
  local denied = (not never_deny) and (enforce_over or (quota_seen and quota_all_over))
  if denied then undo(false) end

  if not denied then
    for _, wr in ipairs(writes) do
      local kind = wr[1]
      if kind == 'hincr' then
        local p = shared.incr[wr[2]]
        if not p then
          p = {me = me, delta = 0, expire_at = wr[4], exists = wr[5]}
          shared.incr[wr[2]] = p
          shared.order[#shared.order + 1] = wr[2]
        end
        p.delta = p.delta + wr[3]
      elseif kind == 'zadd' then
        -- In chunks: unpack() has a small stack limit.
        local args = {}
        for j = 1, wr[3] do
          args[#args + 1] = now
          args[#args + 1] = me .. ':' .. call_id .. ':' .. wr[4] .. ':' .. j
          if #args >= 1000 or j == wr[3] then
            redis.call('ZADD', wr[2], unpack(args))
            args = {}
          end
        end
        redis.call('PEXPIREAT', wr[2], wr[5])
      elseif kind == 'zpop' then
        redis.call('ZPOPMAX', wr[2], wr[3])
      elseif kind == 'bucket' then
        redis.call('HSET', wr[2], 't', string.format('%.17g', wr[3]), 'u', wr[4])
        redis.call('PEXPIRE', wr[2], wr[5])
        if wr[7] > 0 then
          redis.call('HINCRBY', wr[6], me, wr[7])
          redis.call('PEXPIREAT', wr[6], wr[8])
        end
      end
    end
  end

  local reply = {1, now, denied and 1 or 0, lost and 1 or 0}
  for i = 1, n do
    local r = results[i]
    local remaining = r.rem_after
    if r.over == 1 then
      remaining = 0
    elseif denied then
      remaining = r.rem_now
    end
    reply[#reply + 1] = r.over
    reply[#reply + 1] = remaining
    reply[#reply + 1] = r.reset
    reply[#reply + 1] = r.own
    reply[#reply + 1] = r.total
    reply[#reply + 1] = denied and 0 or r.delta
  end
  return reply
end

-- A single request (ARGV as above), or a batch of requests decided one
-- after the other, each all-or-nothing on its own: ARGV[1] "B", ARGV[2] the
-- number of requests, then per request the number of its keys and of its
-- arguments and those arguments; KEYS are the requests' keys in order.
-- A batch's reply is, per request, the length of its reply and the reply.
-- Either way the call's token (the last ARGV) ends the reply.
-- The window increments of a call's admitted requests, one HINCRBY per
-- key: the state the later requests saw already counted them.
local function flush(shared)
  for _, key in ipairs(shared.order) do
    local p = shared.incr[key]
    if p.delta ~= 0 then
      redis.call('HINCRBY', key, p.me, p.delta)
      if not p.exists then redis.call('PEXPIREAT', key, p.expire_at) end
    end
  end
end

local token = tonumber(ARGV[#ARGV])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local shared = {windows = {}, incr = {}, order = {}}
if ARGV[1] ~= 'B' then
  local r = decide(KEYS, ARGV, now, shared)
  flush(shared)
  r[#r + 1] = token
  return r
end
local out = {}
local k, a = 1, 3
for _ = 1, tonumber(ARGV[2]) do
  local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local keys, args = {}, {}
  for j = 1, nk do keys[j] = KEYS[k + j - 1] end
  for j = 1, na do args[j] = ARGV[a + 1 + j] end
  k = k + nk
  a = a + 2 + na
  local r = decide(keys, args, now, shared)
  out[#out + 1] = #r
  for _, v in ipairs(r) do out[#out + 1] = v end
end
flush(shared)
out[#out + 1] = token
return out
