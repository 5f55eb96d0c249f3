//! decide.lua on a real redis-server, called directly: a group of equal
//! requests (one entry whose shape says how many it stands for) answers
//! exactly as the same requests sent as separate entries, and a request
//! (or a group of them) on a window whose hash holds only counts (decided
//! the short way) answers exactly as the general path does; each leaves
//! the same counts behind. Both forms go in one script call, on two copies
//! of the same keys, so they see the same Redis time and the same state.
//! One form's requests carry a call id and the other's do not (a
//! request's shape says which), so both layouts are read alike.

use crate::common::{test_dir, RedisServer};
use leasehold::redis::scripts::{DECIDE_LUA, REPLAY_LUA};

/// A small deterministic generator (xorshift), so a failure can be rerun.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const HOUR_MS: u64 = 3_600_000;

/// One charge of a scenario's request.
struct Charge {
    algorithm: u64,
    limit: u64,
    hits: u64,
    flags: u64,
    fraction: &'static str,
    pending: u64,
    /// The count already in its window (and, for a sliding window, the one
    /// before).
    start: u64,
    previous: u64,
    expected: i64,
}

fn charge(rng: &mut Rng) -> Charge {
    let algorithm = [1, 1, 1, 2, 2, 4][rng.below(6) as usize];
    let limit = 1 + rng.below(12);
    let refund = u64::from(rng.below(6) == 0);
    let role = rng.below(3);
    let demand_known = rng.below(2);
    let prove = rng.below(2);
    Charge {
        algorithm,
        limit,
        hits: rng.below(4),
        flags: refund + 2 * role + 8 * demand_known + 32 * prove,
        fraction: if rng.below(5) == 0 { "0.25" } else { "0" },
        pending: if rng.below(4) == 0 { rng.below(3) } else { 0 },
        start: rng.below(limit + 2),
        previous: rng.below(limit + 2),
        // Sometimes above the count Redis holds: Redis lost data.
        expected: match rng.below(4) {
            0 => 20,
            1 => -1,
            _ => 0,
        },
    }
}

impl Charge {
    /// The charge's argument string, its unit an hour and its expected
    /// count's window `w`.
    fn text(&self, w: u64) -> String {
        format!(
            "{},{},{HOUR_MS},{},{},{},{w},{},{}",
            self.algorithm,
            self.limit,
            self.limit,
            self.hits,
            self.flags,
            self.fraction,
            self.pending
        )
    }

    /// Writes the counts it starts from under `key`: a bucket's tokens,
    /// or replica 0's count in window `w` and the one before.
    fn seed(&self, redis: &RedisServer, key: &str, w: u64, now_ms: u64) {
        if self.algorithm == 4 {
            bucket(redis, key, self.start, now_ms);
        } else {
            redis.cli(&["HSET", &format!("{key}@{w}"), "0", &self.start.to_string()]);
            redis.cli(&[
                "HSET",
                &format!("{key}@{}", w - 1),
                "0",
                &self.previous.to_string(),
            ]);
        }
    }

    /// What a call changes under a key (a bucket's hash too).
    fn written(&self, w: u64) -> Vec<String> {
        if self.algorithm == 4 {
            vec![String::new(), format!("@{w}")]
        } else {
            vec![format!("@{w}")]
        }
    }
}

/// Redis's time, in ms.
fn redis_ms(redis: &RedisServer) -> u64 {
    let t = numbers(&redis.cli(&["TIME"]));
    (t[0] * 1000 + t[1] / 1000) as u64
}

/// A call's arguments before its requests: index 0, epoch 1, margin 1 s,
/// and, `troubled`, a failure episode of this replica with peers 1 and 2
/// presumed.
fn call_header(troubled: bool) -> Vec<String> {
    let tail = if troubled {
        ["e1", "1,2", ""]
    } else {
        ["", "", ""]
    };
    ["0", "1", "1000"]
        .iter()
        .chain(&tail)
        .map(|s| (*s).to_owned())
        .collect()
}

fn numbers(text: &str) -> Vec<i64> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// Its hits when the script answers a charge short (remaining and delta
/// only): a fixed window whose previous window's demand the caller holds
/// (flag 8), not a take-back (flag 16).
fn short(c: &Charge) -> Option<u64> {
    (c.algorithm == 1 && c.flags & 8 != 0 && c.flags & 16 == 0).then_some(c.hits)
}

