//! One `rate_limit` block: requests per unit, unit (required unless
//! unlimited, refused with unlimited), name and `replaces`, and leasehold's
//! `algorithm` and `burst`, with the combinations that are invalid reported.

use super::fields::FileCtx;
use super::yaml::{Kind, Node as Yaml};
use super::Rule;
use crate::limit::{Algorithm, LimitSpec, Unit};

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

impl FileCtx<'_> {
    /// `line` is the line of the `rate_limit` key: where errors about the
    /// block as a whole point, and the rule's recorded source line.
    pub(super) fn load_rate_limit(
        &mut self,
        node: &Yaml,
        line: usize,
        full_key: &str,
    ) -> Option<Rule> {
        let Kind::Map(pairs) = &node.kind else {
            self.error(
                node.line,
                format!("'rate_limit' must be a map, found a {}", node.type_name()),
            );
            return None;
        };
        let f = self.rate_limit_fields(pairs, line);
        let unit = self.unit(&f, line, full_key)?;
        let combined = self.check_combinations(&f, full_key);
        let rpu = f.requests_per_unit?;
        if !(f.ok && combined) {
            return None;
        }
        Some(Rule {
            full_key: full_key.to_owned(),
            redacted_key: full_key.to_owned(),
            spec: LimitSpec {
                requests_per_unit: rpu,
                unit,
                algorithm: f.algorithm,
                burst: f.burst.map(|(b, _)| b).unwrap_or(rpu),
            },
            unlimited: f.unlimited,
            name: f.name,
            replaces: f.replaces,
            shadow_mode: false,
            quota_mode: false,
            detailed_metric: false,
            value_to_metric: false,
            metadata: serde_json::Value::Null,
            file: self.file.to_path_buf(),
            line,
        })
    }

    /// Reads the block's fields; type errors are recorded and clear `ok`.
    fn rate_limit_fields<'y>(
        &mut self,
        pairs: &'y [(Yaml, Yaml)],
        line: usize,
    ) -> RateLimitFields<'y> {
        let mut f = RateLimitFields {
            requests_per_unit: Some(0),
            unit: None,
            unlimited: false,
            name: None,
            replaces: Vec::new(),
            replaces_line: line,
            algorithm: Algorithm::FixedWindow,
            burst: None,
            ok: true,
        };
        for (field, value, at) in self.check_keys(pairs, RATE_LIMIT_KEYS, "rate_limit") {
            match field {
                "requests_per_unit" => f.requests_per_unit = self.uint32(value, field),
                "unit" => f.unit = self.string(value, field).map(|u| (value, u)),
                "unlimited" => f.unlimited = self.boolean(value, field),
                "name" => f.name = self.string(value, field).filter(|n| !n.is_empty()),
                "replaces" => {
                    f.replaces_line = at;
                    f.ok &= self.load_replaces(value, &mut f.replaces);
                }
                "algorithm" => match self.string(value, field).map(|a| a.parse::<Algorithm>()) {
                    Some(Ok(a)) => f.algorithm = a,
                    Some(Err(e)) => {
                        self.error(value.line, e);
                        f.ok = false;
                    }
                    None => f.ok = false,
                },
                "burst" => match self.uint32(value, field) {
                    Some(b) => f.burst = Some((b, at)),
                    None => f.ok = false,
                },
                _ => {}
            }
        }
        f
    }

    /// The unit: required unless unlimited, and refused with unlimited (as
    /// the reference does). An unlimited rule counts nothing, so its unit is
    /// never used.
    fn unit(&mut self, f: &RateLimitFields, line: usize, full_key: &str) -> Option<Unit> {
        match (&f.unit, f.unlimited) {
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
                Some(Unit::Second)
            }
            (_, true) => Some(Unit::Second),
            (Some((at, u)), false) => match u.parse::<Unit>() {
                Ok(u) => Some(u),
                Err(e) => {
                    self.error(at.line, e);
                    None
                }
            },
            (None, false) => {
                self.error(line, format!("invalid rate limit unit '' in '{full_key}' (unit is required unless unlimited is true)"));
                None
            }
        }
    }

    /// Fields valid alone but not together; false when any was found.
    fn check_combinations(&mut self, f: &RateLimitFields, full_key: &str) -> bool {
        let mut ok = true;
        if let Some(own) = &f.name {
            if f.replaces.iter().any(|r| r == own) {
                self.error(
                    f.replaces_line,
                    format!(
                        "replaces should not contain the rule's own name '{own}' in '{full_key}'"
                    ),
                );
                ok = false;
            }
        }
        if let Some((_, at)) = f.burst {
            if f.algorithm != Algorithm::TokenBucket {
                self.error(
                    at,
                    format!("burst is only valid with algorithm token_bucket in '{full_key}'"),
                );
                ok = false;
            }
        }
        ok
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

/// A `rate_limit` block's fields as read.
struct RateLimitFields<'y> {
    /// None when present but not a valid u32 (already reported).
    requests_per_unit: Option<u32>,
    /// The node (for its line) and the text.
    unit: Option<(&'y Yaml, String)>,
    unlimited: bool,
    name: Option<String>,
    replaces: Vec<String>,
    replaces_line: usize,
    algorithm: Algorithm,
    /// The value and the line of `burst`.
    burst: Option<(u32, usize)>,
    /// No type error so far.
    ok: bool,
}
