//! The Lua scripts and their contracts, one section per script: the KEYS
//! and ARGV each takes (packed here, and only here) and the reply each
//! gives (decoded here into domain values). The scripts' own headers say
//! the same from the Lua side; the two are kept side by side on purpose.

use crate::domain::backend::{Presume, RawItem, RawReply, ReplayEntry, ReplayKind};
use crate::domain::Batch;
use crate::limit::{Algorithm, Role};

use fred::types::Value;

use super::keys;

/// The decision script (`decide.lua`).
pub const DECIDE_LUA: &str = include_str!("decide.lua");
/// The membership script (`members.lua`).
pub const MEMBERS_LUA: &str = include_str!("members.lua");
/// The replay script (`replay.lua`).
pub const REPLAY_LUA: &str = include_str!("replay.lua");

/// SHA1 of the decision script, as Redis knows it (SCRIPT EXISTS).
pub fn decide_sha() -> String {
    fred::util::sha1_hash(DECIDE_LUA)
}

/// SHA1 of the replay script.
pub fn replay_sha() -> String {
    fred::util::sha1_hash(REPLAY_LUA)
}

/// Hits above this are clamped before they reach Lua (whose numbers are
/// doubles and whose integer formatting stops at 10^14): such a charge is
/// over any u32 limit anyway.
pub use crate::domain::MAX_HITS;

/// Replay entries per script call (one call holds one hash slot's keys).
pub const REPLAY_BATCH: usize = 200;

fn algorithm_code(a: Algorithm) -> u8 {
    match a {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindow => 2,
        Algorithm::SlidingLog => 3,
        Algorithm::TokenBucket => 4,
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Enforce => 0,
        Role::Shadow => 1,
        Role::Quota => 2,
    }
}

/// What one decision call carries besides the batch.
#[derive(Clone, Copy, Debug)]
pub struct DecideCall<'a> {
    /// This replica's field index.
    pub index: u64,
    pub epoch: u64,
    pub margin_ms: u64,
    /// `<boot>.<n>`: unique per call and incarnation (sliding-log ids).
    pub call_id: &'a str,
    /// (count, window) this replica expects per charge; -1 unknown.
    pub expected: &'a [(i64, u64)],
    /// Whose unseen lease grants to count as used.
    pub presume: &'a Presume,
    /// This incarnation's boot id: with the episode number, a token unique
    /// per failure episode across restarts.
    pub boot: &'a str,
    /// On a Redis Cluster, Redis's time as this replica reckons it: the
    /// window keys each charge touches are then declared too (see
    /// [`declared_windows`]).
    pub windows_at: Option<u64>,
    /// A take-back: each fixed or sliding window charge is decided in the
    /// window of its `expected` pair, not the current one.
    pub pinned: bool,
}

/// The window keys a charge reads or writes at Redis time `now_ms`, for a
/// call to declare beside its base keys. The script derives them itself;
/// a Redis Cluster checks declared keys only, and while a slot migrates
/// it must see them to send a call where its keys are (ASK), or to ask
/// for a retry (TRYAGAIN) rather than let the script read a window that
/// has already moved. Near a window boundary the reckoning may be one
/// window off; only a migration of that very slot in those milliseconds
/// could then read a moved window.
fn declared_windows(
    base: &str,
    charge: &crate::domain::Charge,
    demand_known: bool,
    now_ms: u64,
    out: &mut Vec<String>,
) {
    let unit = charge.spec.unit.millis().max(1);
    let w = now_ms / unit;
    let at = |w: u64| format!("{base}@{w}");
    match charge.spec.algorithm {
        Algorithm::SlidingLog => {}
        Algorithm::FixedWindow if demand_known => out.push(at(w)),
        _ => {
            out.push(at(w));
            out.push(at(w.saturating_sub(1)));
        }
    }
}

/// Comma-separated indices; empty (the usual case) without allocating.
fn index_list(indices: &[u64]) -> Value {
    if indices.is_empty() {
        return Value::from("");
    }
    let list: Vec<String> = indices.iter().map(u64::to_string).collect();
    Value::from(list.join(","))
}