/// Each request's reply (`status, items...`) after splitting a flat
/// script reply, `requests[i]` telling for request i's charges whether
/// each is short (its hits): per charge remaining, reset, own, total only
/// when own is 0 or more, and delta, or remaining and delta when short;
/// none when stale (-1). A request of one short charge may be answered by
/// its remaining alone (admitted as asked), or by `-2 - status`, remaining
/// and delta: both are read back to `status, remaining, delta` here; with
/// status + 4 (void), by `-2 - status` then the full form, read back to
/// `status, remaining, reset, own, [total,] delta` (the status with its 4). The call's time and
/// token are left out.
fn replies(flat: &[i64], requests: &[Vec<Option<u64>>]) -> Vec<Vec<i64>> {
    let mut out = Vec::new();
    let mut at = 0;
    for shorts in requests {
        let start = at;
        at += 1;
        if let [Some(hits)] = shorts.as_slice() {
            match flat[start] {
                -1 => out.push(vec![-1]),
                v if v >= 0 => out.push(vec![0, v, *hits as i64]),
                v if v >= -5 => {
                    out.push(vec![-2 - v, flat[at], flat[at + 1]]);
                    at += 2;
                }
                // Void (status + 4): the full form follows.
                v => {
                    let n = if flat[at + 2] >= 0 { 5 } else { 4 };
                    let mut reply = vec![-2 - v];
                    reply.extend_from_slice(&flat[at..at + n]);
                    out.push(reply);
                    at += n;
                }
            }
            continue;
        }
        // Void (status + 4): every charge in full.
        let void = flat[start] >= 4;
        if flat[start] != -1 {
            for s in shorts {
                if s.is_some() && !void {
                    at += 2;
                } else {
                    let own = flat[at + 2];
                    at += if own >= 0 { 5 } else { 4 };
                }
            }
        }
        out.push(flat[start..at].to_vec());
    }
    assert_eq!(at + 2, flat.len(), "time and token follow: {flat:?}");
    out
}

/// A hash as sorted field/value pairs (none when it does not exist; no
/// field or value here is empty).
fn hash(redis: &RedisServer, key: &str) -> Vec<String> {
    let lines: Vec<String> = redis
        .cli(&["HGETALL", key])
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    let mut pairs: Vec<String> = lines.chunks(2).map(|p| p.join("=")).collect();
    pairs.sort();
    pairs
}

/// A token bucket's hash holding `tokens`, updated at `now_ms`.
fn bucket(redis: &RedisServer, key: &str, tokens: u64, now_ms: u64) {
    redis.cli(&[
        "HSET",
        key,
        "t",
        &tokens.to_string(),
        "u",
        &now_ms.to_string(),
    ]);
}

/// Loads a script; its SHA.
fn load(redis: &RedisServer, script: &str) -> String {
    let sha = redis.cli(&["SCRIPT", "LOAD", script]).trim().to_owned();
    assert_eq!(sha.len(), 40, "script loads: {sha}");
    sha
}

/// One script call, as redis-cli prints its reply.
fn evalsha(redis: &RedisServer, sha: &str, keys: &[String], args: &[String]) -> String {
    let nkeys = keys.len().to_string();
    let mut call: Vec<&str> = vec!["EVALSHA", sha, &nkeys];
    call.extend(keys.iter().map(String::as_str));
    call.extend(args.iter().map(String::as_str));
    redis.cli(&call)
}

