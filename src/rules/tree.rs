//! The descriptor tree of one file: the top level (domain, duplicate
//! domains, merging), each level's list of descriptors, and each descriptor
//! (key, value, wildcard and `share_threshold`, its flags, its children)
//! inserted into the matching tree with duplicates reported.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::fields::FileCtx;
use super::load::LoadOptions;
use super::yaml::{self, Kind, Node as Yaml};
use super::{Domain, KeyNodes, Level, Node, Pattern, Rule, RuleSet};

const TOP_KEYS: &[&str] = &["domain", "descriptors"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];
/// A rule's name so far, in full and with values redacted (for admin
/// endpoints that hide descriptor values).
struct KeyPath {
    full: String,
    redacted: String,
}

impl FileCtx<'_> {
    pub(super) fn load_file(
        &mut self,
        text: &str,
        opts: LoadOptions,
        set: &mut RuleSet,
        domain_files: &mut HashMap<String, PathBuf>,
    ) {
        let root = match yaml::parse(text) {
            Ok(Some(root)) => root,
            Ok(None) => {
                self.error(
                    1,
                    "config file cannot have empty domain (the file is empty)",
                );
                return;
            }
            Err((line, msg)) => {
                self.error(line, format!("invalid YAML: {msg}"));
                return;
            }
        };
        let Kind::Map(pairs) = &root.kind else {
            self.error(
                root.line,
                format!("the top level must be a map, found a {}", root.type_name()),
            );
            return;
        };
        let fields = self.check_keys(pairs, TOP_KEYS, "the top level");
        let mut domain = None;
        let mut descriptors = None;
        for (name, value, line) in fields {
            match name {
                "domain" => domain = self.string(value, "domain").map(|d| (d, line)),
                "descriptors" => descriptors = Some(value),
                _ => {}
            }
        }
        let Some((domain, line)) = domain.filter(|(d, _)| !d.is_empty()).or_else(|| {
            self.error(root.line, "config file cannot have empty domain");
            None
        }) else {
            return;
        };
        if let Some(first) = domain_files.get(&domain) {
            if !opts.merge_domains {
                let first = first.display().to_string();
                self.error(
                    line,
                    format!("duplicate domain '{domain}' (already defined in {first}; set merge_domains to merge files of one domain)"),
                );
                return;
            }
        } else {
            domain_files.insert(domain.clone(), self.file.to_path_buf());
        }
        let entry = set.domains.entry(domain.clone()).or_insert_with(|| Domain {
            name: domain.clone(),
            root: Level::default(),
            rules: Vec::new(),
        });
        if let Some(list) = descriptors {
            let mut rules = Vec::new();
            let root = KeyPath {
                full: domain.clone(),
                redacted: domain.clone(),
            };
            self.load_level(list, &root, &mut entry.root, &mut rules);
            entry.rules.extend(rules);
        }
    }

    fn load_level(
        &mut self,
        list: &Yaml,
        parent: &KeyPath,
        level: &mut Level,
        rules: &mut Vec<Arc<Rule>>,
    ) {
        if list.is_null() {
            return;
        }
        let Kind::Seq(items) = &list.kind else {
            self.error(
                list.line,
                format!("'descriptors' must be a list, found a {}", list.type_name()),
            );
            return;
        };
        for item in items {
            let Kind::Map(pairs) = &item.kind else {
                self.error(
                    item.line,
                    format!("a descriptor must be a map, found a {}", item.type_name()),
                );
                continue;
            };
            self.load_descriptor(item.line, pairs, parent, level, rules);
        }
    }

    fn load_descriptor(
        &mut self,
        line: usize,
        pairs: &[(Yaml, Yaml)],
        parent: &KeyPath,
        level: &mut Level,
        rules: &mut Vec<Arc<Rule>>,
    ) {
        let fields = self.descriptor_fields(pairs);
        let Some(key) = fields.key.clone().filter(|k| !k.is_empty()) else {
            self.error(line, "descriptor has empty key");
            return;
        };
        let path = parent.child(&key, fields.value.as_deref());
        let is_wildcard = fields.value.as_deref().is_some_and(|v| v.contains('*'));
        if let Some(at) = fields.share_line.filter(|_| !is_wildcard) {
            self.error(at, format!("share_threshold can only be used with a wildcard value (a value containing '*') in '{}'", path.full));
        }
        let mut node = Node::default();
        if let Some((rl, at)) = fields.rate_limit.filter(|(n, _)| !n.is_null()) {
            if let Some(rule) = self.load_rate_limit(rl, at, &path.full) {
                let rule = Arc::new(Rule {
                    redacted_key: path.redacted.clone(),
                    shadow_mode: fields.shadow,
                    quota_mode: fields.quota,
                    detailed_metric: fields.detailed,
                    value_to_metric: fields.to_metric,
                    metadata: fields.metadata.clone(),
                    ..rule
                });
                rules.push(rule.clone());
                node.rule = Some(rule);
            }
        }
        if fields.share_line.is_some() && is_wildcard {
            node.shared_pattern = fields.value.as_deref().map(Arc::from);
        }
        if let Some(list) = fields.children {
            self.load_level(list, &path, &mut node.children, rules);
        }
        if !insert(level, key, fields.value, is_wildcard, node) {
            self.error(
                line,
                format!("duplicate descriptor composite key '{}'", path.full),
            );
        }
    }

    /// Reads a descriptor's own fields; type errors are recorded as found.
    fn descriptor_fields<'y>(&mut self, pairs: &'y [(Yaml, Yaml)]) -> DescriptorFields<'y> {
        let mut f = DescriptorFields::default();
        for (name, node, at) in self.check_keys(pairs, DESCRIPTOR_KEYS, "a descriptor") {
            match name {
                "key" => f.key = self.string(node, "key"),
                // A null value is a bare key, not an empty value.
                "value" if node.is_null() => f.value = None,
                "value" => f.value = self.string(node, "value"),
                "rate_limit" => f.rate_limit = Some((node, at)),
                "descriptors" => f.children = Some(node),
                "shadow_mode" => f.shadow = self.boolean(node, name),
                "quota_mode" => f.quota = self.boolean(node, name),
                "detailed_metric" => f.detailed = self.boolean(node, name),
                "value_to_metric" => f.to_metric = self.boolean(node, name),
                "share_threshold" => f.share_line = self.boolean(node, name).then_some(at),
                "metadata" => f.metadata = to_json(node),
                _ => {}
            }
        }
        f
    }
}

