//! Redaction of descriptor values (often API keys or user ids) on the admin
//! endpoints: a value becomes `~` and the first 8 hex digits of its SHA-256,
//! so an operator can still tell keys apart and match one they already know
//! (`echo -n value | sha256sum`) while the page does not show it. It is a
//! short unsalted hash: it hides values from a glance or a screenshot, not
//! from someone who can guess and hash candidates; keep the pages private
//! with `admin_addr` for that.

use sha2::{Digest, Sha256};

/// The redacted form of one value.
pub fn value(v: &str) -> String {
    let digest = Sha256::digest(v.as_bytes());
    format!("~{}", &hex::encode(digest)[..8])
}

/// A counter key (as [`crate::key::CounterKey`] prints it) with every
/// value redacted; the key layout itself is parsed only in `crate::key`.
pub fn counter_key(key: &str) -> String {
    crate::key::CounterKey::from_raw(key).redacted(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_hidden_and_keys_kept() {
        let k = "edge|api_key=secret-123|path=%2Fsearch#1:fw";
        let r = counter_key(k);
        assert!(!r.contains("secret-123") && !r.contains("search"), "{r}");
        assert!(
            r.starts_with("edge|api_key=~") && r.ends_with("#1:fw"),
            "{r}"
        );
        assert_eq!(r.matches('=').count(), 2);
        assert_eq!(value("a"), value("a"));
        assert_ne!(value("a"), value("b"));
        assert_eq!(counter_key("d#60:fw"), "d#60:fw");
        // An escaped value hashes like the raw one.
        assert_eq!(
            counter_key("d|k=a%20b#1:fw"),
            format!("d|k={}#1:fw", value("a b"))
        );
    }
}