#[test]
fn a_group_of_equal_requests_answers_as_each_request_alone() {
    let dir = test_dir("script-groups");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let mut rng = Rng(0x5eed_1e45_e401_d000);
    let (mut fast, mut admitted_some, mut denied_some) = (0, 0, 0);
    for scenario in 0..160 {
        let now_ms = redis_ms(&redis);
        let w = now_ms / HOUR_MS;
        let charges: Vec<Charge> = (0..1 + rng.below(4) / 3)
            .map(|_| charge(&mut rng))
            .collect();
        let times = 2 + rng.below(6) as usize;
        let never_deny = u64::from(rng.below(8) == 0);
        // Presumed peers after a failure of this replica, sometimes.
        let troubled = rng.below(5) == 0;
        let base = |copy: &str, i: usize| format!("t{{{scenario}{copy}}}:{i}");
        for copy in ["g", "s"] {
            for (i, c) in charges.iter().enumerate() {
                c.seed(&redis, &base(copy, i), w, now_ms);
            }
        }
        // The shape's flags: bit 0 never deny, bit 1 a call id follows
        // (the requests alone carry one, the group none: both forms
        // must answer alike).
        let body = |id: Option<&str>, group: usize| {
            let flags = never_deny + 2 * u64::from(id.is_some());
            let mut shape = format!("{},{},{flags}", charges.len(), charges.len());
            if group > 1 {
                shape = format!("{shape},{group}");
            }
            let mut out = vec![shape];
            out.extend(id.map(str::to_owned));
            for c in &charges {
                out.push(c.text(w));
                out.push(c.expected.to_string());
            }
            out
        };
        let mut keys: Vec<String> = (0..charges.len()).map(|i| base("g", i)).collect();
        let mut args = call_header(troubled);
        args.push((1 + times).to_string());
        args.extend(body(None, times));
        for n in 0..times {
            keys.extend((0..charges.len()).map(|i| base("s", i)));
            args.extend(body(Some(&format!("s{n}")), 1));
        }
        args.push("77".to_owned());
        let out = evalsha(&redis, &sha, &keys, &args);
        let flat = numbers(&out);
        assert!(!flat.is_empty(), "scenario {scenario}: script error: {out}");
        let all = replies(&flat, &vec![charges.iter().map(short).collect(); 2 * times]);
        let (grouped, alone) = all.split_at(times);
        assert_eq!(
            grouped, alone,
            "scenario {scenario}: a group of {times} answers as its requests alone"
        );
        for (i, c) in charges.iter().enumerate() {
            for suffix in c.written(w) {
                assert_eq!(
                    hash(&redis, &format!("{}{suffix}", base("g", i))),
                    hash(&redis, &format!("{}{suffix}", base("s", i))),
                    "scenario {scenario}: charge {i} leaves the same counts"
                );
            }
        }
        let statuses: Vec<i64> = grouped.iter().map(|r| r[0]).collect();
        let c = &charges[0];
        if charges.len() == 1
            && c.algorithm != 4
            && c.flags % 2 == 0
            && c.fraction == "0"
            && statuses[0] < 2
        {
            fast += 1;
        }
        admitted_some += usize::from(statuses.contains(&0));
        denied_some += usize::from(statuses.contains(&1));
    }
    // The scenarios covered what they are for: groups decided the short
    // way, and groups both admitted and denied.
    assert!(
        fast >= 30 && admitted_some >= 30 && denied_some >= 30,
        "fast {fast}, admitted {admitted_some}, denied {denied_some}"
    );
}

