//! The counter key, in one place: how a (domain, entries, unit, algorithm)
//! becomes one string, how that string splits back into its parts, where
//! its Redis Cluster hash tag is, and its redacted form for admin pages.
//! Nobody else escapes or parses keys.
//!
//! Layout: `domain|k=v|k=v#unit_seconds:algorithm`. Every component is
//! percent-escaped (`%`, `|`, `=`, `#`, `:`, `{`, `}`, space and control
//! bytes), so the separators are unambiguous, two different descriptors can
//! never produce the same key, and no `{...}` hash tag can be smuggled in
//! by a value.
//!
//! A value longer than [`MAX_RAW_VALUE_BYTES`] (values are chosen by
//! clients: a 5 KiB user id, a long path) is written as its SHA-256,
//! `%00sha256%3A<64 hex digits>`, so every key stays bounded and distinct
//! values stay distinct counters. A value that itself starts with NUL is
//! digested too, so no raw value can spell out another value's digest. The
//! bound is a constant, not a setting: replicas that disagreed on it would
//! count one value under two keys.

use std::fmt::Write as _;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::limit::LimitSpec;

/// Values up to this many bytes appear in a key as they are (escaped);
/// longer ones by their digest (module docs).
pub const MAX_RAW_VALUE_BYTES: usize = 4096;

/// The identity of one counter: domain, the request's entries (with shared
/// wildcard patterns substituted), unit and algorithm.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey(Arc<str>);

/// A key split back into its parts, unescaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyParts {
    pub domain: String,
    pub entries: Vec<(String, String)>,
    /// `unit_seconds:algorithm`, as written after `#`.
    pub suffix: String,
}

