-- leasehold: decide a batch of requests, one after the other, each
-- evaluated and (unless denied) applied atomically and all-or-nothing on
-- its own, on Redis time. The arithmetic mirrors src/limit/algorithms.rs.
-- A single request is a batch of one.
--
-- ARGV, once per call (every request of a call comes from one replica):
--   [1] this replica's field name (its small numeric index)
--   [2] its epoch (see the fence below)
--   [3] expiry margin in ms, added to every key's natural lifetime
--   [4] its failure-episode token ("" when it had no Redis failure
--       recently), see "presumed holds" below
--   [5] presumed peers: comma-separated field indices ("" none)
--   [6] silent members: comma-separated field indices ("" none)
--   [7] the number of requests
-- then per request:
--   its shape "<keys>,<charges>,<flags>[,<times>]": how many KEYS it
--       has, how many charges, flags (bit 0: global shadow mode; bit 1: a
--       call id follows), and how many
--       requests it stands for (1 when absent): a group of requests
--       equal bar their call ids and expected counts (it carries the
--       lowest, a floor for each), whose members are decided one after
--       the other as if each had been sent on its own and each get their
--       own reply (never with a
--       sliding-log charge, whose members take their ids from the call
--       id)
--   its call id, unique per replica incarnation, only when it has a
--       sliding-log charge (its member ids); one argument fewer per
--       request for all others
--   per charge i, two arguments:
--     "<algorithm>,<limit>,<unit_ms>,<burst>,<hits>,<flags>,<expected_w>,
--     <fraction>,<pending>": algorithm 1 fixed window, 2 sliding window,
--       3 sliding log, 4 token bucket; flags bit 0 refund; bits 1-2 role
--       (0 enforce, 1 shadow, 2 quota); bit 3: the caller holds the demand
--       of the demand window, so a fixed window need not read it; bit 4:
--       a take-back, decided in window expected_w rather than the current
--       one; bit 5: this replica may prove itself in the window (it
--       granted nothing there Redis lacks); expected_w: the window of the
--       expected count; fraction: of the limit presumed per member;
--       pending: this replica's own local count in the window not replayed
--       yet (counted as used, never written). The requests of a batch
--       mostly repeat these strings, and each distinct one is parsed once
--       per call.
--     expected: this replica's confirmed count in window expected_w (-1
--       unknown); when the call lands in that window and the field is
--       below it, Redis lost data.
--   or, for a run (flags bit 2; <times> is then its number of members):
--       requests of the same shape and charge strings but their own keys
--       and expected counts (a spread of distinct keys under one rule),
--       each decided and answered as if sent on its own, neither groups
--       nor with a call id: the charge strings once, then each member's
--       expected counts in turn (and KEYS each member's keys in turn).
--       Two arguments fewer per request after the first on a spread:
--       each argument costs Redis about 1,150 instructions (callgrind).
-- and last, the call's token, returned as the reply's last item so the
-- caller can tell its reply from another call's.
--
-- KEYS, per request: the base key of each charge, then on a Redis Cluster
-- the keys its charges read and write, only so that Redis knows them while
-- their slot migrates (the script derives them itself). The keys derived
-- from a base key only append to it outside its hash tag, so a charge
-- touches one slot.
--
-- Reply: per request, its status, then per charge: remaining, reset_ms,
-- own, total (only when own is 0 or more), delta, or for a short charge
-- (see `charge_of`) only remaining and delta; then now_ms; then the
-- token. A request of one short charge (a spread's or a hot key's) that
-- was admitted as asked (status 0, delta its hits) with remaining 0 or
-- more is answered by its remaining alone; otherwise its status goes as
-- -2 - status (-1 stays stale), followed by remaining and delta, or when
-- the status has 4 (void, below) by the full form. The
-- caller knows how many charges each request has, so no length goes with
-- it: each item costs Redis about 450 instructions to convert and the
-- caller about as many to read (callgrind). status -1: stale, this
-- replica's epoch is below a fence on one of the keys, so nothing was
-- written and the caller must not count the request (no items follow);
-- otherwise denied (1) + 2 × lost + 4 × void, lost when an own field was
-- below what the replica knew it to be (Redis restarted empty or failed
-- over): the replica re-asserts its counts; void when a short charge's
-- current window carries some replica's decisions off Redis (a demand
-- block's share the caller holds is void, see `own` in the main loop):
-- then every charge of the request is answered in the full form, own -1
-- for such a charge and -2 for the other short ones. remaining: -1 when the charge is over its
-- limit. own/total: this replica's count and the key's total in the
-- charge's demand window (complete: the previous window, or for a fixed
-- window of a second or less the last one before its block of 5, see
-- `charge_of`), for demand shares (own -1 when some replica
-- decided off Redis in it, -2 when the script did not read it: the caller
-- holds it already; either way no total follows). delta: what the charge
-- changed this replica's field by (0 when denied).
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
--
-- Written for a batch of many small requests, where every table lookup
-- and function call counts: what a request decides with lives in tables
-- made once per call and reused, the general path's hot part (a fixed or
-- sliding window) calls no function per request, and the call-level
-- arguments are read once. A request, or a group of equal requests (a
-- hot key's batch), on a window of its own in the call whose hash holds
-- nothing but counts (a spread of distinct keys, a hot key) takes a
-- shorter path still (`plain`): measured with callgrind on redis-server,
-- a lone request costs 30% fewer instructions there than on the general
-- path, which makes a table per window and defers its writes to the end
-- of the call, and whose functions and tables only a call that takes it
-- makes.

local floor, max, min, tonumber, gmatch, match, format, byte, sub =
  math.floor, math.max, math.min, tonumber, string.gmatch, string.match, string.format,
  string.byte, string.sub
-- Globals cost a lookup each time (about a tenth of a table's making).
-- The call's own numbers (its header, shapes and charges, all written by
-- the replica) are converted with `+ 0`, one strtod each: `tonumber`
-- converts twice (see `num`), and its 21 calls per call cost a hot key's
-- batch 10% of its instructions (callgrind).
local rcall, ARGV, KEYS = redis.call, ARGV, KEYS

-- Integers as strings, each made once per call: Lua formats a number with
-- sprintf whenever it becomes a string (in a key, or as a command's
-- argument), which costs more than a request's arithmetic; "%d" costs
-- half of tostring's "%.14g" (every number made a string here is an
-- integer).
local strings = {}
local function str(n)
  local s = strings[n]
  if not s then
    s = format('%d', n)
    strings[n] = s
  end
  return s