#[test]
fn a_run_of_requests_under_one_rule_answers_as_each_request_alone() {
    let dir = test_dir("script-runs");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let mut rng = Rng(0x0a11_7e57_5eed_0042);
    let (mut plain, mut repeated, mut admitted_some, mut denied_some) = (0, 0, 0, 0);
    for scenario in 0..160 {
        let now_ms = redis_ms(&redis);
        let w = now_ms / HOUR_MS;
        let charges: Vec<Charge> = (0..1 + rng.below(4) / 3)
            .map(|_| charge(&mut rng))
            .collect();
        // The members' keys: mostly distinct, sometimes one an earlier
        // member had (its window then read already in the call).
        let run = 2 + rng.below(6) as usize;
        let names: Vec<u64> = (0..run).map(|_| rng.below(run as u64 + 2)).collect();
        let expected: Vec<Vec<i64>> = (0..run)
            .map(|_| {
                charges
                    .iter()
                    .map(|c| if rng.below(3) == 0 { -1 } else { c.expected })
                    .collect()
            })
            .collect();
        let never_deny = rng.below(8) == 0;
        let troubled = rng.below(5) == 0;
        let base = |copy: &str, name: u64, i: usize| format!("t{{{scenario}{copy}}}:{name}:{i}");
        for copy in ["r", "s"] {
            for name in &names {
                for (i, c) in charges.iter().enumerate() {
                    c.seed(&redis, &base(copy, *name, i), w, now_ms);
                }
            }
        }
        let n = charges.len();
        let flags = u64::from(never_deny);
        let mut keys: Vec<String> = Vec::new();
        let mut args = call_header(troubled);
        args.push((1 + run).to_string());
        // The run: its shape (flag 4, its members), the charge strings
        // once, each member's expected counts in turn.
        args.push(format!("{n},{n},{},{run}", flags + 4));
        args.extend(charges.iter().map(|c| c.text(w)));
        for (m, name) in names.iter().enumerate() {
            keys.extend((0..n).map(|i| base("r", *name, i)));
            args.extend(expected[m].iter().map(i64::to_string));
        }
        // The same requests, each on its own.
        for (m, name) in names.iter().enumerate() {
            keys.extend((0..n).map(|i| base("s", *name, i)));
            args.push(format!("{n},{n},{flags}"));
            for (c, e) in charges.iter().zip(&expected[m]) {
                args.push(c.text(w));
                args.push(e.to_string());
            }
        }
        args.push("79".to_owned());
        let out = evalsha(&redis, &sha, &keys, &args);
        let flat = numbers(&out);
        assert!(!flat.is_empty(), "scenario {scenario}: script error: {out}");
        let all = replies(&flat, &vec![charges.iter().map(short).collect(); 2 * run]);
        let (in_run, alone) = all.split_at(run);
        assert_eq!(
            in_run, alone,
            "scenario {scenario}: a run of {run} answers as its requests alone"
        );
        for name in &names {
            for (i, c) in charges.iter().enumerate() {
                for suffix in c.written(w) {
                    assert_eq!(
                        hash(&redis, &format!("{}{suffix}", base("r", *name, i))),
                        hash(&redis, &format!("{}{suffix}", base("s", *name, i))),
                        "scenario {scenario}: key {name} charge {i} holds the same counts"
                    );
                }
            }
        }
        let c = &charges[0];
        if n == 1 && c.algorithm != 4 && c.flags % 2 == 0 && c.fraction == "0" {
            plain += 1;
        }
        let mut seen = names.clone();
        seen.sort_unstable();
        seen.dedup();
        repeated += usize::from(seen.len() < names.len());
        let statuses: Vec<i64> = in_run.iter().map(|r| r[0]).collect();
        admitted_some += usize::from(statuses.contains(&0));
        denied_some += usize::from(statuses.contains(&1));
    }
    // The scenarios covered what they are for: runs the short path can
    // decide, runs that repeat a key, and runs both admitted and denied.
    assert!(
        plain >= 30 && repeated >= 30 && admitted_some >= 30 && denied_some >= 30,
        "plain {plain}, repeated {repeated}, admitted {admitted_some}, denied {denied_some}"
    );
}

/// PTTL of a key, in ms (-2 absent, -1 without expiry).
fn pttl(redis: &RedisServer, key: &str) -> i64 {
    numbers(&redis.cli(&["PTTL", key]))
        .first()
        .copied()
        .unwrap_or(-3)
}

