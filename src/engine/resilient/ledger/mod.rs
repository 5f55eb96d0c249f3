//! The ledger: what this replica knows about its own counts, per (key,
//! window), not per request, so memory grows with active keys and never with
//! traffic. It feeds three things:
//!
//! - **Replay of local usage.** Per live window, the cumulative grants this
//!   replica made on its lease; replay sets its `o<idx>` field to it (see
//!   the replay script): idempotent, attributed to the window it happened
//!   in, and free of races because no other writer touches that field.
//! - **Repair of suspect keys.** Per live window, the sum of the deltas of
//!   Redis-path calls Redis confirmed. A key whose call failed in a way that
//!   may still apply is *suspect*: it is decided locally until a repair sets
//!   its `<idx>` field to that sum behind a fresh fence, which waits until no
//!   Redis call for it can still be in flight (a deadline after the last).
//!   The repair covers every live window such a call can have landed in,
//!   from its sending on, those where this replica has no count (0) too.
//! - **Lease inputs.** The last remaining count Redis reported for the
//!   current window and this replica's share of the key's traffic.
//!
//! Bounded: at most `max_keys` keys and `max_bytes` bytes (key sizes
//! included); windows past their life are dropped. A new key when full
//! evicts, in O(1), the least recently used of a few sampled entries that
//! hold no unreplayed usage; entries with unreplayed usage are never
//! evicted. If the sample has none, the new key is not tracked: its usage
//! is counted in `dropped_usage` (a Redis-path charge in `untracked`) and
//! reported in a log line at most every 10 s, without raw values. So the
//! replay guarantee (a replica knows its own count for each live window)
//! holds for every key the ledger tracks, and what it could not track is
//! counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::domain::backend::{RawItem, ReplayEntry, DEMAND_NOT_READ, DEMAND_TROUBLED};
use crate::key::CounterKey;
use crate::limit::{Algorithm, LimitSpec};

mod calls;
mod holds;
mod replay;
mod views;

const SHARDS: usize = 32;
/// Entries looked at to choose one to evict.
const EVICTION_SAMPLE: usize = 16;
/// How often a "ledger full" line may be logged.
const FULL_LOG_EVERY_MS: u64 = 10_000;

/// An estimate of one entry's memory: the key's bytes and allocation
/// header, the map's entry at its load factor, and a few windows.
fn entry_cost(key: &CounterKey) -> usize {
    key.as_str().len()
        + 16
        + std::mem::size_of::<(CounterKey, Entry)>() * 8 / 7
        + 2 * std::mem::size_of::<WindowTally>()
}

#[derive(Clone, Debug, Default)]
struct WindowTally {
    window: u64,
    /// Sum of the deltas of confirmed Redis-path calls: the `<idx>` field.
    redis_own: i64,
    /// Cumulative local grants: the `o<idx>` field once replayed.
    local_own: i64,
    /// The `local_own` value Redis last confirmed.
    local_replayed: i64,
    /// What of this replica's lease for the window it has not granted, to be
    /// held in Redis (`h<idx>`) while it decides off Redis; 0 once back.
    hold: i64,
    /// The `hold` value Redis last confirmed.
    hold_written: i64,
    /// A replay of this window failed after it may have been written, so
    /// Redis may hold a local field or hold the tallies know nothing of:
    /// both are written again, even where the tallies agree (the local
    /// count can come back to the value last confirmed: a take-back then
    /// a grant, with the take-back's write in doubt in between).
    unsure: bool,
    /// While `unsure`: the lowest local count that a replay failed since
    /// Redis last confirmed one may have left in the local field. The
    /// journal counts from it (see [`Ledger::unreplayed_snapshot`]).
    unsure_low: i64,
}

#[derive(Clone, Debug)]
struct Entry {
    spec: LimitSpec,
    windows: Vec<WindowTally>,
    /// (window, remaining) from the last Redis reply.
    last_remaining: Option<(u64, u64, u64)>,
    /// What Redis said of a complete window, and that window: this
    /// replica's part of the key's traffic in it, or `None` when it gave
    /// none (empty, or some replica decided off Redis in it). Either way
    /// the script need not read that window again (see
    /// [`Entry::demand_share`]).
    demand: Option<(Option<f64>, u64)>,
    /// The window of the latest decision reply for the key.
    reply_window: u64,
    /// A Redis call may have applied without this replica knowing.
    suspect: bool,
    /// Redis time (estimated, a little early) at which the first call that
    /// made the key suspect was sent: such a call can have landed in any
    /// window from this one on, including one where no call of this
    /// replica was ever confirmed, so the repair fences them all.
    unsure_from_ms: Option<u64>,
    /// Bumped whenever the key becomes suspect; a repair clears the flag
    /// only if nothing changed while it ran.
    version: u64,
    last_issue_ms: u64,
    touched_ms: u64,
    /// Local time the entry was made: every confirmed call for the key
    /// since is in its tallies.
    created_ms: u64,
    /// Redis-path calls with a refund for this key sent and not yet
    /// answered. A refund lowers this replica's field before its reply
    /// lowers the confirmed count, so meanwhile a field below the confirmed
    /// count is no sign of data loss.
    refunds_in_flight: u32,
    /// Refund calls ever sent for this key (see [`Ledger::refund_mark`]).
    refunds_sent: u64,
    /// Redis-path calls sent and not yet answered or failed, late ones
    /// included: no repair while any can still apply and report back.
    calls_in_flight: u32,
}

