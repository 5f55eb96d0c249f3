//! Loading rules from files and directories and validating them, with every
//! error naming file, line and what is wrong. Directories are walked
//! recursively in name order, skipping dot entries (Kubernetes ConfigMap
//! mounts keep their real files under `..data`/`..<timestamp>` and expose them
//! through symlinks, which are followed).

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::yaml::{self, Kind, Node as Yaml};
use super::{Domain, KeyNodes, Level, Node, Pattern, Rule, RuleSet};
use crate::limit::{Algorithm, LimitSpec, Unit};

/// Loader settings.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Merge files that declare the same domain (the reference's
    /// MERGE_DOMAIN_CONFIG); otherwise a repeated domain is an error.
    pub merge_domains: bool,
}

/// One problem in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem is not tied to a line (unreadable file).
    pub line: usize,
    pub message: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
        } else {
            write!(f, "{}: {}", self.file.display(), self.message)
        }
    }
}

/// Every problem found in one load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleErrors(pub Vec<RuleError>);

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RuleErrors {}

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
const RATE_LIMIT_KEYS: &[&str] = &[
    "requests_per_unit",
    "unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "burst",
];
const REPLACES_KEYS: &[&str] = &["name"];

/// A hash over the files under `paths` (names and contents): equal to the
/// `hash` of a successful [`load_paths`] of the same files, so the reloader
/// can tell cheaply whether anything changed.
pub fn fingerprint(paths: &[PathBuf]) -> String {
    let mut errors = Vec::new();
    let mut files = Vec::new();
    for path in paths {
        collect_files(path, &mut files, &mut errors);
    }
    let mut hasher = Sha256::new();
    for file in &files {
        match std::fs::read(file) {
            Ok(bytes) => hash_file(&mut hasher, file, &bytes),
            Err(e) => hasher.update(format!("unreadable {}: {e}", file.display())),
        }
    }
    for e in &errors {
        hasher.update(e.to_string());
    }
    hex::encode(hasher.finalize())
}

/// A rule's name so far, in full and with values redacted (for admin
/// endpoints that hide descriptor values).
struct KeyPath {
    full: String,
    redacted: String,
}

fn hash_file(hasher: &mut Sha256, file: &Path, bytes: &[u8]) {
    hasher.update(file.to_string_lossy().as_bytes());
    hasher.update([0]);
    hasher.update(bytes);
    hasher.update([0]);
}

/// Loads and validates every rules file under `paths`.
pub fn load_paths(paths: &[PathBuf], opts: LoadOptions) -> Result<RuleSet, RuleErrors> {
    let mut errors = Vec::new();
    let mut files = Vec::new();
    for path in paths {
        collect_files(path, &mut files, &mut errors);
    }
    let mut set = RuleSet::default();
    let mut hasher = Sha256::new();
    let mut domain_files: std::collections::HashMap<String, PathBuf> = Default::default();
    for file in &files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                errors.push(err(file, 0, format!("cannot read file: {e}")));
                continue;
            }
        };
        hash_file(&mut hasher, file, text.as_bytes());
        let mut ctx = FileCtx {
            file,
            errors: &mut errors,
        };
        ctx.load_file(&text, opts, &mut set, &mut domain_files);
    }
    if files.is_empty() && errors.is_empty() {
        let shown: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
        errors.push(err(
            Path::new(&shown.join(", ")),
            0,
            "no rules files found".into(),
        ));
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    set.hash = hex::encode(hasher.finalize());
    set.files = files;
    Ok(set)
}

fn err(file: &Path, line: usize, message: String) -> RuleError {
    RuleError {
        file: file.to_path_buf(),
        line,
        message,
    }
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>, errors: &mut Vec<RuleError>) {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => {
            errors.push(err(path, 0, format!("cannot read rules path: {e}")));
            return;
        }
    };
    if meta.is_file() {
        out.push(path.to_path_buf());
        return;
    }
    if !meta.is_dir() {
        return;
    }
    let entries = match std::fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) => {
            errors.push(err(path, 0, format!("cannot list directory: {e}")));
            return;
        }
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    names.sort();
    for child in names {
        collect_files(&child, out, errors);
    }
}

struct FileCtx<'a> {
    file: &'a Path,
    errors: &'a mut Vec<RuleError>,
}