#[test]
fn a_window_of_counts_only_answers_as_the_general_path_does() {
    let dir = test_dir("script-plain");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let mut rng = Rng(0x9a1e_5eed_0b57_ac1e);
    // Another replica's fence: the general path ignores it, the short path
    // takes a hash holding it to the general one.
    const ODD: &str = "f9";
    let (mut created, mut admitted, mut denied, mut stale, mut groups) = (0, 0, 0, 0, 0);
    for scenario in 0..80 {
        let now_ms = redis_ms(&redis);
        let w = now_ms / HOUR_MS;
        // A few bases per algorithm, so that requests of a call share
        // windows (a window read by an earlier request is decided the
        // general way) as well as not.
        let requests: Vec<Vec<(String, Charge)>> = (0..4 + rng.below(9))
            .map(|_| {
                (0..1 + rng.below(4) / 3)
                    .map(|i| {
                        let c = charge(&mut rng);
                        (format!("a{}k{}", c.algorithm, (rng.below(3) + i) % 3), c)
                    })
                    .collect()
            })
            .collect();
        // A third of the requests go as a group of equal ones (a hot key's
        // batch), which the short path decides whole too.
        let times: Vec<usize> = requests
            .iter()
            .map(|_| {
                if rng.below(3) == 0 {
                    2 + rng.below(4) as usize
                } else {
                    1
                }
            })
            .collect();
        let answers: usize = times.iter().sum();
        let never_deny = u64::from(rng.below(8) == 0);
        let troubled = rng.below(6) == 0;
        let base = |copy: &str, name: &str| format!("t{{{scenario}{copy}}}:{name}");
        let mut seeded = std::collections::BTreeSet::new();
        for (name, c) in requests.iter().flatten() {
            if !seeded.insert(name.clone()) {
                continue;
            }
            // This replica's fence above its epoch, sometimes: stale; at
            // its epoch or absent otherwise (a hash of this replica's
            // count alone takes the short path's shortest way).
            let fence = match rng.below(10) {
                0 => Some("2"),
                1..=4 => Some("0"),
                _ => None,
            };
            for copy in ["p", "q"] {
                let key = base(copy, name);
                if c.algorithm == 4 {
                    bucket(&redis, &key, c.start, now_ms);
                    continue;
                }
                for (window, count) in [(w, c.start), (w - 1, c.previous)] {
                    let mut fields: Vec<String> = Vec::new();
                    if count > 0 {
                        fields.extend(["0".to_owned(), count.to_string()]);
                        if let Some(fence) = fence {
                            fields.extend(["f0".to_owned(), fence.to_owned()]);
                        }
                    }
                    if copy == "q" {
                        fields.extend([ODD.to_owned(), "0".to_owned()]);
                    }
                    if !fields.is_empty() {
                        let key = format!("{key}@{window}");
                        let mut cmd = vec!["HSET", key.as_str()];
                        cmd.extend(fields.iter().map(String::as_str));
                        redis.cli(&cmd);
                    }
                }
            }
        }
        let mut keys: Vec<String> = Vec::new();
        let mut args = call_header(troubled);
        args.push((2 * requests.len()).to_string());
        for copy in ["p", "q"] {
            for (n, request) in requests.iter().enumerate() {
                // Copy q's requests carry a call id (shape flag bit 1),
                // p's none: both must answer alike.
                let id = copy == "q";
                let flags = never_deny + 2 * u64::from(id);
                let mut shape = format!("{},{},{flags}", request.len(), request.len());
                if times[n] > 1 {
                    shape = format!("{shape},{}", times[n]);
                }
                args.push(shape);
                if id {
                    args.push(format!("{copy}{n}"));
                }
                for (name, c) in request {
                    keys.push(base(copy, name));
                    args.push(c.text(w));
                    args.push(c.expected.to_string());
                }
            }
        }
        args.push("78".to_owned());
        let absent: Vec<String> = seeded
            .iter()
            .map(|name| format!("{}@{w}", base("p", name)))
            .filter(|key| pttl(&redis, key) == -2)
            .collect();
        let out = evalsha(&redis, &sha, &keys, &args);
        let flat = numbers(&out);
        assert!(!flat.is_empty(), "scenario {scenario}: script error: {out}");
        // Each request's charges, once per answer it stands for, in both
        // copies.
        let per: Vec<Vec<Option<u64>>> = requests
            .iter()
            .zip(&times)
            .flat_map(|(r, &t)| std::iter::repeat_n(r.iter().map(|(_, c)| short(c)).collect(), t))
            .collect();
        let all = replies(&flat, &[per.clone(), per].concat());
        let (short, general) = all.split_at(answers);
        assert_eq!(
            short, general,
            "scenario {scenario}: the short path answers as the general one"
        );
        // A field at 0 means what an absent one does (the general path
        // sums a call's changes to a window before writing them, the short
        // one writes each at once), and the odd fence is 0.
        let nonzero = |key: String| -> Vec<String> {
            hash(&redis, &key)
                .into_iter()
                .filter(|f| !f.ends_with("=0"))
                .collect()
        };
        for name in &seeded {
            for suffix in [String::new(), format!("@{w}"), format!("@{}", w - 1)] {
                assert_eq!(
                    nonzero(format!("{}{suffix}", base("p", name))),
                    nonzero(format!("{}{suffix}", base("q", name))),
                    "scenario {scenario}: {name}{suffix} holds the same counts"
                );
            }
        }
        // A window hash the call made expires (at its window's end plus
        // the margin).
        for key in &absent {
            let ttl = pttl(&redis, key);
            if ttl != -2 {
                assert!(ttl > 0, "scenario {scenario}: {key} made without expiry");
                created += 1;
            }
        }
        for reply in short {
            match reply[0] {
                -1 => stale += 1,
                s if s % 2 == 0 => admitted += 1,
                _ => denied += 1,
            }
        }
        // Groups the short path may decide whole: one window charge, not
        // a refund, no presumption.
        groups += requests
            .iter()
            .zip(&times)
            .filter(|(r, &t)| {
                t > 1
                    && r.len() == 1
                    && r[0].1.algorithm != 4
                    && r[0].1.flags % 2 == 0
                    && r[0].1.fraction == "0"
            })
            .count();
    }
    assert!(
        created >= 20 && admitted >= 100 && denied >= 100 && stale >= 20 && groups >= 20,
        "created {created}, admitted {admitted}, denied {denied}, stale {stale}, groups {groups}"
    );
}