impl Entry {
    /// The demand share, only when it describes the demand window
    /// ([`LimitSpec::demand_window`]) of the one this replica last heard
    /// about: the replicas' shares add up to 1 only if they all come from
    /// one window. A window in which some replica decided off Redis
    /// reports no demand (`decide.lua`), so a replica that heard from
    /// Redis after one has none, rather than an older one its peers may no
    /// longer share; it leases `1/N`.
    fn demand_share(&self) -> Option<f64> {
        self.demand
            .filter(|(_, w)| *w == self.spec.demand_window(self.reply_window))
            .and_then(|(d, _)| d)
    }

    fn new(spec: LimitSpec, now_ms: u64) -> Self {
        Entry {
            spec,
            windows: Vec::new(),
            last_remaining: None,
            demand: None,
            reply_window: 0,
            suspect: false,
            unsure_from_ms: None,
            version: 0,
            last_issue_ms: 0,
            touched_ms: now_ms,
            created_ms: now_ms,
            refunds_in_flight: 0,
            refunds_sent: 0,
            calls_in_flight: 0,
        }
    }

    fn window_mut(&mut self, window: u64) -> &mut WindowTally {
        match self.windows.iter().position(|w| w.window == window) {
            Some(i) => &mut self.windows[i],
            None => {
                // Most keys only ever have one or two live windows; a plain
                // push would allocate room for four (192 bytes a key).
                self.windows.reserve_exact(1);
                self.windows.push(WindowTally {
                    window,
                    ..Default::default()
                });
                let last = self.windows.len() - 1;
                &mut self.windows[last]
            }
        }
    }

    fn unreplayed(&self) -> i64 {
        self.windows
            .iter()
            .map(|w| {
                w.local_own
                    .saturating_sub(w.local_replayed)
                    .saturating_abs()
            })
            .fold(0, i64::saturating_add)
    }

    fn needs_replay(&self) -> bool {
        self.suspect
            || self
                .windows
                .iter()
                .any(|w| w.unsure || w.local_own != w.local_replayed || w.hold != w.hold_written)
    }
}

/// A replay plan item with the entry version it was taken at.
#[derive(Clone, Debug)]
pub struct Planned {
    pub entries: Vec<ReplayEntry>,
    pub key: CounterKey,
    pub version: u64,
    /// The plan repairs the key (it was suspect and quiet).
    pub repairs: bool,
}

/// Window index of `now_ms` for a spec.
pub fn window_of(spec: &LimitSpec, now_ms: u64) -> u64 {
    now_ms / spec.unit.millis()
}

/// Whether a window's key is still alive in Redis (and so worth replaying).
pub fn window_live(spec: &LimitSpec, window: u64, now_ms: u64, margin_ms: u64) -> bool {
    let unit = spec.unit.millis();
    let mut end = (window + 1) * unit + margin_ms;
    if spec.algorithm == Algorithm::SlidingWindow {
        end += unit;
    }
    // A demand window is kept until its block ends, whatever the margin
    // (decide.lua), and read until then: what was granted in it off Redis
    // is replayed as long as it is read.
    let block = spec.demand_block();
    if block > 1 && (window + 1) % block == 0 {
        end = end.max((window + 1 + block) * unit);
    }
    end > now_ms
}

/// Whether outage usage of this algorithm is replayed.
fn replayable(spec: &LimitSpec) -> bool {
    spec.algorithm != Algorithm::SlidingLog
}

/// One shard of the ledger. ahash rather than std's SipHash: every Redis
/// decision looks its keys up here several times (measured: the lookups'
/// hashing was about 2% of a replica's CPU on a spread of keys).
type Shard = HashMap<CounterKey, Entry, ahash::RandomState>;