/// decide.lua: KEYS[i] the base key of charge i, then on a Cluster the
/// window keys of every charge ([`declared_windows`]); ARGV 1-5: index, epoch,
/// never_deny, margin, call id; 6-8: failure-episode token ("" none),
/// presumed peers and silent members (comma-separated indices); then 11 per
/// charge: algorithm, limit, unit_ms, burst, hits (clamped to
/// [`MAX_HITS`]), flags (bit 0 refund, bits 1-2 role, bit 3 demand of the
/// previous window known, bit 4 take-back in the expected window), expected count,
/// expected window, presumed fraction per member, may-prove flag, own
/// local count not replayed yet. The Redis module appends the call's token
/// (see its docs) and strips it from the reply.
pub fn decide_args(prefix: &str, batch: &Batch, call: &DecideCall) -> (Vec<String>, Vec<Value>) {
    let mut keys: Vec<String> = batch
        .charges
        .iter()
        .map(|c| keys::counter_base(prefix, &c.key))
        .collect();
    if let Some(now_ms) = call.windows_at {
        for (i, c) in batch.charges.iter().enumerate() {
            let demand_known = call.presume.charges.get(i).is_some_and(|p| p.demand_known);
            let at = match call.expected.get(i) {
                Some(&(_, w)) if call.pinned => w * c.spec.unit.millis(),
                _ => now_ms,
            };
            let base = keys[i].clone();
            declared_windows(&base, c, demand_known, at, &mut keys);
        }
    }
    // Numbers go as integers: fred writes them straight into the request,
    // with no string allocated per argument (11 per charge), and Lua reads
    // every argument as a string either way.
    let int = |n: u64| Value::Integer(i64::try_from(n).unwrap_or(i64::MAX));
    let mut args = Vec::with_capacity(8 + 11 * batch.charges.len());
    args.push(int(call.index));
    args.push(int(call.epoch));
    args.push(int(u64::from(batch.never_deny)));
    args.push(int(call.margin_ms));
    args.push(Value::from(call.call_id));
    let p = call.presume;
    args.push(match p.episode {
        Some(n) if !p.peers.is_empty() => Value::from(format!("{}.{n}", call.boot)),
        _ => Value::from(""),
    });
    args.push(index_list(&p.peers));
    args.push(index_list(&p.silent));
    for (i, c) in batch.charges.iter().enumerate() {
        args.push(int(u64::from(algorithm_code(c.spec.algorithm))));
        args.push(int(u64::from(c.spec.requests_per_unit)));
        args.push(int(c.spec.unit.millis()));
        args.push(int(u64::from(c.spec.burst)));
        args.push(int(c.hits.min(MAX_HITS)));
        let pc = p.charges.get(i).copied().unwrap_or_default();
        let flags = u8::from(c.refund)
            + 2 * role_code(c.role)
            + 8 * u8::from(pc.demand_known)
            + 16 * u8::from(call.pinned);
        args.push(int(u64::from(flags)));
        let (count, window) = call.expected.get(i).copied().unwrap_or((-1, 0));
        args.push(Value::Integer(count));
        args.push(int(window));
        args.push(if pc.fraction > 0.0 {
            Value::from(format!("{:.6}", pc.fraction))
        } else {
            Value::Integer(0)
        });
        args.push(int(u64::from(pc.prove)));
        args.push(Value::Integer(pc.pending));
    }
    (keys, args)
}

/// A decision reply as the script sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecideReply {
    /// Applied or denied.
    Decided(RawReply),
    /// Status -1: this replica's epoch is below a fence on one of the keys;
    /// nothing was read or written.
    Fenced,
}

