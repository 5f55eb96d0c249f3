//! Rules in the envoyproxy/ratelimit YAML format: the validated tree
//! ([`RuleSet`]) and matching a request descriptor against it.
//!
//! Matching follows the reference: for each entry of the request, try the
//! exact `key`+`value` node, then the first wildcard pattern (config order)
//! whose value matches, then the value-less `key` node; never backtrack. A
//! limit applies only when it sits on the node of the request's last entry.
//! Unlike the reference, keys and values are compared as a pair, not as the
//! string `key_value`, so `("a_b","c")` and `("a","b_c")` never alias.

mod fields;
mod load;
mod rate_limit;
mod reload;
mod tree;
mod yaml;

pub use load::{fingerprint, load_paths, load_text, LoadOptions, RuleError, RuleErrors};
pub use reload::ReloadStatus;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::limit::LimitSpec;

/// One configured limit (a `rate_limit` block and the flags of its node).
#[derive(Debug)]
pub struct Rule {
    /// `domain.key_value.key2` style name, as the reference prints it.
    pub full_key: String,
    /// `full_key` with every value redacted ([`crate::redact::value`]).
    pub redacted_key: String,
    pub spec: LimitSpec,
    pub unlimited: bool,
    pub name: Option<String>,
    pub replaces: Vec<String>,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub metadata: serde_json::Value,
    pub file: PathBuf,
    pub line: usize,
}

/// A node of the descriptor tree.
#[derive(Debug, Default)]
pub struct Node {
    pub rule: Option<Arc<Rule>>,
    /// Set for a wildcard node with `share_threshold: true`: every matching
    /// value shares one counter, keyed by the pattern.
    pub shared_pattern: Option<Arc<str>>,
    pub children: Level,
}

/// The children of one node, indexed by key.
#[derive(Debug, Default)]
pub struct Level {
    keys: HashMap<String, KeyNodes>,
}

#[derive(Debug, Default)]
struct KeyNodes {
    exact: HashMap<String, Node>,
    wildcards: Vec<(Pattern, Node)>,
    bare: Option<Node>,
}

/// A value with `*` wildcards, each matching zero or more characters.
#[derive(Debug, Clone)]
pub struct Pattern {
    text: Arc<str>,
    parts: Vec<String>,
}

impl Pattern {
    pub fn new(text: &str) -> Self {
        Pattern {
            text: Arc::from(text),
            parts: text.split('*').map(str::to_owned).collect(),
        }
    }

    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return value.is_empty(),
        };
        let Some(mut tail) = value.strip_prefix(first.as_str()) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return tail.is_empty();
        };
        for part in middle {
            match tail.find(part.as_str()) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last.as_str())
    }
}

/// A validated domain.
#[derive(Debug)]
pub struct Domain {
    pub name: String,
    pub root: Level,
    /// Every rule of the domain in config order, for /rules and metrics.
    pub rules: Vec<Arc<Rule>>,
}

/// The whole validated configuration, swapped atomically on reload.
#[derive(Debug, Default)]
pub struct RuleSet {
    pub domains: HashMap<String, Domain>,
    /// sha256 over the loaded files (path and content), hex.
    pub hash: String,
    pub files: Vec<PathBuf>,
}

/// The result of matching one request descriptor.
#[derive(Debug, Clone)]
pub struct Matched<'a> {
    pub rule: &'a Arc<Rule>,
    /// Entries whose counter uses a shared wildcard pattern instead of the
    /// request's value: (entry index, pattern).
    pub shared: Vec<(usize, Arc<str>)>,
}

impl RuleSet {
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }
}

impl Domain {
    /// Finds the limit for a descriptor given as (key, value) entries.
    pub fn find<'a, 'e>(
        &'a self,
        entries: impl IntoIterator<Item = (&'e str, &'e str)>,
    ) -> Option<Matched<'a>> {
        let mut level = &self.root;
        let mut shared = Vec::new();
        let mut found: Option<&Node> = None;
        for (i, (key, value)) in entries.into_iter().enumerate() {
            let node = level.lookup(key, value)?;
            if let Some(pattern) = &node.shared_pattern {
                shared.push((i, pattern.clone()));
            }
            found = Some(node);
            level = &node.children;
        }
        // The limit of the node reached by the last entry, if any: a limit on
        // an intermediate node never applies to a deeper request.
        found
            .and_then(|n| n.rule.as_ref())
            .map(|rule| Matched { rule, shared })
    }
}

impl Level {
    fn lookup(&self, key: &str, value: &str) -> Option<&Node> {
        let nodes = self.keys.get(key)?;
        nodes
            .exact
            .get(value)
            .or_else(|| {
                nodes
                    .wildcards
                    .iter()
                    .find(|(p, _)| p.matches(value))
                    .map(|(_, n)| n)
            })
            .or(nodes.bare.as_ref())
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_patterns_match_like_the_reference() {
        let cases = [
            ("foo*", "foo", true),
            ("foo*", "foobar", true),
            ("foo*", "fo", false),
            ("foo*", "xfoo", false),
            ("bar*b", "barb", true),
            ("bar*b", "bar-xyz-b", true),
            ("bar*b", "barbx", false),
            ("foo*bar*baz", "foobarbaz", true),
            ("foo*bar*baz", "foo1bar2baz", true),
            ("foo*bar*baz", "foo1baz2bar", false),
            ("*", "", true),
            ("a*a", "a", false),
            ("a*a", "aa", true),
            ("*end", "the end", true),
        ];
        for (pattern, value, want) in cases {
            assert_eq!(
                Pattern::new(pattern).matches(value),
                want,
                "{pattern} vs {value}"
            );
        }
    }
}