pub struct Ledger {
    shards: Vec<Mutex<Shard>>,
    /// Picks a key's shard; seeded apart from the shards' own maps, whose
    /// buckets would otherwise all share the bits that chose the shard.
    shard_hasher: ahash::RandomState,
    max_keys: usize,
    max_bytes: usize,
    len: AtomicUsize,
    bytes: AtomicUsize,
    /// Clean entries evicted to make room.
    pub evicted: AtomicU64,
    /// Local time of the first entry: before it, this process counted
    /// nothing (a previous run of the replica may have).
    first_seen_ms: AtomicU64,
    /// Local time of the latest entry evicted or not tracked: some key's
    /// confirmed counts from before it may be missing.
    last_lost_ms: AtomicU64,
    last_full_log_ms: AtomicU64,
    /// Unreplayed usage dropped because the ledger was full.
    pub dropped_usage: AtomicU64,
    /// Redis-path charges on keys the full ledger could not track.
    pub untracked: AtomicU64,
    /// Bumped after each change that can make an entry need replay (a
    /// local grant or take-back, a hold, a suspect or unsure mark, a
    /// restore) or change what the journal holds (a replay confirmed). A
    /// healthy replica scans for replay ([`Self::take_dirty`]) and
    /// rewrites its journal ([`Self::changes`]) only when it moved.
    changes: AtomicU64,
    /// `changes` as of the last replay scan.
    scanned: AtomicU64,
    /// Some window may hold a non-zero hold ([`Self::release_holds`]).
    holding: AtomicBool,
}

impl Ledger {
    pub fn new(max_keys: usize) -> Self {
        Self::with_max_bytes(max_keys, usize::MAX)
    }