/// decide.lua's reply: `{status, now_ms, denied, lost}` then 6 per charge:
/// over, remaining, reset_ms, own, total, delta.
pub fn decode_decide(reply: &[i64], charges: usize) -> Result<DecideReply, String> {
    if reply.first() == Some(&-1) {
        return Ok(DecideReply::Fenced);
    }
    if reply.len() != 4 + 6 * charges {
        return Err(format!(
            "script reply has {} items, expected {}",
            reply.len(),
            4 + 6 * charges
        ));
    }
    let items = reply[4..]
        .chunks_exact(6)
        .map(|r| RawItem {
            over: r[0] == 1,
            remaining: r[1].max(0) as u64,
            reset_ms: r[2].max(0) as u64,
            own: r[3],
            total: r[4],
            delta: r[5],
            at_ms: 0,
        })
        .collect();
    Ok(DecideReply::Decided(RawReply {
        now_ms: reply[1].max(0) as u64,
        denied: reply[2] == 1,
        lost: reply[3] == 1,
        items,
    }))
}

/// replay.lua: KEYS[i] the base key of entry i (one hash slot per call),
/// then on a Cluster each entry's window key;
/// ARGV 1-3: index, epoch, margin; then 7 per entry: kind (1 local, 2
/// repair), algorithm, unit_ms, window, value, limit, burst. Reply:
/// `{entries written, now_ms, highest guard that fenced an entry out,
/// repairs that raised a field Redis had lost}`.
pub fn replay_args(
    prefix: &str,
    index: u64,
    epoch: u64,
    margin_ms: u64,
    boot: &str,
    entries: &[&ReplayEntry],
    cluster: bool,
) -> (Vec<String>, Vec<String>) {
    let mut keys: Vec<String> = entries
        .iter()
        .map(|e| keys::counter_base(prefix, &e.key))
        .collect();
    if cluster {
        // The windows written, declared for a migrating slot (see
        // `declared_windows`).
        for (i, e) in entries.iter().enumerate() {
            let window = format!("{}@{}", keys[i], e.window);
            keys.push(window);
        }
    }
    let mut args = Vec::with_capacity(4 + 7 * entries.len());
    args.push(index.to_string());
    args.push(epoch.to_string());
    args.push(margin_ms.to_string());
    args.push(boot.to_string());
    for e in entries {
        let kind = match e.kind {
            ReplayKind::Local => "1",
            ReplayKind::Repair => "2",
            ReplayKind::Hold => "3",
        };
        args.push(kind.to_string());
        args.push(algorithm_code(e.spec.algorithm).to_string());
        args.push(e.spec.unit.millis().to_string());
        args.push(e.window.to_string());
        args.push(e.value.to_string());
        args.push(e.spec.requests_per_unit.to_string());
        args.push(e.spec.burst.to_string());
    }
    (keys, args)
}

/// members.lua: KEYS are [`keys::membership`]; ARGV: id, nonce, TTL ms,
/// "beat" (deciding on Redis), "away" (live, deciding off Redis), "held"
/// (away, kept off Redis by an older layout) or "leave", the index used
/// before (0 none), hold-back horizon ms, the layout announced. Reply:
/// `{1, index, now_ms, incarnation, {live ids}, {their indices}, {silent
/// indices}, {known indices}, {live members' layouts}}`, or `{0, other
/// nonce}` when another live incarnation owns the id.
pub fn members_args(
    id: &str,
    nonce: &str,
    ttl_ms: u128,
    action: &str,
    index: u64,
    holdback_ms: u128,
    layout: u32,
) -> Vec<String> {
    vec![
        id.to_owned(),
        nonce.to_owned(),
        ttl_ms.to_string(),
        action.to_owned(),
        index.to_string(),
        holdback_ms.to_string(),
        layout.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decide_replies_decode_or_say_why_not() {
        let reply = [1, 5_000, 0, 1, 0, 7, 900, 3, 10, 1];
        let Ok(DecideReply::Decided(r)) = decode_decide(&reply, 1) else {
            panic!("decodes");
        };
        assert_eq!((r.now_ms, r.denied, r.lost), (5_000, false, true));
        assert_eq!(
            r.items,
            [RawItem {
                over: false,
                remaining: 7,
                reset_ms: 900,
                own: 3,
                total: 10,
                delta: 1,
                at_ms: 0
            }]
        );
        assert_eq!(decode_decide(&[-1], 3), Ok(DecideReply::Fenced));
        assert!(decode_decide(&reply, 2).is_err());
    }
}