/// When each key expires, in Redis's ms (PEXPIRETIME; -2 absent).
fn expire_time(redis: &RedisServer, key: &str) -> i64 {
    numbers(&redis.cli(&["PEXPIRETIME", key]))
        .first()
        .copied()
        .unwrap_or(-9)
}

/// The window hashes `keys` (of window `w`) expire in `[end, end + span)`,
/// at instants spread over at least half of it, half of them distinct.
fn expire_spread(redis: &RedisServer, keys: &[String], w: i64, end: i64, span: i64, what: &str) {
    let mut at: Vec<i64> = keys
        .iter()
        .map(|k| expire_time(redis, &format!("{k}@{w}")))
        .collect();
    for (k, &t) in keys.iter().zip(&at) {
        assert!(
            (end..end + span).contains(&t),
            "{what}: {k}@{w} expires at {t}, not within [{end}, {})",
            end + span
        );
    }
    at.sort_unstable();
    at.dedup();
    let (first, last) = (at[0], at[at.len() - 1]);
    assert!(
        at.len() >= keys.len() / 2 && last - first >= span / 2,
        "{what}: {} hashes expire at {} distinct instants over {} ms",
        keys.len(),
        at.len(),
        last - first
    );
}

#[test]
fn the_window_hashes_a_call_makes_expire_spread_over_a_unit_not_at_one_instant() {
    // A window's hashes all expiring in one millisecond make Redis delete
    // them in one go (10,000 at once held it 14-19 ms, past a replica's
    // 15 ms budget). Each new hash expires at its window's end plus the
    // margin plus a spread below min(unit, margin): here a 1 s unit and a
    // 10 s margin, so within one second, and never before the end plus
    // the margin. Decisions (both paths) and replays alike.
    let dir = test_dir("script-expiry");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let replay = load(&redis, REPLAY_LUA);
    let (unit, margin) = (1_000_i64, 10_000_i64);
    // 48 requests of one fixed-window charge each (the short path), then
    // 16 of two charges (the general path), every charge on a key of its
    // own; the demand of the previous window is known (flag 8).
    let (short, general) = (48, 16);
    let charge = format!("1,100,{unit},100,1,8,0,0,0");
    let mut keys = Vec::new();
    let mut args: Vec<String> = ["0", "1", &margin.to_string(), "", "", ""]
        .map(str::to_owned)
        .to_vec();
    args.push((short + general).to_string());
    for n in 0..short + general {
        let charges = if n < short { 1 } else { 2 };
        args.push(format!("{charges},{charges},0"));
        for c in 0..charges {
            keys.push(format!("x{{e}}:{n}.{c}"));
            args.push(charge.clone());
            args.push("-1".to_owned());
        }
    }
    args.push("5".to_owned());
    let out = evalsha(&redis, &sha, &keys, &args);
    let flat = numbers(&out);
    assert!(flat.len() > 2, "script error: {out}");
    let now = flat[flat.len() - 2];
    let w = now / unit;
    let span = unit.min(margin);
    expire_spread(&redis, &keys, w, (w + 1) * unit + margin, span, "decided");

    // A replay of local counts into window hashes no call made: one call,
    // 64 entries, in the next window (so that the call cannot cross the
    // end of the one it writes).
    let keys: Vec<String> = (0..64).map(|n| format!("y{{e}}:{n}")).collect();
    let now = numbers(&redis.cli(&["TIME"]))[0] * 1000;
    let w = now / unit + 1;
    let mut args: Vec<String> = ["0", "1", &margin.to_string(), "boot"]
        .map(str::to_owned)
        .to_vec();
    for _ in &keys {
        args.extend(
            [
                "1",
                "1",
                &unit.to_string(),
                &w.to_string(),
                "1",
                "100",
                "100",
            ]
            .map(str::to_owned),
        );
    }
    args.push("6".to_owned());
    let out = evalsha(&redis, &replay, &keys, &args);
    assert_eq!(
        numbers(&out).first(),
        Some(&64),
        "every entry written: {out}"
    );
    expire_spread(&redis, &keys, w, (w + 1) * unit + margin, span, "replayed");
}

