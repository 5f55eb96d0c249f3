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
    /// `<boot>.<n>`: unique per call and incarnation (sliding-log ids);
    /// "" when the batch has no sliding-log charge.
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
/// window off (and the demand window a block off, near a block's);
/// only a migration of that very slot in those milliseconds could then
/// read a moved window.
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
        Algorithm::FixedWindow => {
            out.push(at(w));
            out.push(at(charge.spec.demand_window(w)));
        }
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

/// One decision call's arguments, as decide.lua takes them.
#[derive(Clone, Debug, PartialEq)]
pub struct DecideArgs {
    /// The base key of each charge, then on a Cluster the window keys of
    /// every charge ([`declared_windows`]).
    pub keys: Vec<String>,
    /// What the requests of one script call share, sent once per call:
    /// index, epoch, margin, failure-episode token ("" none), presumed
    /// peers and silent members (comma-separated indices). Only requests
    /// with equal headers are batched together.
    pub header: [Value; 6],
    /// The request itself: its shape (`<keys>,<charges>,<flags>`, flags
    /// bit 0 never deny, bit 1 a call id follows), its call id only when
    /// it has a sliding-log charge (one argument less for every other
    /// request: each costs Redis an object and a Lua string), then two per
    /// charge: `<algorithm>,<limit>,<unit_ms>,
    /// <burst>,<hits>,<flags>,<expected window>,<fraction>,<pending>` and
    /// the expected count. hits are clamped to [`MAX_HITS`]; flags: bit 0
    /// refund, bits 1-2 role, bit 3 demand of the demand window known,
    /// bit 4 take-back in the expected window, bit 5 may prove itself.
    /// The requests of a batch mostly repeat these strings, so Redis
    /// parses each distinct one once per call; the expected count changes
    /// with every request and goes on its own, as an integer.
    pub body: Vec<Value>,
    /// No sliding-log charge (and so no call id): requests equal to this
    /// one in keys and body (bar the expected counts) may go as one group (see the shape in
    /// decide.lua). A sliding-log charge takes its members' ids from the
    /// call id, so identical requests must keep theirs.
    pub repeatable: bool,
    /// How the script answers each charge: its reply has no length, and is
    /// read by these ([`super::batch`]).
    pub answers: Vec<Answer>,
}

/// How decide.lua answers one charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// remaining, reset, own, total only when own is 0 or more, delta.
    Full,
    /// A fixed window whose demand window's demand the caller holds
    /// (flag bit 3), not a take-back: remaining and delta only. Its reset
    /// is the time to the end of the current window, of `unit_ms`, on
    /// Redis's time, and no demand was read
    /// ([`DEMAND_NOT_READ`](crate::domain::backend::DEMAND_NOT_READ)).
    /// When it is a request's only charge and was admitted as asked
    /// (status 0, delta `hits`) with `remaining` 0 or more, the script
    /// sends its remaining alone; otherwise `-2 - status`, remaining and
    /// delta (or -1, stale). When its current window carries some
    /// replica's decisions off Redis and it is in a demand block (see
    /// [`LimitSpec::demand_window`](crate::limit::LimitSpec::demand_window)),
    /// the demand share the caller holds is void: the request's status
    /// gets 4 and every charge of it is answered in full, this one with
    /// own -1 ([`DEMAND_TROUBLED`](crate::domain::backend::DEMAND_TROUBLED)).
    Short { unit_ms: u64, hits: i64 },
}