    /// At most `max_keys` keys and about `max_bytes` bytes.
    pub fn with_max_bytes(max_keys: usize, max_bytes: usize) -> Self {
        Ledger {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::with_hasher(ahash::RandomState::new())))
                .collect(),
            shard_hasher: ahash::RandomState::new(),
            max_keys: max_keys.max(1),
            max_bytes: max_bytes.max(1),
            len: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            evicted: AtomicU64::new(0),
            first_seen_ms: AtomicU64::new(0),
            last_lost_ms: AtomicU64::new(0),
            last_full_log_ms: AtomicU64::new(0),
            dropped_usage: AtomicU64::new(0),
            untracked: AtomicU64::new(0),
            changes: AtomicU64::new(1),
            scanned: AtomicU64::new(0),
            holding: AtomicBool::new(false),
        }
    }

    /// Notes that an entry may need replay. Called after the change, so a
    /// scan that started before it either saw it or leaves the flag set.
    fn mark_dirty(&self) {
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether anything was marked since the last call. Taken before a
    /// replay scan: what changes during the scan marks it again, for the
    /// next.
    pub fn take_dirty(&self) -> bool {
        let now = self.changes.load(Ordering::Acquire);
        self.scanned.swap(now, Ordering::AcqRel) != now
    }

    /// The change count ([`Self::changes`] moves with every mark): read
    /// before a journal snapshot, the journal need not be taken again
    /// until it moves.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Asks for a replay scan at the next round whatever was marked: after
    /// a scan that left work (a plan, a key waiting to be repaired), and
    /// once a second as a backstop.
    pub fn rescan(&self) {
        self.mark_dirty();
    }

    /// The number of shards: the ledger's scans go a shard at a time
    /// (`*_shard`), so that one on a runtime thread can yield between
    /// shards instead of holding that thread for the whole ledger (200,000
    /// keys took about 15 ms, every connection and Redis call of the
    /// thread waiting behind it).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn shard(&self, key: &CounterKey) -> &Mutex<Shard> {
        let h = self.shard_hasher.hash_one(key);
        &self.shards[(h as usize) % SHARDS]
    }

    /// Runs `f` on the entry for `key`, creating it if there is room. When
    /// the ledger is full, evicts the least recently used clean entry of a
    /// sample of the same shard; `None` when the sample has none.
    fn with_entry<R>(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        now_ms: u64,
        f: impl FnOnce(&mut Entry) -> R,
    ) -> Option<R> {
        // A load first: this runs on every call, the store only once.
        if self.first_seen_ms.load(Ordering::Relaxed) == 0 {
            let _ = self.first_seen_ms.compare_exchange(
                0,
                now_ms.max(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        let mut map = self.shard(key).lock();
        // One lookup for a key already tracked (every call after its first).
        if let Some(entry) = map.get_mut(key) {
            entry.touched_ms = now_ms;
            entry.spec = *spec;
            return Some(f(entry));
        }
        let cost = entry_cost(key);
        let full = || {
            self.len.load(Ordering::Relaxed) >= self.max_keys
                || self.bytes.load(Ordering::Relaxed).saturating_add(cost) > self.max_bytes
        };
        // A victim may be smaller than the newcomer: evict until it fits.
        while full() {
            let victim = map
                .iter()
                .take(EVICTION_SAMPLE)
                .filter(|(_, e)| !e.needs_replay() && e.calls_in_flight == 0)
                .min_by_key(|(_, e)| e.touched_ms)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    map.remove(&k);
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    self.bytes.fetch_sub(entry_cost(&k), Ordering::Relaxed);
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                    self.last_lost_ms.fetch_max(now_ms, Ordering::Relaxed);
                }
                None => {
                    self.last_lost_ms.fetch_max(now_ms, Ordering::Relaxed);
                    return None;
                }
            }
        }
        self.len.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(cost, Ordering::Relaxed);
        let entry = map
            .entry(key.clone())
            .or_insert_with(|| Entry::new(*spec, now_ms));
        Some(f(entry))
    }

    /// Estimated bytes of the tracked entries.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// One line at most every [`FULL_LOG_EVERY_MS`], with totals and no
    /// key (keys hold client values).
    fn report_full(&self, now_ms: u64) {
        let last = self.last_full_log_ms.load(Ordering::Relaxed);
        if now_ms < last.saturating_add(FULL_LOG_EVERY_MS)
            || self
                .last_full_log_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        tracing::error!(
            keys = self.len(),
            bytes = self.bytes(),
            dropped_usage = self.dropped_usage.load(Ordering::Relaxed),
            untracked = self.untracked.load(Ordering::Relaxed),
            "ledger full: usage of new keys cannot be kept for replay (see dropped_usage; raise ledger_max_keys or ledger_max_bytes)"
        );
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A Redis reply for one charge.
    pub fn record_redis(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        redis_now_ms: u64,
        now_ms: u64,
        item: &RawItem,
    ) {
        let window = window_of(spec, redis_now_ms);
        self.with_entry(key, spec, now_ms, |e| {
            let w = e.window_mut(window);
            w.redis_own = w.redis_own.saturating_add(item.delta);
            // A late reply must not replace a newer remainder with the
            // older one it carries (a lease from it would hand out what
            // was granted since).
            if e.last_remaining.is_none_or(|(_, _, at)| redis_now_ms >= at) {
                e.last_remaining = Some((window, item.remaining, redis_now_ms));
            }
            if window >= e.reply_window {
                e.reply_window = window;
                let read = spec.demand_window(window);
                if item.own >= 0 && item.total > 0 {
                    let d = (item.own.min(item.total) as f64) / (item.total as f64);
                    e.demand = Some((Some(d), read));
                } else if item.own == DEMAND_TROUBLED
                    || (item.own != DEMAND_NOT_READ && e.demand.is_none_or(|(_, w)| w != read))
                {
                    // Read, and no share in it: reading it again in this
                    // window (or block) would find none either (a complete
                    // window only gains the marks of decisions off Redis,
                    // or expires), so later calls skip the read. Before,
                    // every call on a key idle in the previous window read
                    // it again. Troubled voids a share read before: a
                    // replay's marks landed since (or, in a demand block,
                    // the current window has them, see decide.lua), and the
                    // replicas that read the window now find none.
                    e.demand = Some((None, read));
                }
            }
        });
    }

    /// A Redis call for `key`, sent at Redis time `sent_redis_ms` or later,
    /// failed in a way that may still apply: decide it locally until a
    /// repair rewrites its field in every window the call can have landed in.
    pub fn mark_suspect(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        now_ms: u64,
        sent_redis_ms: u64,
    ) {
        if !replayable(spec) {
            return;
        }
        self.with_entry(key, spec, now_ms, |e| {
            e.suspect = true;
            e.version += 1;
            e.unsure_from_ms = Some(
                e.unsure_from_ms
                    .map_or(sent_redis_ms, |u| u.min(sent_redis_ms)),
            );
        });
        self.mark_dirty();
    }

    /// A local (lease) grant for one charge in `window`.
    pub fn record_local(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        window: u64,
        now_ms: u64,
        delta: i64,
    ) {
        if delta == 0 || !replayable(spec) {
            return;
        }
        let tracked = self.with_entry(key, spec, now_ms, |e| {
            let w = e.window_mut(window);
            w.local_own = w.local_own.saturating_add(delta);
        });
        self.mark_dirty();
        if tracked.is_none() {
            self.dropped_usage
                .fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
            self.report_full(now_ms);
        }
    }

    /// Redis lost data: every live window is re-asserted, both fields.
    pub fn reassert_all(&self) {
        for shard in &self.shards {
            for e in shard.lock().values_mut() {
                if replayable(&e.spec) && !e.windows.is_empty() {
                    e.suspect = true;
                    e.version += 1;
                    for w in &mut e.windows {
                        w.local_replayed = 0;
                        w.hold_written = 0;
                    }
                }
            }
        }
        self.mark_dirty();
    }
}

#[cfg(test)]
mod tests;