/// A descriptor's fields as read, before the tree is built.
#[derive(Default)]
struct DescriptorFields<'y> {
    key: Option<String>,
    value: Option<String>,
    /// The block and the line of its `rate_limit` key.
    rate_limit: Option<(&'y Yaml, usize)>,
    children: Option<&'y Yaml>,
    shadow: bool,
    quota: bool,
    detailed: bool,
    to_metric: bool,
    /// The line of `share_threshold: true`.
    share_line: Option<usize>,
    metadata: serde_json::Value,
}

impl KeyPath {
    /// The path of a child descriptor: `parent.key_value`, or `parent.key`
    /// for a bare key.
    fn child(&self, key: &str, value: Option<&str>) -> KeyPath {
        match value {
            Some(v) => KeyPath {
                full: format!("{}.{key}_{v}", self.full),
                redacted: format!("{}.{key}_{}", self.redacted, crate::redact::value(v)),
            },
            None => KeyPath {
                full: format!("{}.{key}", self.full),
                redacted: format!("{}.{key}", self.redacted),
            },
        }
    }
}

/// Inserts a node under its key: exact value, wildcard pattern or bare key.
/// False when that place is already taken.
fn insert(
    level: &mut Level,
    key: String,
    value: Option<String>,
    wildcard: bool,
    node: Node,
) -> bool {
    let nodes: &mut KeyNodes = level.keys.entry(key).or_default();
    match value {
        None => nodes.bare.replace(node).is_none(),
        Some(v) if wildcard => {
            if nodes.wildcards.iter().any(|(p, _)| *p.text == *v) {
                false
            } else {
                nodes.wildcards.push((Pattern::new(&v), node));
                true
            }
        }
        Some(v) => nodes.exact.insert(v, node).is_none(),
    }
}

/// Free-form metadata, kept as JSON for responses and /rules.
fn to_json(node: &Yaml) -> serde_json::Value {
    match &node.kind {
        _ if node.is_null() => serde_json::Value::Null,
        Kind::Scalar { text, .. } => serde_json::Value::String(text.clone()),
        Kind::Seq(items) => serde_json::Value::Array(items.iter().map(to_json).collect()),
        Kind::Map(pairs) => serde_json::Value::Object(
            pairs
                .iter()
                .map(|(k, v)| {
                    let key = match &k.kind {
                        Kind::Scalar { text, .. } => text.clone(),
                        _ => String::from("?"),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
    }
}