/// decide.lua's arguments for one request ([`DecideArgs`]). The batch
/// module adds the request count and the Redis module the call's token
/// (see its docs), and strips the token from the reply.
pub fn decide_args(prefix: &str, batch: &Batch, call: &DecideCall) -> DecideArgs {
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
    let int = |n: u64| Value::Integer(i64::try_from(n).unwrap_or(i64::MAX));
    let p = call.presume;
    let header = [
        int(call.index),
        int(call.epoch),
        int(call.margin_ms),
        match p.episode {
            Some(n) if !p.peers.is_empty() => Value::from(format!("{}.{n}", call.boot)),
            _ => Value::from(""),
        },
        index_list(&p.peers),
        index_list(&p.silent),
    ];
    // Only a sliding-log charge needs the call id (its members' ids), and
    // only then may equal requests not go as one group.
    let repeatable = batch
        .charges
        .iter()
        .all(|c| c.spec.algorithm != Algorithm::SlidingLog);
    let mut body = Vec::with_capacity(2 + 2 * batch.charges.len());
    // Numbers written with itoa: `format!` and `write!` here were about 2%
    // of a replica's CPU on the Redis path (measured with perf).
    let mut ints = itoa::Buffer::new();
    let mut shape = String::with_capacity(16);
    shape.push_str(ints.format(keys.len()));
    shape.push(',');
    shape.push_str(ints.format(batch.charges.len()));
    shape.push(',');
    shape.push(match (batch.never_deny, repeatable) {
        (false, true) => '0',
        (true, true) => '1',
        (false, false) => '2',
        (true, false) => '3',
    });
    body.push(Value::from(shape));
    if !repeatable {
        body.push(Value::from(call.call_id));
    }
    let mut answers = Vec::with_capacity(batch.charges.len());
    for (i, c) in batch.charges.iter().enumerate() {
        let pc = p.charges.get(i).copied().unwrap_or_default();
        answers.push(
            if c.spec.algorithm == Algorithm::FixedWindow && pc.demand_known && !call.pinned {
                Answer::Short {
                    unit_ms: c.spec.unit.millis(),
                    hits: i64::try_from(c.hits.min(MAX_HITS)).unwrap_or(i64::MAX),
                }
            } else {
                Answer::Full
            },
        );
        let flags = u8::from(c.refund)
            + 2 * role_code(c.role)
            + 8 * u8::from(pc.demand_known)
            + 16 * u8::from(call.pinned)
            + 32 * u8::from(pc.prove);
        let (count, window) = call.expected.get(i).copied().unwrap_or((-1, 0));
        let mut charge = String::with_capacity(64);
        for n in [
            u64::from(algorithm_code(c.spec.algorithm)),
            u64::from(c.spec.requests_per_unit),
            c.spec.unit.millis(),
            u64::from(c.spec.burst),
            c.hits.min(MAX_HITS),
            u64::from(flags),
        ] {
            charge.push_str(ints.format(n));
            charge.push(',');
        }
        charge.push_str(ints.format(window));
        charge.push(',');
        if pc.fraction > 0.0 {
            use std::fmt::Write as _;
            // Writing to a String cannot fail.
            let _ = write!(charge, "{:.6}", pc.fraction);
        } else {
            charge.push('0');
        }
        charge.push(',');
        charge.push_str(ints.format(pc.pending));
        body.push(Value::from(charge));
        body.push(Value::Integer(count));
    }
    DecideArgs {
        keys,
        header,
        body,
        repeatable,
        answers,
    }
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

/// One request's part of decide.lua's reply, with the call's Redis time put
/// after its status: `{status, now_ms}`, then 5 per charge: remaining (-1
/// over), reset_ms, own, total, delta. Status -1 fenced, otherwise denied
/// (1) + 2 × lost.
pub fn decode_decide(reply: &[i64], charges: usize) -> Result<DecideReply, String> {
    if reply.first() == Some(&-1) {
        return Ok(DecideReply::Fenced);
    }
    if reply.len() != 2 + 5 * charges {
        return Err(format!(
            "script reply has {} items, expected {}",
            reply.len(),
            2 + 5 * charges
        ));
    }
    let status = reply[0];
    if !(0..=3).contains(&status) {
        return Err(format!("script reply has status {status}"));
    }
    let items = reply[2..]
        .chunks_exact(5)
        .map(|r| RawItem {
            over: r[0] < 0,
            remaining: r[0].max(0) as u64,
            reset_ms: r[1].max(0) as u64,
            own: r[2],
            total: r[3],
            delta: r[4],
            at_ms: 0,
        })
        .collect();
    Ok(DecideReply::Decided(RawReply {
        now_ms: reply[1].max(0) as u64,
        denied: status & 1 == 1,
        lost: status & 2 == 2,
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

    /// The request's argument strings, pinned: replicas of the previous
    /// version run the same script beside this one during a rolling
    /// upgrade, so how numbers are written must not change them.
    #[test]
    fn decide_arguments_keep_their_format() {
        use crate::domain::backend::PresumedCharge;
        use crate::domain::{Batch, Charge};
        use crate::key::CounterKey;
        use crate::limit::{LimitSpec, Role, Unit};
        let charge = |hits, refund, role, spec| Charge {
            key: CounterKey::from_raw("d|k=v"),
            spec,
            hits,
            refund,
            role,
        };
        let bucket = LimitSpec {
            requests_per_unit: 7,
            unit: Unit::Minute,
            algorithm: Algorithm::TokenBucket,
            burst: 9,
        };
        let batch = Batch {
            charges: vec![
                charge(3, false, Role::Enforce, LimitSpec::fixed(100, Unit::Second)),
                charge(u64::MAX, true, Role::Quota, bucket),
            ],
            never_deny: true,
        };
        let presume = Presume {
            episode: None,
            peers: vec![],
            silent: vec![],
            charges: vec![
                PresumedCharge {
                    fraction: 0.25,
                    prove: true,
                    pending: 12,
                    demand_known: true,
                },
                PresumedCharge::default(),
            ],
        };
        let call = DecideCall {
            index: 2,
            epoch: 5,
            margin_ms: 1_000,
            call_id: "b.9",
            expected: &[(4, 17), (-1, 0)],
            presume: &presume,
            boot: "b",
            windows_at: None,
            pinned: false,
        };
        let args = decide_args("p:", &batch, &call);
        let text = |v: &Value| v.as_string().unwrap_or_default();
        let body: Vec<String> = args.body.iter().map(text).collect();
        let max = MAX_HITS.to_string();
        assert_eq!(
            body,
            [
                "2,2,1".to_owned(),
                "1,100,1000,100,3,40,17,0.250000,12".to_owned(),
                "4".to_owned(),
                format!("4,7,60000,9,{max},5,0,0,0"),
                "-1".to_owned(),
            ],
            "no call id without a sliding-log charge"
        );
        assert_eq!(args.keys.len(), 2);
        assert!(args.repeatable);
        // A sliding-log charge takes its members' ids from the call id:
        // the shape says one follows.
        let log = Batch {
            charges: vec![charge(
                1,
                false,
                Role::Enforce,
                LimitSpec {
                    algorithm: Algorithm::SlidingLog,
                    ..LimitSpec::fixed(10, Unit::Second)
                },
            )],
            never_deny: false,
        };
        let call = DecideCall {
            expected: &[(-1, 0)],
            ..call
        };
        let args = decide_args("p:", &log, &call);
        let body: Vec<String> = args.body.iter().map(text).collect();
        assert_eq!(body[..2], ["1,1,2".to_owned(), "b.9".to_owned()]);
        assert!(!args.repeatable);
    }

    #[test]
    fn decide_replies_decode_or_say_why_not() {
        let reply = [2, 5_000, 7, 900, 3, 10, 1];
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
        let Ok(DecideReply::Decided(over)) = decode_decide(&[1, 5_000, -1, 900, 3, 10, 0], 1)
        else {
            panic!("decodes");
        };
        assert!(over.denied && !over.lost && over.items[0].over && over.items[0].remaining == 0);
        assert_eq!(decode_decide(&[-1, 5_000], 3), Ok(DecideReply::Fenced));
        assert!(decode_decide(&reply, 2).is_err());
        assert!(decode_decide(&[4, 5_000], 0).is_err(), "no such status");
    }
}
