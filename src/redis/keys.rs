//! The Redis key layout, in one place.
//!
//! Counter keys: `<prefix>{<domain>}|<key>=<value>|…#<unit seconds>:<algorithm>`
//! (the escaped [`CounterKey`] with its domain wrapped in a hash tag), plus a
//! window suffix added inside the script:
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
//! - **Redis Cluster ready.** The hash tag is the domain, and the script only
//!   derives keys by appending to a base key it was given, so every key one
//!   call touches lives in one slot and a request stays atomic and
//!   all-or-nothing in Cluster too. The cost: one domain lives on one shard.
//! - **Expiry.** Every key gets a TTL: a window hash lives until its window
//!   ends (sliding: one unit longer, as the next window reads it) plus
//!   `redis_expiry_margin_ms`; a log until its newest member leaves plus the
//!   margin; a bucket until it would be full again plus the margin.
//! - **Replay is idempotent by construction.** Each replica writes only its
//!   own field, so recovery is "set my field to my count", which can be
//!   repeated; sliding-log members have deterministic ids, so re-adding them
//!   is a no-op.
//!
//! Membership keys live under the `{leasehold}` tag: `members` (sorted set,
//! id → last seen), `index` (hash, id → field index), `index-owner` (index →
//! id), `next-index`, `incarnation` (a token created once per dataset, so
//! replicas notice a Redis that lost its data), and `owner:<id>` (the live incarnation's nonce, with a
//! TTL). The registry expires a day after the last heartbeat.

use crate::key::CounterKey;

/// The base Redis key of a counter: the counter key with its hash tag (the
/// escaped domain, [`CounterKey::split_tag`]) wrapped in `{…}`.
pub fn counter_base(prefix: &str, key: &CounterKey) -> String {
    let (domain, rest) = key.split_tag();
    let mut out = String::with_capacity(prefix.len() + key.as_str().len() + 2);
    out.push_str(prefix);
    out.push('{');
    out.push_str(domain);
    out.push('}');
    out.push_str(rest);
    out
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
/// owners, incarnation).
pub fn membership(prefix: &str, id: &str) -> [String; 7] {
    let escaped = crate::key::escape_id(id);
    [
        format!("{prefix}{{leasehold}}:owner:{escaped}"),
        format!("{prefix}{{leasehold}}:members"),
        format!("{prefix}{{leasehold}}:index"),
        format!("{prefix}{{leasehold}}:next-index"),
        format!("{prefix}{{leasehold}}:index-owner"),
        format!("{prefix}{{leasehold}}:incarnation"),
        format!("{prefix}{{leasehold}}:on-redis"),
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
    fn domain_becomes_the_hash_tag() {
        let spec = LimitSpec::fixed(1, Unit::Minute);
        let k = CounterKey::new("api{x}", [("user", "a|b")], &spec);
        assert_eq!(counter_base("lh:", &k), "lh:{api%7Bx%7D}|user=a%7Cb#60:fw");
        let k = CounterKey::new("d", std::iter::empty(), &spec);
        assert_eq!(counter_base("", &k), "{d}#60:fw");
    }
}
