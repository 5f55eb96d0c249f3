//! The field readers every part of the loader shares: a per-file context
//! that records errors with their line, key checks (unknown keys are errors,
//! keys of the reference that belong elsewhere are warnings), and typed
//! scalars (string, boolean, u32) with messages that say what was found.

use std::collections::HashSet;
use std::path::Path;

use super::load::{err, RuleError};
use super::yaml::{Kind, Node as Yaml};

/// Keys the reference accepts anywhere in a file (its flat whitelist), plus
/// leasehold's two extensions.
const KNOWN_KEYS: &[&str] = &[
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "quota_mode",
    "algorithm",
    "burst",
];
pub(super) struct FileCtx<'a> {
    pub file: &'a Path,
    pub errors: &'a mut Vec<RuleError>,
}

impl FileCtx<'_> {
    pub fn error(&mut self, line: usize, message: impl Into<String>) {
        self.errors.push(err(self.file, line, message.into()));
    }

    /// Checks the keys of a map: unknown keys are errors; keys the reference
    /// knows but that do not belong at this level are ignored with a warning,
    /// as the reference ignores them.
    pub fn check_keys<'y>(
        &mut self,
        map: &'y [(Yaml, Yaml)],
        allowed: &[&str],
        what: &str,
    ) -> Vec<(&'y str, &'y Yaml, usize)> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for (k, v) in map {
            let Kind::Scalar { text, .. } = &k.kind else {
                self.error(k.line, format!("{what} has a non-string key"));
                continue;
            };
            if !seen.insert(text.as_str()) {
                self.error(k.line, format!("duplicate key '{text}' in {what}"));
                continue;
            }
            if allowed.contains(&text.as_str()) {
                out.push((text.as_str(), v, k.line));
            } else if KNOWN_KEYS.contains(&text.as_str()) {
                tracing::warn!(file = %self.file.display(), line = k.line, key = %text, "key is not valid in {what}; ignored");
            } else {
                self.error(k.line, format!("unknown key '{text}' in {what}"));
            }
        }
        out
    }

    pub fn string(&mut self, node: &Yaml, field: &str) -> Option<String> {
        match &node.kind {
            Kind::Scalar { text, .. } if !node.is_null() => Some(text.clone()),
            _ if node.is_null() => Some(String::new()),
            _ => {
                self.error(
                    node.line,
                    format!("'{field}' must be a string, found a {}", node.type_name()),
                );
                None
            }
        }
    }

    pub fn boolean(&mut self, node: &Yaml, field: &str) -> bool {
        if let Kind::Scalar { text, plain: true } = &node.kind {
            match text.to_ascii_lowercase().as_str() {
                "true" | "yes" | "on" => return true,
                "false" | "no" | "off" | "" | "~" | "null" => return false,
                _ => {}
            }
        }
        self.error(node.line, format!("'{field}' must be true or false"));
        false
    }

    pub fn uint32(&mut self, node: &Yaml, field: &str) -> Option<u32> {
        if let Kind::Scalar { text, .. } = &node.kind {
            if let Ok(v) = text.trim().parse::<u32>() {
                return Some(v);
            }
        }
        self.error(
            node.line,
            format!("'{field}' must be an integer between 0 and {}", u32::MAX),
        );
        None
    }
}