/// Waits until Redis's time is in the first 600 ms of a second whose index
/// `pick` accepts (a few seconds at most); that index.
fn second_where(redis: &RedisServer, pick: impl Fn(u64) -> bool) -> u64 {
    for _ in 0..80 {
        let now = redis_ms(redis);
        if pick(now / 1000) && now % 1000 < 600 {
            return now / 1000;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("Redis's clock never reached a second of the kind asked for");
}

#[test]
fn a_per_second_fixed_window_takes_its_demand_from_the_window_before_its_block_and_keeps_it() {
    // A per-second fixed window's decisions in windows 5k to 5k + 4 take
    // their demand shares from window 5k - 1 (the replica then holds them
    // for the whole block), on the short path and the general path alike.
    let dir = test_dir("script-demand-block");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let replay = load(&redis, REPLAY_LUA);
    // A window other than the first of its block: its demand window is
    // not the previous one.
    let w = second_where(&redis, |w| w % 5 != 0);
    let d = w - w % 5 - 1;
    let keys: Vec<String> = ["b{a}", "b{b}", "b{c}"].map(str::to_owned).to_vec();
    for key in &keys {
        redis.cli(&["HSET", &format!("{key}@{}", w - 1), "0", "7", "1", "3"]);
        redis.cli(&["HSET", &format!("{key}@{d}"), "0", "2", "1", "6"]);
    }
    // Demand unknown (no flag 8): one request of one charge, one of two.
    let charge = "1,100,1000,100,1,0,0,0,0";
    let mut args = call_header(false);
    args.extend(
        [
            "2", "1,1,0", charge, "-1", "2,2,0", charge, "-1", charge, "-1",
        ]
        .map(str::to_owned),
    );
    args.push("7".to_owned());
    let out = evalsha(&redis, &sha, &keys, &args);
    let flat = numbers(&out);
    assert!(flat.len() > 2, "script error: {out}");
    assert_eq!(
        flat[flat.len() - 2] as u64 / 1000,
        w,
        "decided in window {w}: {out}"
    );
    let r = replies(&flat, &[vec![None], vec![None, None]]);
    // status, then per charge remaining, reset, own, total, delta.
    assert_eq!((r[0][0], r[0][3], r[0][4]), (0, 2, 8), "short path: {out}");
    assert_eq!(
        (r[1][0], r[1][3], r[1][4]),
        (0, 2, 8),
        "general path: {out}"
    );
    assert_eq!(
        (r[1][8], r[1][9]),
        (2, 8),
        "general path, second charge: {out}"
    );

    // A demand window's hash lives until its block ends, past a margin
    // shorter than the block (500 ms here): made by a decision (both
    // paths) or by a replay. Any other window's: its end plus the margin
    // plus a spread below min(unit, margin).
    let w = second_where(&redis, |w| w % 5 == 4);
    let keys: Vec<String> = ["c{a}", "c{b}", "c{c}"].map(str::to_owned).to_vec();
    let mut args: Vec<String> = ["0", "1", "500", "", "", ""].map(str::to_owned).to_vec();
    let known = "1,100,1000,100,1,8,0,0,0";
    args.extend(["2", "1,1,0", known, "-1", "2,2,0", known, "-1", known, "-1"].map(str::to_owned));
    args.push("8".to_owned());
    let out = evalsha(&redis, &sha, &keys, &args);
    let flat = numbers(&out);
    assert!(flat.len() > 2, "script error: {out}");
    assert_eq!(
        flat[flat.len() - 2] as u64 / 1000,
        w,
        "decided in window {w}: {out}"
    );
    let end = (w as i64 + 6) * 1000;
    for key in &keys {
        let at = expire_time(&redis, &format!("{key}@{w}"));
        assert!(
            (end..end + 500).contains(&at),
            "{key}@{w} expires at {at}, not in [{end}, {})",
            end + 500
        );
    }
    // Replayed: the next block's demand window, the next window, and the
    // demand window of the block now ending, whose end plus the margin
    // has passed but which decisions read until the block ends (so it is
    // still replayed).
    let keys: Vec<String> = ["r{a}", "r{b}", "r{c}"].map(str::to_owned).to_vec();
    let mut args: Vec<String> = ["0", "1", "500", "boot"].map(str::to_owned).to_vec();
    for window in [w + 5, w + 1, w - 5] {
        args.extend(["1", "1", "1000", &window.to_string(), "1", "100", "100"].map(str::to_owned));
    }
    args.push("9".to_owned());
    let out = evalsha(&redis, &replay, &keys, &args);
    assert_eq!(
        numbers(&out).first(),
        Some(&3),
        "every entry written: {out}"
    );
    let end = (w as i64 + 1) * 1000;
    let at = expire_time(&redis, &format!("r{{c}}@{}", w - 5));
    assert!(
        (end..end + 500).contains(&at),
        "the ending block's demand window expires at {at}, not from {end}"
    );
    let (ref_end, next_end) = ((w as i64 + 11) * 1000, (w as i64 + 2) * 1000 + 500);
    let at = expire_time(&redis, &format!("r{{a}}@{}", w + 5));
    assert!(
        (ref_end..ref_end + 500).contains(&at),
        "replayed demand window expires at {at}, not from {ref_end}"
    );
    let at = expire_time(&redis, &format!("r{{b}}@{}", w + 1));
    assert!(
        (next_end..next_end + 500).contains(&at),
        "replayed window expires at {at}, not from {next_end}"
    );
}

#[test]
fn a_short_charge_whose_window_has_decisions_off_redis_voids_its_block_share() {
    // A per-second fixed window's demand share is read once per block
    // of five windows; a replica back from a failure announces it in the
    // window it returns in and replays into the demand window. A short
    // charge (the caller holds the share) that finds its current window
    // so marked is answered in full with own -1, its request's status
    // + 4, so that the caller drops the share; an hour's charge (a block
    // of one window) is not.
    let dir = test_dir("script-void");
    let redis = RedisServer::start("redis", &dir);
    let sha = load(&redis, DECIDE_LUA);
    let w = second_where(&redis, |_| true);
    let h = w / 3_600;
    redis.cli(&["HSET", &format!("v{{a}}@{w}"), "x", "1:e", "0", "3"]);
    redis.cli(&["HSET", &format!("v{{b}}@{w}"), "0", "2"]);
    redis.cli(&["HSET", &format!("v{{c}}@{w}"), "x", "1:e"]);
    redis.cli(&["HSET", &format!("v{{d}}@{h}"), "x", "1:e"]);
    let second = "1,100,1000,100,1,8,0,0,0";
    let hour = "1,100,3600000,100,1,8,0,0,0";
    let keys: Vec<String> = ["v{a}", "v{b}", "v{c}", "v{b}", "v{a}", "v{d}"]
        .map(str::to_owned)
        .to_vec();
    let mut args = call_header(false);
    args.push("5".to_owned());
    // One short charge on a marked window; two, the second marked; one on
    // the clean window; a group of two on the marked one; the hour's.
    for a in [
        "1,1,0", second, "-1", "2,2,0", second, "-1", second, "-1", "1,1,0", second, "-1",
        "1,1,0,2", second, "-1", "1,1,0", hour, "-1",
    ] {
        args.push(a.to_owned());
    }
    args.push("9".to_owned());
    let out = evalsha(&redis, &sha, &keys, &args);
    let flat = numbers(&out);
    assert!(flat.len() > 2, "script error: {out}");
    assert_eq!(
        flat[flat.len() - 2] as u64 / 1000,
        w,
        "decided in window {w}: {out}"
    );
    let one = || vec![Some(1)];
    let r = replies(
        &flat,
        &[one(), vec![Some(1), Some(1)], one(), one(), one(), one()],
    );
    let reset = r[0][2];
    assert_eq!(r[0], [4, 96, reset, -1, 1], "marked: {out}");
    assert_eq!(
        r[1],
        [4, 97, reset, -2, 1, 99, reset, -1, 1],
        "one of two marked: {out}"
    );
    assert_eq!(r[2], [0, 96, 1], "clean: {out}");
    assert_eq!(r[3], [4, 95, reset, -1, 1], "group, first: {out}");
    assert_eq!(r[4], [4, 94, reset, -1, 1], "group, second: {out}");
    assert_eq!(r[5], [0, 99, 1], "an hour's block is one window: {out}");
    assert_eq!(hash(&redis, &format!("v{{a}}@{w}")), ["0=6", "x=1:e"]);
}