impl CounterKey {
    /// Builds the key (layout in the module docs).
    pub fn new<'a>(
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
        spec: &LimitSpec,
    ) -> Self {
        let mut s = String::with_capacity(64);
        escape_into(&mut s, domain);
        for (k, v) in entries {
            s.push('|');
            escape_into(&mut s, k);
            s.push('=');
            push_value(&mut s, v);
        }
        let _ = write!(s, "#{}:{}", spec.unit.seconds(), spec.algorithm.tag());
        CounterKey(Arc::from(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key as [`CounterKey::as_str`] printed it (journal restore).
    pub fn from_raw(raw: &str) -> Self {
        CounterKey(Arc::from(raw))
    }

    /// The key's parts, unescaped.
    pub fn parts(&self) -> KeyParts {
        let (body, suffix) = match self.0.find('#') {
            Some(i) => (&self.0[..i], &self.0[i + 1..]),
            None => (&self.0[..], ""),
        };
        let mut pieces = body.split('|');
        let domain = unescape(pieces.next().unwrap_or_default());
        let entries = pieces
            .map(|entry| match entry.split_once('=') {
                Some((k, v)) => (unescape(k), unescape(v)),
                None => (unescape(entry), String::new()),
            })
            .collect();
        KeyParts {
            domain,
            entries,
            suffix: suffix.to_owned(),
        }
    }

    /// The key with every value replaced by `hide(value)` (the raw,
    /// unescaped value, so a hash of it matches `sha256sum` of what the
    /// caller sent); domain, entry keys and suffix are kept.
    pub fn redacted(&self, hide: impl Fn(&str) -> String) -> String {
        let parts = self.parts();
        let mut out = String::with_capacity(self.0.len());
        escape_into(&mut out, &parts.domain);
        for (k, v) in &parts.entries {
            out.push('|');
            escape_into(&mut out, k);
            out.push('=');
            out.push_str(&hide(v));
        }
        if !parts.suffix.is_empty() {
            out.push('#');
            out.push_str(&parts.suffix);
        }
        out
    }
}

impl std::fmt::Display for CounterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A value in a key: escaped, or digested when long (module docs).
fn push_value(out: &mut String, value: &str) {
    if value.len() > MAX_RAW_VALUE_BYTES || value.starts_with('\0') {
        // The escaped form of "\0sha256:", so `parts` gives it back unescaped.
        out.push_str("%00sha256%3A");
        out.push_str(&hex::encode(Sha256::digest(value.as_bytes())));
    } else {
        escape_into(out, value);
    }
}

/// Percent-escapes the separators, `{`, `}`, space and control bytes.
pub fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '%' | '|' | '=' | '#' | ':' | '{' | '}' | ' ' => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// A replica id made safe inside a membership key: `{`, `}`, `%`, space and
/// control bytes are escaped (fewer than in a counter key: membership keys
/// were laid out so, and changing them would split a rolling upgrade).
pub fn escape_id(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for c in id.chars() {
        match c {
            '{' | '}' | '%' | ' ' => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

fn unescape(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Algorithm, Unit};

    #[test]
    fn keys_are_injective_over_separators() {
        let spec = LimitSpec::fixed(1, Unit::Second);
        let a = CounterKey::new("d", [("a_b", "c")], &spec);
        let b = CounterKey::new("d", [("a", "b_c")], &spec);
        assert_ne!(a, b);
        let c = CounterKey::new("d", [("k", "x|y=z")], &spec);
        let d = CounterKey::new("d", [("k", "x"), ("y", "z")], &spec);
        assert_ne!(c, d);
        let e = CounterKey::new("d", [("k", "{tag}\n%")], &spec);
        assert_eq!(e.as_str(), "d|k=%7Btag%7D%0A%25#1:fw");
        let f = CounterKey::new("d", [("k", "v")], &LimitSpec::fixed(1, Unit::Minute));
        assert_ne!(CounterKey::new("d", [("k", "v")], &spec), f);
    }

    #[test]
    fn parts_round_trip_through_the_escaping() {
        let spec = LimitSpec {
            algorithm: Algorithm::SlidingWindow,
            ..LimitSpec::fixed(5, Unit::Hour)
        };
        let nasty = [
            ("user", "a|b=c#d:e{f} g%\u{1}"),
            ("path", "/search?q=1"),
            ("é", ""),
        ];
        let key = CounterKey::new("api{x}|y", nasty, &spec);
        let parts = key.parts();
        assert_eq!(parts.domain, "api{x}|y");
        let want: Vec<(String, String)> = nasty
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(parts.entries, want);
        assert_eq!(parts.suffix, "3600:sw");
        let again = CounterKey::new(
            &parts.domain,
            parts.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &spec,
        );
        assert_eq!(again, key, "decode then encode gives the same key");
        let bare = CounterKey::new("d", std::iter::empty(), &spec);
        assert_eq!(bare.as_str(), "d#3600:sw");
        assert!(bare.parts().entries.is_empty());
    }

    #[test]
    fn long_values_are_counted_under_a_bounded_distinct_digest() {
        let spec = LimitSpec::fixed(1, Unit::Second);
        let at_bound = "v".repeat(MAX_RAW_VALUE_BYTES);
        let kept = CounterKey::new("d", [("user", at_bound.as_str())], &spec);
        assert!(
            kept.as_str().contains(&at_bound),
            "at the bound: kept as is"
        );
        let long_a = "a".repeat(60_000);
        let long_b = format!("{}b", "a".repeat(59_999));
        let a = CounterKey::new("d", [("user", long_a.as_str())], &spec);
        let b = CounterKey::new("d", [("user", long_b.as_str())], &spec);
        assert_ne!(a, b, "distinct long values stay distinct counters");
        assert!(a.as_str().len() < 100, "{}", a.as_str());
        let digest = hex::encode(Sha256::digest(long_a.as_bytes()));
        assert_eq!(a.as_str(), format!("d|user=%00sha256%3A{digest}#1:fw"));
        // A short value spelling out the digest is digested in turn, so it
        // cannot land on the long value's counter.
        let spelled = format!("\0sha256:{digest}");
        let c = CounterKey::new("d", [("user", spelled.as_str())], &spec);
        assert_ne!(c, a);
        assert!(c.as_str().starts_with("d|user=%00sha256%3A"));
        // The digest parses back as a value like any other.
        assert_eq!(a.parts().entries[0].1, format!("\0sha256:{digest}"));
    }

    #[test]
    fn redaction_hides_values_and_keeps_the_shape() {
        let spec = LimitSpec::fixed(1, Unit::Second);
        let key = CounterKey::new("edge", [("api_key", "secret"), ("p", "a b")], &spec);
        let r = key.redacted(|v| format!("<{}>", v.len()));
        assert_eq!(r, "edge|api_key=<6>|p=<3>#1:fw");
    }
}
