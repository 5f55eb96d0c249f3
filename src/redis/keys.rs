//! The Redis key layout, in one place, and its version.
//!
//! Counter keys (layout 2): `<prefix>v2{<domain>|<key>=<value>|…#<unit
//! seconds>:<algorithm>}`, the escaped [`CounterKey`] wrapped whole in a hash
//! tag, plus a window suffix added inside the script:
//!
//! | algorithm | keys | type | fields / members |
//! |---|---|---|---|
//! | fixed_window | `<base>@<window index>` | hash | one field per replica index: its net count; `f<idx>`: fence |
//! | sliding_window | `<base>@<w>` and `<base>@<w-1>` | hash | as fixed_window; the current window is charged, the previous one read |
//! | sliding_log | `<base>` | sorted set | one member per hit, `<idx>:<call id>:<charge>:<n>`, scored by grant time |
//! | token_bucket | `<base>` and `<base>@<w>` | hash, hash | `t` tokens, `u` updated ms, `f<idx>` fence; per-replica consumption per window |
//!
//! Why this shape:
//! - **No collisions.** Every component is percent-escaped (`%`, `|`, `=`,
//!   `#`, `:`, `{`, `}`, space, control bytes), so separators are unambiguous
//!   and two different descriptors never share a key; the unit and algorithm
//!   are in the key, so changing a rule never reads another rule's state.
//! - **Spread over a Redis Cluster.** The hash tag is the whole counter, so
//!   one domain's counters spread over every slot, and the keys the script
//!   derives from a base key (its windows) only append outside the tag and
//!   stay in its slot. A request's counters may therefore live in different
//!   slots; on one Redis (or Sentinel) that changes nothing, as one script
//!   call may touch any keys there.
//! - **Expiry.** Every key gets a TTL: a window hash lives until its window
//!   ends (sliding: one unit longer, as the next window reads it) plus
//!   `redis_expiry_margin_ms`, and up to min(unit, margin) more, drawn per
//!   hash so that a window's hashes do not all expire at once (see
//!   decide.lua); a per-second fixed window's demand window (the last of
//!   each block of five, whose demand shares the block's decisions take)
//!   at least until its block ends; a log until its newest member leaves plus the margin; a
//!   bucket until it would be full again plus the margin.
//! - **Replay is idempotent by construction.** Each replica writes only its
//!   own field, so recovery is "set my field to my count", which can be
//!   repeated; sliding-log members have deterministic ids, so re-adding them
//!   is a no-op.
//!
//! # Layout versions
//!
//! [`LAYOUT`] is in every counter key (`v2`) and every replica announces it
//! in membership. Layout 1 (the releases before layout versions) keyed a
//! counter `<prefix>{<domain>}|…#…`, the domain alone as the hash tag, and
//! announced nothing. Replicas of two layouts counting side by side would
//! count in different keys: each would admit the whole limit. So a replica
//! does not count on Redis while a live member announces a lower layout (or
//! none): it decides on its lease, counted as held back by the others, and
//! once the last of them has left it moves every live window of the old
//! layout to its new name ([`super::migrate`]) before any replica of the
//! new layout counts. A member announcing a higher layout is the newer side
//! of an upgrade, which waits for this one.
//!
//! Membership keys live under the `{leasehold}` tag, the same in every
//! layout (it is where replicas of two layouts meet): `members` (sorted set,
//! id → last seen), `index` (hash, id → field index), `index-owner` (index →
//! id), `next-index`, `incarnation` (a token created once per dataset, so
//! replicas notice a Redis that lost its data), `owner:<id>` (the live
//! incarnation's nonce, with a TTL), `on-redis` (id → last beat made while
//! deciding on Redis), `layouts` (id → the layout it announces), and
//! `layout` (the layout whose windows are in place, set by the migration).
//! The registry expires a day after the last heartbeat.

use crate::key::CounterKey;

/// The key layout this build counts in (module docs).
pub const LAYOUT: u32 = 2;

/// What follows the prefix in a counter key of [`LAYOUT`].
const LAYOUT_MARK: &str = "v2{";

/// The base Redis key of a counter: the whole counter key, its own hash
/// tag, after the prefix and the layout mark.
pub fn counter_base(prefix: &str, key: &CounterKey) -> String {
    let mut out = String::with_capacity(prefix.len() + key.as_str().len() + 4);
    out.push_str(prefix);
    out.push_str(LAYOUT_MARK);
    out.push_str(key.as_str());
    out.push('}');
    out
}

/// The Redis Cluster slot of a counter (every key of the counter is in it).
pub fn counter_slot(key: &CounterKey) -> u16 {
    fred::util::redis_keyslot(key.as_str().as_bytes())
}

/// The SCAN pattern that finds counter keys of layout 1 (and the
/// membership keys, which [`layout1_to_current`] leaves out).
pub fn layout1_pattern(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 2);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push_str("{*");
    out
}