impl FileCtx<'_> {
    fn error(&mut self, line: usize, message: impl Into<String>) {
        self.errors.push(err(self.file, line, message.into()));
    }

    /// Checks the keys of a map: unknown keys are errors; keys the reference
    /// knows but that do not belong at this level are ignored with a warning,
    /// as the reference ignores them.
    fn check_keys<'y>(
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

    fn string(&mut self, node: &Yaml, field: &str) -> Option<String> {
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

    fn boolean(&mut self, node: &Yaml, field: &str) -> bool {
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

    fn uint32(&mut self, node: &Yaml, field: &str) -> Option<u32> {
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

    fn load_file(
        &mut self,
        text: &str,
        opts: LoadOptions,
        set: &mut RuleSet,
        domain_files: &mut std::collections::HashMap<String, PathBuf>,
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
        let fields = self.check_keys(pairs, DESCRIPTOR_KEYS, "a descriptor");
        let mut key = None;
        let mut value: Option<String> = None;
        let mut rate_limit = None;
        let mut children = None;
        let (mut shadow, mut quota, mut detailed, mut to_metric, mut share) =
            (false, false, false, false, false);
        let mut share_line = line;
        let mut metadata = serde_json::Value::Null;
        for (name, node, at) in fields {
            match name {
                "key" => key = self.string(node, "key"),
                "value" => {
                    value = if node.is_null() {
                        None
                    } else {
                        self.string(node, "value")
                    }
                }
                "rate_limit" => rate_limit = Some((node, at)),
                "descriptors" => children = Some(node),
                "shadow_mode" => shadow = self.boolean(node, name),
                "quota_mode" => quota = self.boolean(node, name),
                "detailed_metric" => detailed = self.boolean(node, name),
                "value_to_metric" => to_metric = self.boolean(node, name),
                "share_threshold" => {
                    share = self.boolean(node, name);
                    share_line = at;
                }
                "metadata" => metadata = to_json(node),
                _ => {}
            }
        }
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            self.error(line, "descriptor has empty key");
            return;
        };
        let composite = match &value {
            Some(v) => format!("{key}_{v}"),
            None => key.clone(),
        };
        let path = KeyPath {
            full: format!("{}.{composite}", parent.full),
            redacted: match &value {
                Some(v) => format!("{}.{key}_{}", parent.redacted, crate::redact::value(v)),
                None => format!("{}.{key}", parent.redacted),
            },
        };
        let full_key = path.full.clone();
        let is_wildcard = value.as_deref().is_some_and(|v| v.contains('*'));
        if share && !is_wildcard {
            self.error(share_line, format!("share_threshold can only be used with a wildcard value (a value containing '*') in '{full_key}'"));
        }

        let mut node = Node::default();
        if let Some((rl, at)) = rate_limit.filter(|(n, _)| !n.is_null()) {
            if let Some(rule) = self.load_rate_limit(rl, at, &full_key) {
                let rule = Arc::new(Rule {
                    redacted_key: path.redacted.clone(),
                    shadow_mode: shadow,
                    quota_mode: quota,
                    detailed_metric: detailed,
                    value_to_metric: to_metric,
                    metadata,
                    ..rule
                });
                rules.push(rule.clone());
                node.rule = Some(rule);
            }
        }
        if share && is_wildcard {
            node.shared_pattern = value.as_deref().map(Arc::from);
        }
        if let Some(list) = children {
            self.load_level(list, &path, &mut node.children, rules);
        }

        let nodes: &mut KeyNodes = level.keys.entry(key).or_default();
        let duplicate = match value {
            None => nodes.bare.replace(node).is_some(),
            Some(v) if is_wildcard => {
                if nodes.wildcards.iter().any(|(p, _)| *p.text == *v) {
                    true
                } else {
                    nodes.wildcards.push((Pattern::new(&v), node));
                    false
                }
            }
            Some(v) => nodes.exact.insert(v, node).is_some(),
        };
        if duplicate {
            self.error(
                line,
                format!("duplicate descriptor composite key '{full_key}'"),
            );
        }
    }

    /// `line` is the line of the `rate_limit` key: where errors about the
    /// block as a whole point, and the rule's recorded source line.
    fn load_rate_limit(&mut self, node: &Yaml, line: usize, full_key: &str) -> Option<Rule> {
        let Kind::Map(pairs) = &node.kind else {
            self.error(
                node.line,
                format!("'rate_limit' must be a map, found a {}", node.type_name()),
            );
            return None;
        };
        let fields = self.check_keys(pairs, RATE_LIMIT_KEYS, "rate_limit");
        let mut rpu = Some(0);
        let mut unit: Option<(&Yaml, String)> = None;
        let mut unlimited = false;
        let mut name = None;
        let mut replaces = Vec::new();
        let mut replaces_line = line;
        let mut algorithm = Algorithm::FixedWindow;
        let mut burst: Option<(u32, usize)> = None;
        let mut ok = true;
        for (field, value, at) in fields {
            match field {
                "requests_per_unit" => rpu = self.uint32(value, field),
                "unit" => unit = self.string(value, field).map(|u| (value, u)),
                "unlimited" => unlimited = self.boolean(value, field),
                "name" => name = self.string(value, field).filter(|n| !n.is_empty()),
                "replaces" => {
                    replaces_line = at;
                    ok &= self.load_replaces(value, &mut replaces);
                }
                "algorithm" => match self.string(value, field).map(|a| a.parse::<Algorithm>()) {
                    Some(Ok(a)) => algorithm = a,
                    Some(Err(e)) => {
                        self.error(value.line, e);
                        ok = false;
                    }
                    None => ok = false,
                },
                "burst" => match self.uint32(value, field) {
                    Some(b) => burst = Some((b, at)),
                    None => ok = false,
                },
                _ => {}
            }
        }
        let parsed_unit = match (&unit, unlimited) {
            (Some((at, u)), true) => {
                if u.parse::<Unit>().is_ok() {
                    self.error(
                        at.line,
                        format!(
                            "should not specify rate limit unit when unlimited in '{full_key}'"
                        ),
                    );
                    return None;
                }
                Unit::Second
            }
            (_, true) => Unit::Second,
            (Some((at, u)), false) => match u.parse::<Unit>() {
                Ok(u) => u,
                Err(e) => {
                    self.error(at.line, e);
                    return None;
                }
            },
            (None, false) => {
                self.error(line, format!("invalid rate limit unit '' in '{full_key}' (unit is required unless unlimited is true)"));
                return None;
            }
        };
        if let Some(own) = &name {
            if replaces.iter().any(|r| r == own) {
                self.error(
                    replaces_line,
                    format!(
                        "replaces should not contain the rule's own name '{own}' in '{full_key}'"
                    ),
                );
                ok = false;
            }
        }
        if let Some((_, at)) = burst {
            if algorithm != Algorithm::TokenBucket {
                self.error(
                    at,
                    format!("burst is only valid with algorithm token_bucket in '{full_key}'"),
                );
                ok = false;
            }
        }
        let rpu = rpu?;
        if !ok {
            return None;
        }
        Some(Rule {
            full_key: full_key.to_owned(),
            redacted_key: full_key.to_owned(),
            spec: LimitSpec {
                requests_per_unit: rpu,
                unit: parsed_unit,
                algorithm,
                burst: burst.map(|(b, _)| b).unwrap_or(rpu),
            },
            unlimited,
            name,
            replaces,
            shadow_mode: false,
            quota_mode: false,
            detailed_metric: false,
            value_to_metric: false,
            metadata: serde_json::Value::Null,
            file: self.file.to_path_buf(),
            line,
        })
    }

    fn load_replaces(&mut self, node: &Yaml, out: &mut Vec<String>) -> bool {
        let Kind::Seq(items) = &node.kind else {
            self.error(node.line, "'replaces' must be a list of {name: ...}");
            return false;
        };
        let mut ok = true;
        for item in items {
            let Kind::Map(pairs) = &item.kind else {
                self.error(item.line, "'replaces' must be a list of {name: ...}");
                ok = false;
                continue;
            };
            let fields = self.check_keys(pairs, REPLACES_KEYS, "replaces");
            let name = fields
                .into_iter()
                .find(|(f, _, _)| *f == "name")
                .and_then(|(_, v, _)| self.string(v, "name"));
            match name.filter(|n| !n.is_empty()) {
                Some(n) => out.push(n),
                None => {
                    self.error(item.line, "replaces name cannot be empty");
                    ok = false;
                }
            }
        }
        ok
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