end

-- Count strings as numbers, each converted once per call: `tonumber`
-- converts a string twice (it checks, then converts, each time with
-- strtod), about a thousand instructions (callgrind), more than a
-- request's arithmetic, and a spread's counts are small numbers that
-- repeat from key to key. A value that is not a number counts as 0.
local numbers = {}
local function num(s)
  local n = numbers[s]
  if not n then
    n = tonumber(s) or 0
    numbers[s] = n
  end
  return n
end

-- What a window without holds or proofs shares (never written: a proof
-- is written to a table of the window's own, see `presumed`).
local NONE = {}

local t = rcall('TIME')
-- Redis's time in ms, read once per call.
local now = t[1] * 1000 + floor(t[2] / 1000)

local me = ARGV[1]
local epoch = ARGV[2] + 0
local margin = ARGV[3] + 0
local episode = ARGV[4]
local announce = ''
if episode ~= '' then announce = me .. ':' .. episode end
local fence_field, local_field, hold_field = 'f' .. me, 'o' .. me, 'h' .. me
local announced_field, proof_field = 'y' .. me, 'g' .. me

-- When a new window hash expires: its window's end (`at`) plus the margin
-- (in `at` already) plus a spread of up to min(unit, margin). Without the
-- spread every hash of a window expires in the same millisecond, and
-- Redis's expiry cycle deletes such a crowd in one go: 10,000 at once held
-- Redis 14-19 ms, past the replica's 15 ms budget, and every request in
-- flight then was denied. The spread is drawn per hash from a
-- Park-Miller sequence seeded by the call's microseconds, not by creation
-- time: a busy counter's hashes are all made in the first milliseconds of
-- their windows.
local draw = t[2] + 1
local function spread(unit)
  local span = unit
  if margin < span then span = margin end
  if span <= 0 then return 0 end
  draw = draw * 16807 % 2147483647
  return draw % span
end

-- When a new hash of window `w` of a fixed or sliding window charge
-- expires, before the spread: the window's end plus the margin (a sliding
-- window's one unit later, as the next window weighs it); a demand
-- window (the last of a block, see `charge_of`) no earlier than the end
-- of the block that reads it, so every replica finds it there whatever
-- its margin.
local function expiry(ch, w)
  local unit = ch.unit
  local at = (w + 1) * unit + margin
  if ch.algo == 2 then
    at = at + unit
  elseif ch.block > 1 and (w + 1) % ch.block == 0 and at < (w + 1 + ch.block) * unit then
    at = (w + 1 + ch.block) * unit
  end
  return at
end

-- The indices of a comma-separated list other than this replica's, and
-- the same as a set. Usually empty: then no iterator or table is made.
local EMPTY = {set = {}}
local function indices(list)
  if list == '' then return EMPTY end
  local out = {set = {}}
  for v in gmatch(list, '[^,]+') do
    if v ~= me then
      out[#out + 1] = v
      out.set[v] = true
    end
  end
  return out
end
local peers = indices(ARGV[5])
local silent = indices(ARGV[6])

-- Parsed request shapes and charges, by their string. One pattern match
-- each (an iterator over the fields cost three times as much).
local shapes, charges = {}, {}
local function shape_of(s)
  local k, c, f, times = match(s, '^(%d+),(%d+),(%d+),?(%d*)$')
  local flags = f + 0
  local has_id = flags % 4 >= 2
  -- first: where its first charge is, after the shape and any call id.
  -- times: how many requests a group stands for, or a run's members.
  local shape = {keys = k + 0, charges = c + 0, never_deny = flags % 2 == 1,
                 times = times ~= '' and times + 0 or 1, has_id = has_id, first = has_id and 2 or 1,
                 run = flags >= 4}
  shapes[s] = shape
  return shape
end
local function charge_of(s)
  local algo, limit, unit, burst, hits, f, expected_w, fraction, pending = match(s,
    '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),?([^,]*),?([^,]*)$')
  local flags = f + 0
  local ch = {algo = algo + 0, limit = limit + 0, unit = unit + 0,
              burst = burst + 0, hits = hits + 0,
              refund = flags % 2 == 1, role = (flags % 8 - flags % 2) / 2,
              demand_known = flags % 16 >= 8, pinned = flags % 32 >= 16, prove = flags >= 32,
              expected_w = expected_w + 0, fraction = fraction ~= '' and fraction + 0 or 0,
              pending = pending ~= '' and pending + 0 or 0}
  -- One fixed or sliding window charge, not a refund, a take-back or a
  -- presumption: what the short path and a group's members take.
  ch.window_only = (ch.algo == 1 or ch.algo == 2) and not ch.refund and not ch.pinned
    and ch.fraction <= 0
  -- A fixed window whose demand window's demand the caller holds, not a
  -- take-back: its reply is only remaining and delta, since the caller
  -- knows the rest (reset is the time to the end of the current window,
  -- and no demand is read). Two items fewer: each costs Redis about 450
  -- instructions to convert, and most of a busy key's requests are such.
  ch.short = ch.algo == 1 and ch.demand_known and not ch.pinned
  -- The demand block (LimitSpec::demand_window): a fixed window of a
  -- second or less takes its demand shares from the last window before
  -- its block of 5, read once per block rather than once per window; that
  -- window's hash is kept until its block ends (see `expiry`).
  ch.block = (ch.algo == 1 and ch.unit <= 1000) and 5 or 1
  charges[s] = ch
  return ch
end

-- The state of each key the call's requests read (each key is read once
-- per call), as they left it.
local windows = {}

-- Sum of the count fields of a window hash (HGETALL's reply), this
-- replica's Redis-path field, its local (outage) field, and its fence.
local function parse_window(key, flat)
  local total, own, own_local, fence, held = 0, 0, 0, 0, 0
  -- Every writer sets the hash's expiry when it creates it (its window's
  -- end plus the margin and a spread): an existing hash needs it no more.
  local exists = #flat > 0
  local holds, proofs, x, mine = NONE, NONE, nil, nil
  -- Some replica decided off Redis in this window (it replayed, held, or
  -- announced a failure episode): its totals may be incomplete.
  local troubled = false
  for i = 1, #flat, 2 do
    local f = flat[i]
    local b = byte(f, 1)
    if b and b >= 48 and b <= 57 then
      local s = flat[i + 1]
      local v = numbers[s] or num(s)
      total = total + v
      if f == me then own = v end
    elseif b == 111 then -- 'o'
      local s = flat[i + 1]
      local v = numbers[s] or num(s)
      total = total + v
      troubled = true
      if f == local_field then own_local = v end
    elseif b == 104 then -- 'h': another replica's unspent lease
      troubled = true
      if f ~= hold_field then
        local v = num(flat[i + 1])
        held = held + v
        if holds == NONE then holds = {} end
        holds[sub(f, 2)] = v
      end
    elseif b == 103 then -- 'g': a proof
      if proofs == NONE then proofs = {} end
      proofs[sub(f, 2)] = flat[i + 1]
    elseif f == 'x' then
      x = flat[i + 1]
      troubled = true
    elseif f == announced_field then
      mine = flat[i + 1]
    elseif f == fence_field then
      fence = num(flat[i + 1])
    end
  end
  local w = {total = total, own = own, own_local = own_local, fence = fence, held = held,
             holds = holds, proofs = proofs, x = x, mine = mine, troubled = troubled,
             exists = exists}
  windows[key] = w
  return w
end

local out = {}
local nout = 0

-- The sum of a window hash's count fields, this replica's count (and
-- its string) and its fence; nil when the hash holds more than the
-- replicas' counts and this replica's fence.
local function counts(flat)
  local total, own, own_s, fence = 0, 0, nil, 0
  for i = 1, #flat, 2 do
    local f = flat[i]
    -- This replica's own field first: comparing interned strings costs
    -- less than string.byte, a C function call.
    if f == me then
      own_s = flat[i + 1]
      own = numbers[own_s] or num(own_s)
      total = total + own
    elseif f == fence_field then
      fence = num(flat[i + 1])
    else
      local b = byte(f, 1)
      if b and b >= 48 and b <= 57 then
        local s = flat[i + 1]
        total = total + (numbers[s] or num(s))
      else
        return nil
      end
    end
  end
  return total, own, own_s, fence
end

-- Appends the replies of `m` members of a group after its first (see the
-- main loop's group path): each is decided on `used` plus a count raised
-- by what the members before it were granted, and gets the first's reset
-- and demand. Returns the count after them and the new end of `out`.
-- (It captures nothing: a closure made with upvalues costs more.)
local function members(out, o, m, used, count, limit, hits, may_deny, reset, own, total)
  for _ = 1, m do
    local after = used + count + hits
    local status, remaining, delta = 0, 0, hits
    if after > limit then
      remaining = -1
      if may_deny then status, delta = 1, 0 end
    elseif limit > after then
      remaining = limit - after
    end
    count = count + delta
    -- A group's charge is a fixed or sliding window, never a take-back,
    -- so own is -2 (demand not read) exactly when it is short; and a
    -- group's request has one charge, so when short it may be answered
    -- by its remaining alone (see the reply above).
    if own == -2 then
      if status == 0 and remaining >= 0 then
        out[o + 1] = remaining
        o = o + 1
      else
        out[o + 1], out[o + 2], out[o + 3] = -2 - status, remaining, delta
        o = o + 3
      end
    elseif own < 0 then
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = status, remaining, reset, own, delta
      o = o + 5
    else
      out[o + 1], out[o + 2], out[o + 3] = status, remaining, reset
      out[o + 4], out[o + 5], out[o + 6] = own, total, delta
      o = o + 6
    end
  end
  return count, o
end

-- Decides a request of one fixed or sliding window charge (not a refund, a
-- take-back or a presumption), or a group of `times` such requests, on a
-- window no earlier request of the call read: when the window's hash
-- holds only the replicas' counts and this replica's fence, it is decided
-- and written at once, without the state the general path keeps for
-- windows that repeat (the code below for this case). A later request on
-- the same window reads it again, written. Returns how many members of
-- the group it decided: all of them, only the first when that one is
-- stale or lost (the general path decides the others, as it would have),
-- or none, with the window read into `windows`, when the hash holds more.
-- A hot key's batch is one such group: decided here, it cost Redis 11%
-- fewer instructions per call than the general path's first member and
-- group loop (callgrind, groups of 8).
local function plain(ch, base, e, never_deny, times)
  local unit = ch.unit
  local w = (now - now % unit) / unit
  local key = base .. '@' .. (strings[w] or str(w))
  if windows[key] then return 0 end
  local flat = rcall('HGETALL', key)
  local nflat = #flat
  local total, own, own_s, fence
  -- A window no replica counted in yet, or only this one (without a
  -- fence): decided without a call to `counts`, which with its four
  -- results costs 2% of a request's instructions (callgrind).
  if nflat == 0 then
    total, own, fence = 0, 0, 0
  elseif nflat == 2 and flat[1] == me then
    own_s = flat[2]
    own = numbers[own_s] or num(own_s)
    total, fence = own, 0
  else
    total, own, own_s, fence = counts(flat)
    if not total then
      parse_window(key, flat)
      return 0
    end
  end
  local algo = ch.algo
  -- The previous window (a fixed window's demand window): its total,
  -- this replica's count in it, its fence, and whether some replica
  -- decided off Redis in it.
  local p_total, p_own, p_fence, p_troubled = 0, 0, 0, false
  if algo == 2 or not ch.demand_known then
    local pw = w - w % ch.block - 1
    local pkey = base .. '@' .. (strings[pw] or str(pw))
    local prev = windows[pkey]
    if not prev then
      local pflat = rcall('HGETALL', pkey)
      local np = #pflat
      -- As for the current window: empty, or this replica's count alone.
      if np == 2 and pflat[1] == me then
        local s = pflat[2]
        p_own = numbers[s] or num(s)
        p_total = p_own
      elseif np > 0 then
        local own_s_prev
        p_total, p_own, own_s_prev, p_fence = counts(pflat)
        if not p_total then prev = parse_window(pkey, pflat) end
      end
    end
    if prev then
      p_total, p_own, p_fence, p_troubled = prev.total, prev.own + prev.own_local, prev.fence,
        prev.troubled
    end
  end
  local at = nout + 1
  if fence > epoch or (algo == 2 and p_fence > epoch) then
    out[at] = -1
    nout = at
    return 1
  end
  -- Lost when Redis holds less of this replica's count than it knows of;
  -- usually it holds just that, told without parsing it.
  local lost = false
  if e ~= '-1' and e ~= own_s and w == ch.expected_w then lost = own < (tonumber(e) or -1) end
  local weighted = 0
  if algo == 2 and p_total > 0 then
    weighted = floor(p_total * (unit - (now - w * unit)) / unit)
  end
  local limit, hits = ch.limit, ch.hits
  local estimate = weighted + total + ch.pending
  local after = estimate + hits
  local over = after > limit
  local denied = over and not never_deny and ch.role ~= 1
  local status, remaining, delta = 0, 0, hits
  if denied then status, delta = 1, 0 end
  if lost then status = status + 2 end
  if over then
    remaining = -1
  elseif limit > after then
    remaining = limit - after
  end
  -- Demand shares only from a window every replica decided on Redis.
  if not (algo == 2 or not ch.demand_known) then
    p_own, p_total = -2, 0
  elseif p_troubled then
    p_own, p_total = -1, 0
  end
  local reset = (w + 1) * unit - now
  -- The reply's items, written out here as in `members` and the general
  -- path: a function for these lines cost 1.8% of a request's
  -- instructions (callgrind).
  -- This path decides requests of one charge: a short one admitted with
  -- room to spare is answered by its remaining alone (see the reply).
  if ch.short then
    if status == 0 and remaining >= 0 then
      out[at] = remaining
      nout = at
    else
      out[at], out[at + 1], out[at + 2] = -2 - status, remaining, delta
      nout = at + 2
    end
  elseif p_own < 0 then
    out[at], out[at + 1], out[at + 2], out[at + 3], out[at + 4] = status, remaining, reset, p_own, delta
    nout = at + 4
  else
    out[at], out[at + 1], out[at + 2] = status, remaining, reset
    out[at + 3], out[at + 4], out[at + 5] = p_own, p_total, delta
    nout = at + 5
  end
  local decided = 1
  if times > 1 and not lost then
    -- The group's other members, as the general path's group loop decides
    -- them.
    local count
    count, nout = members(out, nout, times - 1, weighted + ch.pending, total + delta, limit,
      hits, not never_deny and ch.role ~= 1, reset, p_own, p_total)
    delta = count - total
    decided = times
  end
  if delta ~= 0 then
    rcall('HINCRBY', key, me, strings[delta] or str(delta))
    if nflat == 0 then
      rcall('PEXPIREAT', key, format('%d', expiry(ch, w) + spread(unit)))
    end
  end
  return decided
end

-- The request being decided: `serial` tells its touches from earlier
-- requests'; `touched` the key states it changed, each backed up (in the
-- state itself) on the request's first touch, to be undone if it is
-- denied or stale; `meta` its announcements and proofs; `wr` its writes,
-- 8 slots each. These tables, like the general path's functions, are made
-- by the first request of a call that takes that path (see there).
local serial = 0
local touched, ntouched = nil, 0
local meta, nmeta = nil, 0
local wr, nwr = nil, 0
-- Per charge i of the request, at 8 × (i − 1): its role, over, remaining
-- before and after, reset, own, total and delta. One table rather than
-- one per item: every table here is made anew by each call.
local r

-- The general path's functions, made in the main loop when a call first
-- takes that path (see there).
local window_keys, window_key, read_window, touch, undo, window, write, presumed

-- The window increments of the call's admitted requests, one HINCRBY per
-- key at the end of the call: the state the later requests saw already
-- counted them. By key: the increment and the expiry to set on a hash
-- that did not exist; `order`: the keys in their first write's order.
-- (Numbers in tables made once per call, not a table per key; made with
-- the general path's.)
local incr, incr_at, order, norder = nil, nil, nil, 0

-- The window charge the last request decided went through, for the
-- members of a group after its first (see the main loop).
local last_cur, last_key, last_weighted, last_expire_at, last_reset, last_own, last_total

local ko, ao = 0, 8
for _ = 1, ARGV[7] + 0 do
  local shape = shapes[ARGV[ao]] or shape_of(ARGV[ao])
  local nc = shape.charges
  -- Where the request's charge strings and expected counts are, and the
  -- step from one charge's to the next: interleaved in a request or a
  -- group, each in a row in a run (whose members share the charge
  -- strings, and each have their expected counts in turn).
  local times, run = shape.times, 1
  local cs, cstep, ex, estep = ao + shape.first, 2, ao + shape.first + 1, 2
  if shape.run then
    times, run = 1, shape.times
    cs, cstep, ex, estep = ao + 1, 1, ao + 1 + nc, 1
  end
  local kb = ko
  for _ = 1, run do
    local member = 0
    if nc == 1 then
      local s = ARGV[cs]
      local ch = charges[s] or charge_of(s)
      if ch.window_only then
        member = plain(ch, KEYS[kb + 1], ARGV[ex], shape.never_deny, times)
      end
    end
    while member < times do
      member = member + 1
      -- One request's decision: its keys follow KEYS[kb], its charge
      -- strings and expected counts are at `cs` and `ex`; its reply goes to
      -- `out` from `at` on.
      -- Written inline, not as a function: a function made per call
      -- captures most of the chunk's locals, and making it (Lua walks its
      -- open upvalues for each) cost more than a request's arithmetic.
      if not touch then
        -- Made here, once per call and only by a call that takes this path:
        -- a call whose requests all take the short path (a hot key's group,
        -- a spread of distinct keys) never does. Made at the top of the
        -- script (or by a function made there), they cost every call 7% of
        -- its instructions (callgrind, a hot key's group of 8): Lua walks
        -- the list of captured locals for each upvalue of a closure it makes.

        touched, meta, wr, r, incr, incr_at, order = {}, {}, {}, {}, {}, {}, {}

        -- "<base>@<w>", made once per call per window.
        window_keys = {}
        function window_key(base, w)
          local per = window_keys[base]
          if not per then
            per = {}
            window_keys[base] = per
          end
          local key = per[w]
          if not key then
            key = base .. '@' .. (strings[w] or str(w))
            per[w] = key
          end
          return key
        end

        function read_window(key)
          return parse_window(key, rcall('HGETALL', key))
        end

        -- Backs up a key state's counts on the request's first touch (the window
        -- path does the same inline). Announcement state is backed up apart, and
        -- only when a request changes it (`presumed`).
        function touch(st)
          if st.mark ~= serial then
            st.mark = serial
            ntouched = ntouched + 1
            touched[ntouched] = st
            st.b_total, st.b_own, st.b_count = st.total, st.own, st.count
            st.b_tokens, st.b_updated = st.tokens, st.updated
          end
          return st
        end

        -- Undoes this request's changes: its counts when it is denied (its
        -- announcements and proofs are written all the same), everything when it
        -- is stale (nothing is written).
        function undo(all)
          for k = 1, ntouched do
            local st = touched[k]
            st.total, st.own, st.count = st.b_total, st.b_own, st.b_count
            st.tokens, st.updated = st.b_tokens, st.b_updated
            if all and st.meta_mark == serial then
              st.x, st.mine, st.proofs, st.troubled = st.b_x, st.b_mine, st.b_proofs, st.b_troubled
              if st.b_proofs ~= NONE then st.b_proofs[me] = st.b_proof end
            end
          end
        end

        function window(key)
          return touch(windows[key] or read_window(key))
        end

        function write(kind, a, b, c, d, e, f, g)
          local at = nwr * 8
          nwr = nwr + 1
          wr[at + 1], wr[at + 2], wr[at + 3], wr[at + 4] = kind, a, b, c
          wr[at + 5], wr[at + 6], wr[at + 7], wr[at + 8] = d, e, f, g
        end

        -- What the presumed members may grant in window `cur` unseen, beyond
        -- their holds (see "presumed holds"); also queues this request's
        -- announcement and proof for the window.
        function presumed(key, cur, fraction, limit, prove, expire_at)
          local announcing = announce ~= '' and fraction > 0 and cur.mine ~= episode
          local proving = not announcing and prove and cur.x and cur.proofs[me] ~= cur.x
          if (announcing or proving) and cur.meta_mark ~= serial then
            cur.meta_mark = serial
            cur.b_x, cur.b_mine, cur.b_proofs, cur.b_troubled = cur.x, cur.mine, cur.proofs, cur.troubled
            cur.b_proof = cur.proofs[me]
          end
          if announcing then
            cur.x = announce
            cur.mine = episode
            cur.proofs = {}
            cur.troubled = true
            nmeta = nmeta + 1
            meta[nmeta] = {key, 'x', announce, announced_field, episode, expire_at}
          elseif proving then
            if cur.proofs == NONE then cur.proofs = {} end
            cur.proofs[me] = cur.x
            nmeta = nmeta + 1
            meta[nmeta] = {key, proof_field, cur.x, nil, nil, expire_at}
          end
          if fraction <= 0 then return 0 end
          local share = floor(fraction * limit)
          local extra = 0
          local holds = cur.holds
          -- A presumed member's unspent lease "h" counts towards its presumption,
          -- not on top. Its replayed local grants "o" do count on top: they may
          -- come from a lease larger than the share presumed, so leaving them out
          -- would undercount.
          for k = 1, #silent do
            extra = extra + max(0, share - (holds[silent[k]] or 0))
          end
          if announce ~= '' then
            local x, proofs, is_silent = cur.x, cur.proofs, silent.set
            for k = 1, #peers do
              local j = peers[k]
              if not is_silent[j] and (x == nil or proofs[j] ~= x) then
                extra = extra + max(0, share - (holds[j] or 0))
              end
            end
          end
          return extra
        end
      end
      -- Where this request's reply starts, and its status once decided
      -- (-1 stale; the reply's first item may be its remaining instead).
      local at = nout + 1
      local status = -1
      serial = serial + 1
      ntouched, nmeta, nwr = 0, 0, 0
      local call_id = ''
      if shape.has_id then call_id = ARGV[ao + 1] end
      local n = nc
      local stale = false
      local lost = false
      -- A short charge of a demand block whose current window carries
      -- some replica's decisions off Redis (see `own` below): the whole
      -- request is answered in full, status + 4.
      local void = false

      for i = 1, n do
        local s = ARGV[cs + cstep * (i - 1)]
        local ch = charges[s] or charge_of(s)
        local algo, limit, unit, hits = ch.algo, ch.limit, ch.unit, ch.hits
        local refund = ch.refund
        -- Usually -1 (unknown), told apart without parsing it.
        local e = ARGV[ex + estep * (i - 1)]
        local expected = -1
        if e ~= '-1' then expected = tonumber(e) end
        local expected_w = ch.expected_w
        local base = KEYS[kb + i]
        local over, rem_now, rem_after, reset, own, total, delta = 0, 0, 0, 0, 0, 0, 0

        if algo == 1 or algo == 2 then
          local w = (now - now % unit) / unit
          -- A take-back is decided in window expected_w, the one the charge
          -- it reverses landed in, whatever the time now.
          local pinned = ch.pinned
          if pinned then w = expected_w end
          -- Made here rather than by `window_key`, whose table per base key
          -- costs more than the concatenation when keys do not repeat.
          local key = base .. '@' .. (strings[w] or str(w))
          local cur = windows[key] or read_window(key)
          if cur.mark ~= serial then
            cur.mark = serial
            ntouched = ntouched + 1
            touched[ntouched] = cur
            cur.b_total, cur.b_own = cur.total, cur.own
          end
          if cur.fence > epoch then stale = true end
          if expected >= 0 and w == expected_w and cur.own < expected then lost = true end
          local weighted = 0
          -- The previous window (or a fixed window's demand window) is
          -- complete, so every replica reads the same totals for it: demand
          -- shares taken from it add up to exactly 1. A
          -- fixed window reads it only for those shares, so not when the caller
          -- has them already (it then gets no demand back, and keeps its own).
          local prev = nil
          if algo == 2 or not ch.demand_known then
            -- Only read here (this path never changes it), so no backup.
            -- A sliding window's block is 1: its demand window is the
            -- previous one, which it weighs.
            local pw = w - w % ch.block - 1
            local pkey = base .. '@' .. (strings[pw] or str(pw))
            prev = windows[pkey] or read_window(pkey)
          end
          if algo == 2 then
            if prev.fence > epoch then stale = true end
            if prev.total > 0 and not pinned then
              weighted = floor(prev.total * (unit - (now - w * unit)) / unit)
            end
          end
          -- For a hash this call makes (the window's, or its announcement's).
          local expire_at = expiry(ch, w) + spread(unit)
          -- What the other replicas off Redis still hold of their leases, or may
          -- hold unseen, counts as used here, so it is not granted twice (a
          -- presumption only after a failure, or to prove a window).
          local count = cur.total + ch.pending + cur.held
          local fraction = ch.fraction
          if fraction > 0 or (ch.prove and cur.x) then
            count = count + presumed(key, cur, fraction, limit, ch.prove, expire_at)
          end
          local estimate = weighted + count
          local after
          if refund then
            local left = cur.total - hits
            if left < 0 then left = 0 end
            delta = left - cur.total
            after = weighted + left + cur.held
          else
            delta = hits
            after = estimate + hits
            if after > limit then over = 1 end
          end
          rem_now = limit - estimate
          if rem_now < 0 then rem_now = 0 end
          if over == 0 and limit > after then rem_after = limit - after end
          reset = (w + 1) * unit - now
          cur.total = cur.total + delta
          cur.own = cur.own + delta
          -- Demand shares only from a window every replica decided on Redis:
          -- shares taken from incomplete totals could add up to more than 1.
          if prev == nil then
            own = -2
            -- A demand window read once per block can gain a replay's
            -- marks after this replica read it: a replica back from its
            -- failure replays and announces its episode in the window it
            -- returns in. So a short charge that finds its current window
            -- so marked voids the share the caller holds (own -1): every
            -- replica deciding the key on Redis after the marks falls back
            -- to 1/N for the rest of the block, as the returning one does,
            -- rather than keep shares that no longer add up to 1.
            if ch.short and ch.block > 1 and cur.troubled then
              own = -1
              void = true
            end
          elseif prev.troubled then
            own = -1
          else
            own = prev.own + prev.own_local
            total = prev.total
          end
          last_cur, last_key, last_weighted, last_expire_at = cur, key, weighted, expire_at
          last_reset, last_own, last_total = reset, own, total
          if delta ~= 0 then
            local at = nwr * 8
            nwr = nwr + 1
            wr[at + 1], wr[at + 2], wr[at + 3], wr[at + 4] = 'hincr', key, delta, expire_at
          end
        elseif algo == 3 then
          -- Sliding log: one member per hit, scored by time; member ids are
          -- "<replica>:<call id>:<charge>:<n>", so replaying a call is a no-op.
          local st = windows[base]
          if not st then
            rcall('ZREMRANGEBYSCORE', base, '-inf', now - unit)
            st = {count = rcall('ZCARD', base)}
            windows[base] = st
          end
          touch(st)
          local count = st.count
          local after
          -- One member per hit: a charge of more than 10000 hits (the
          -- engines' LOG_MAX_HITS_PER_CALL) is over and adds nothing; a
          -- refund takes at most that many.
          if refund then
            local k = min(hits, count, 10000)
            after = count - k
            if k > 0 then write('zpop', base, k) end
            delta = -k
          else
            after = count + hits
            local too_big = hits > 10000
            if after > limit or too_big then over = 1 end
            -- Past the limit (shadow) the log saturates at limit + 1 members.
            local m = min(hits, max(0, limit + 1 - count))
            if too_big then m = 0 end
            if m > 0 then
              write('zadd', base, m, i, now + unit + margin)
            end
            delta = m
          end
          -- What the log holds now (a charge past the limit adds fewer
          -- members than hits), for the requests after this one.
          st.count = count + delta
          rem_now = max(0, limit - count)
          rem_after = (over == 1) and 0 or max(0, limit - after)
          local oldest = rcall('ZRANGE', base, 0, 0, 'WITHSCORES')
          local first = tonumber(oldest[2]) or now
          if count == 0 and after > 0 then first = now end
          reset = max(1, first + unit - now)
          own = -2
          total = after
        else
          -- Token bucket: hash "<base>" with t (tokens) and u (updated, ms);
          -- consumption per replica goes to a fixed-window hash "<base>@<w>" for
          -- demand shares and replay.
          local burst = ch.burst
          local st = windows[base]
          if not st then
            local v = rcall('HMGET', base, 't', 'u', fence_field)
            st = {tokens = tonumber(v[1]) or burst, updated = tonumber(v[2]) or now,
                  fence = tonumber(v[3]) or 0}
            windows[base] = st
          end
          touch(st)
          -- Every request of the call checks the fence, not only the first.
          if st.fence > epoch then stale = true end
          local elapsed = max(0, now - st.updated)
          local rate = limit / unit
          local tokens_now = min(burst, st.tokens + elapsed * rate)
          local after
          if refund then
            after = min(burst, tokens_now + hits)
          else
            if hits > tokens_now then over = 1 end
            after = max(0, tokens_now - hits)
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
          rem_now = floor(tokens_now)
          rem_after = (over == 1) and 0 or floor(after)
          reset = max(1, full_in)
          local w = floor(now / unit)
          local ckey = window_key(base, w)
          local use = window(ckey)
          if expected >= 0 and w == expected_w and use.own < expected then lost = true end
          -- What this charge drew from the bucket: its hits when admitted, what
          -- was left when charged past empty (shadow); always an integer.
          local consumed = 0
          if not refund then
            if over == 1 then consumed = floor(tokens_now) else consumed = hits end
          end
          use.total = use.total + consumed
          use.own = use.own + consumed
          local prev_use = window(window_key(base, w - 1))
          own = prev_use.own + prev_use.own_local
          total = prev_use.total
          delta = consumed
          write('bucket', base, after, now, full_in + margin, ckey, consumed,
            (w + 1) * unit + margin + spread(unit))
        end
        local b = (i - 1) * 8
        r[b + 1], r[b + 2], r[b + 3], r[b + 4] = ch.role, over, rem_now, rem_after
        r[b + 5], r[b + 6], r[b + 7], r[b + 8] = reset, own, total, delta
      end
      if stale then
        undo(true)
        out[nout + 1] = -1
        nout = nout + 1
      else
        -- Announcements and proofs are facts about who decides where, written
        -- whether or not the request is admitted.
        for k = 1, nmeta do
          local m = meta[k]
          if m[4] then
            rcall('HSET', m[1], m[2], m[3], m[4], m[5])
          else
            rcall('HSET', m[1], m[2], m[3])
          end
          if rcall('PTTL', m[1]) < 0 then rcall('PEXPIREAT', m[1], m[6]) end
        end

        local enforce_over = false
        local quota_seen = false
        local quota_all_over = true
        for i = 1, n do
          local b = (i - 1) * 8
          local is_over = r[b + 2] == 1
          local role = r[b + 1]
          if role == 0 then
            if is_over then enforce_over = true end
          elseif role == 2 then
            quota_seen = true
            if not is_over then quota_all_over = false end
          end
        end
        local denied = (not shape.never_deny) and (enforce_over or (quota_seen and quota_all_over))

        if denied then
          undo(false)
        else
          for k = 0, nwr - 1 do
            local at = k * 8
            local kind, a, b, c, d, e, f, g =
              wr[at + 1], wr[at + 2], wr[at + 3], wr[at + 4], wr[at + 5], wr[at + 6], wr[at + 7], wr[at + 8]
            if kind == 'hincr' then
              -- a key, b delta, c expire_at
              local p = incr[a]
              if not p then
                p = 0
                incr_at[a] = c
                norder = norder + 1
                order[norder] = a
              end
              incr[a] = p + b
            elseif kind == 'zadd' then
              -- a key, b members, c charge index, d expire_at. In chunks:
              -- unpack() has a small stack limit.
              local args = {}
              for j = 1, b do
                args[#args + 1] = now
                args[#args + 1] = me .. ':' .. call_id .. ':' .. c .. ':' .. j
                if #args >= 1000 or j == b then
                  rcall('ZADD', a, unpack(args))
                  args = {}
                end
              end
              rcall('PEXPIREAT', a, d)
            elseif kind == 'zpop' then
              rcall('ZPOPMAX', a, b)
            elseif kind == 'bucket' then
              -- a key, b tokens, c updated, d ttl, e window key, f consumed,
              -- g window expire_at
              rcall('HSET', a, 't', string.format('%.17g', b), 'u', c)
              rcall('PEXPIRE', a, d)
              if f > 0 then
                rcall('HINCRBY', e, me, f)
                rcall('PEXPIREAT', e, g)
              end
            end
          end
        end

        status = 0
        if denied then status = 1 end
        if lost then status = status + 2 end
        if void then status = status + 4 end
        out[nout + 1] = status
        nout = nout + 1
        for i = 1, n do
          local b = (i - 1) * 8
          local remaining = r[b + 4]
          if r[b + 2] == 1 then
            remaining = -1
          elseif denied then
            remaining = r[b + 3]
          end
          local delta = r[b + 8]
          if denied then delta = 0 end
          local own = r[b + 6]
          local ch = charges[ARGV[cs + cstep * (i - 1)]]
          -- Short, unless the request is answered in full (void).
          local short = ch.short and not void
          if ch.short and n == 1 then
            -- A request of one short charge: its remaining alone, in place
            -- of its status, when admitted as asked with room to spare;
            -- else -2 - status, so -6 and below when answered in full.
            if void then
              out[nout] = -2 - status
            elseif status == 0 and remaining >= 0 and delta == ch.hits then
              out[nout] = remaining
            else
              out[nout], out[nout + 1], out[nout + 2] = -2 - status, remaining, delta
              nout = nout + 2
            end
          elseif short then
            out[nout + 1], out[nout + 2] = remaining, delta
            nout = nout + 2
          end
          if not short then
            if own < 0 then
              out[nout + 1], out[nout + 2], out[nout + 3], out[nout + 4] = remaining, r[b + 5], own, delta
              nout = nout + 4
            else
              out[nout + 1], out[nout + 2], out[nout + 3] = remaining, r[b + 5], own
              out[nout + 4], out[nout + 5] = r[b + 7], delta
              nout = nout + 5
            end
          end
        end
      end
      if member == 1 and times > 1 then
        local ch = nc == 1 and charges[ARGV[cs]]
        if ch and ch.window_only and (status == 0 or status == 1) then
          -- The members of a group after its first, which was just
          -- decided: one fixed or sliding window charge, not a refund or a
          -- take-back, no presumption, neither stale nor lost. For each of
          -- them the code above would find the same window, fence, weight of
          -- the previous window, reset and demand, no announcement or proof
          -- to make (the first made it), and a count raised by what the
          -- members before it were granted; so this is that code for that
          -- case, without its bookkeeping. Each member's reply is appended
          -- as above.
          local cur = last_cur
          local count
          count, nout = members(out, nout, times - 1, last_weighted + ch.pending + cur.held,
            cur.total, ch.limit, ch.hits, not shape.never_deny and ch.role ~= 1, last_reset,
            last_own, last_total)
          local added = count - cur.total
          if added ~= 0 then
            local p = incr[last_key]
            if not p then
              p = 0
              incr_at[last_key] = last_expire_at
              norder = norder + 1
              order[norder] = last_key
            end
            incr[last_key] = p + added
            cur.total = count
            cur.own = cur.own + added
          end
          member = times
        end
      end
    end
    kb = kb + shape.keys
    ex = ex + nc
  end
  if shape.run then
    ko = ko + run * shape.keys
    ao = ao + 1 + nc + run * nc
  else
    ko = ko + shape.keys
    ao = ao + shape.first + 2 * nc
  end
end

for k = 1, norder do
  local key = order[k]
  local d = incr[key]
  if d ~= 0 then
    rcall('HINCRBY', key, me, strings[d] or str(d))
    if not windows[key].exists then
      local e = incr_at[key]
      rcall('PEXPIREAT', key, format('%d', e))
    end
  end
end
out[nout + 1] = now
out[nout + 2] = ARGV[#ARGV] + 0
return out