/// The current name of a layout-1 counter key (`<prefix>{<domain>}<rest>`,
/// with its window suffix if any); None for anything else, such as a
/// membership key. Escaping keeps `}` out of the domain and `#` out of
/// every value, so the first `}` ends the tag and the last `#` starts the
/// unit and algorithm, after which only `@<window>` may follow.
pub fn layout1_to_current(prefix: &str, old: &str) -> Option<String> {
    let body = old.strip_prefix(prefix)?.strip_prefix('{')?;
    let (domain, rest) = body.split_once('}')?;
    if !(rest.is_empty() || rest.starts_with('|') || rest.starts_with('#')) {
        return None;
    }
    let hash = rest.rfind('#')?;
    let (counter, window) = match rest[hash..].split_once('@') {
        Some((spec, w)) if !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()) => {
            (&rest[..hash + spec.len()], Some(w))
        }
        Some(_) => return None,
        None => (rest, None),
    };
    let mut out = format!("{prefix}{LAYOUT_MARK}{domain}{counter}}}");
    if let Some(w) = window {
        out.push('@');
        out.push_str(w);
    }
    Some(out)
}

/// The total of a window hash from its (field, value) pairs: the sum of the
/// count fields, `<idx>` (Redis path) and `o<idx>` (lease grants); fences
/// (`f<idx>`) and replay versions (`v<idx>`) are not counts.
pub fn window_total<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> i64 {
    fields
        .into_iter()
        .filter(|(k, _)| k.starts_with(|c: char| c.is_ascii_digit()) || k.starts_with('o'))
        .filter_map(|(_, v)| v.trim().parse::<i64>().ok())
        .sum()
}

/// Membership keys: (owner of `id`, members, index, next index, index
/// owners, incarnation, on Redis, layouts, the layout in place).
pub fn membership(prefix: &str, id: &str) -> [String; 9] {
    let escaped = crate::key::escape_id(id);
    [
        format!("{prefix}{{leasehold}}:owner:{escaped}"),
        format!("{prefix}{{leasehold}}:members"),
        format!("{prefix}{{leasehold}}:index"),
        format!("{prefix}{{leasehold}}:next-index"),
        format!("{prefix}{{leasehold}}:index-owner"),
        format!("{prefix}{{leasehold}}:incarnation"),
        format!("{prefix}{{leasehold}}:on-redis"),
        format!("{prefix}{{leasehold}}:layouts"),
        format!("{prefix}{{leasehold}}:layout"),
    ]
}

/// The key that says which layout's windows are in place (set by the
/// migration), and the lock of the migration.
pub fn layout_keys(prefix: &str) -> [String; 2] {
    [
        format!("{prefix}{{leasehold}}:layout"),
        format!("{prefix}{{leasehold}}:layout-migration"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{LimitSpec, Unit};

    #[test]
    fn window_total_sums_only_count_fields() {
        let fields = [
            ("0", "3"),
            ("o1", "4"),
            ("f0", "99"),
            ("v1", "7"),
            ("12", " 5 "),
        ];
        assert_eq!(window_total(fields), 12);
    }

    #[test]
    fn the_whole_counter_is_the_hash_tag() {
        let spec = LimitSpec::fixed(1, Unit::Minute);
        let k = CounterKey::new("api{x}", [("user", "a|b")], &spec);
        assert_eq!(
            counter_base("lh:", &k),
            "lh:v2{api%7Bx%7D|user=a%7Cb#60:fw}"
        );
        let k = CounterKey::new("d", std::iter::empty(), &spec);
        assert_eq!(counter_base("", &k), "v2{d#60:fw}");
        // One domain's counters land in different slots.
        let slots: std::collections::HashSet<u16> = (0..64)
            .map(|i| counter_slot(&CounterKey::new("edge", [("user", &*i.to_string())], &spec)))
            .collect();
        assert!(slots.len() > 50, "{} slots for 64 users", slots.len());
    }

    #[test]
    fn layout1_keys_get_their_current_names() {
        let cases = [
            (
                "lh:{edge}|user=a#60:fw@29000",
                Some("lh:v2{edge|user=a#60:fw}@29000"),
            ),
            ("lh:{edge}|user=a@b#1:tb", Some("lh:v2{edge|user=a@b#1:tb}")),
            ("lh:{edge}|u=a@b#1:sw@7", Some("lh:v2{edge|u=a@b#1:sw}@7")),
            ("lh:{d}#3600:sl", Some("lh:v2{d#3600:sl}")),
            ("lh:{leasehold}:members", None),
            ("lh:{edge}|user=a#60:fw@", None),
            ("lh:{edge}|user=a#60:fw@x", None),
            ("lh:v2{edge|user=a#60:fw}@1", None),
            ("other:{edge}|u=a#60:fw", None),
        ];
        for (old, new) in cases {
            assert_eq!(layout1_to_current("lh:", old).as_deref(), new, "{old}");
        }
        assert_eq!(layout1_pattern("a*[b]:"), "a\\*\\[b\\]:{*");
    }
}
