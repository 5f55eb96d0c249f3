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

use std::fmt::Write as _;
use std::sync::Arc;

use crate::limit::LimitSpec;

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
            escape_into(&mut s, v);
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

    /// The escaped domain, which is the Redis Cluster hash tag, and the rest
    /// of the key. Escaping keeps `|` and `#` out of the domain, so the
    /// first of them ends it.
    pub fn split_tag(&self) -> (&str, &str) {
        let s = self.as_str();
        s.split_at(s.find(['|', '#']).unwrap_or(s.len()))
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
        assert_eq!(key.split_tag().0, "api%7Bx%7D%7Cy");
        let bare = CounterKey::new("d", std::iter::empty(), &spec);
        assert_eq!(bare.split_tag(), ("d", "#3600:sw"));
        assert!(bare.parts().entries.is_empty());
    }

    #[test]
    fn redaction_hides_values_and_keeps_the_shape() {
        let spec = LimitSpec::fixed(1, Unit::Second);
        let key = CounterKey::new("edge", [("api_key", "secret"), ("p", "a b")], &spec);
        let r = key.redacted(|v| format!("<{}>", v.len()));
        assert_eq!(r, "edge|api_key=<6>|p=<3>#1:fw");
    }
}
