//! Request validation, by hand: the rules Envoy's proto annotations carried
//! (at least one descriptor, at least one entry, non-empty keys, a defined
//! override unit) plus size bounds, so a hostile request cannot make the
//! server allocate or hash unbounded input. A request that fails here charges
//! nothing.
//!
//! Only what Envoy's configuration decides is refused: the domain, the
//! number of descriptors and entries, the entry keys. Values come from
//! clients (headers, addresses), and an error would make Envoy fail open
//! (`failure_mode_deny: false`) for whoever sends a long one, so any value
//! is accepted and a long one is counted under its digest
//! ([`crate::key::MAX_RAW_VALUE_BYTES`]). The message size itself is capped
//! before decoding, by the servers.

use crate::decision::{Descriptor, Request};
use crate::proto::rls::RateLimitRequest;

/// Size bounds on one request.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub max_descriptors: usize,
    pub max_entries: usize,
    /// Bytes in a domain or an entry key (values are not bounded here: a
    /// long one is counted under its digest).
    pub max_entry_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_descriptors: 64,
            max_entries: 32,
            max_entry_bytes: 4096,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ValidationError {
    #[error("rate limit domain must not be empty")]
    EmptyDomain,
    #[error("rate limit domain is {0} bytes, more than the limit of {1}")]
    DomainTooLong(usize, usize),
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
    #[error("{0} descriptors, more than the limit of {1}")]
    TooManyDescriptors(usize, usize),
    #[error("descriptor {0} has no entries")]
    NoEntries(usize),
    #[error("descriptor {0} has {1} entries, more than the limit of {2}")]
    TooManyEntries(usize, usize, usize),
    #[error("descriptor {0} entry {1} has an empty key")]
    EmptyKey(usize, usize),
    #[error("descriptor {0} entry {1}: key is {2} bytes, more than the limit of {3}")]
    KeyTooLong(usize, usize, usize, usize),
    #[error("descriptor {0}: limit override has unit {1}; use SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR")]
    BadOverrideUnit(usize, String),
}

/// Validates a request and moves it into domain types.
pub fn to_domain(req: RateLimitRequest, bounds: &Bounds) -> Result<Request, ValidationError> {
    if req.domain.is_empty() {
        return Err(ValidationError::EmptyDomain);
    }
    if req.domain.len() > bounds.max_entry_bytes {
        return Err(ValidationError::DomainTooLong(
            req.domain.len(),
            bounds.max_entry_bytes,
        ));
    }
    if req.descriptors.is_empty() {
        return Err(ValidationError::NoDescriptors);
    }
    if req.descriptors.len() > bounds.max_descriptors {
        return Err(ValidationError::TooManyDescriptors(
            req.descriptors.len(),
            bounds.max_descriptors,
        ));
    }
    let mut descriptors = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.into_iter().enumerate() {
        if d.entries.is_empty() {
            return Err(ValidationError::NoEntries(i));
        }
        if d.entries.len() > bounds.max_entries {
            return Err(ValidationError::TooManyEntries(
                i,
                d.entries.len(),
                bounds.max_entries,
            ));
        }
        let mut entries = Vec::with_capacity(d.entries.len());
        for (j, e) in d.entries.into_iter().enumerate() {
            if e.key.is_empty() {
                return Err(ValidationError::EmptyKey(i, j));
            }
            if e.key.len() > bounds.max_entry_bytes {
                return Err(ValidationError::KeyTooLong(
                    i,
                    j,
                    e.key.len(),
                    bounds.max_entry_bytes,
                ));
            }
            entries.push((e.key, e.value));
        }
        let limit_override = match d.limit {
            None => None,
            Some(o) => match super::unit_from_wire(o.unit) {
                Some(unit) => Some((o.requests_per_unit, unit)),
                None => {
                    let name = match o.unit {
                        0 => "UNKNOWN".to_string(),
                        n => n.to_string(),
                    };
                    return Err(ValidationError::BadOverrideUnit(i, name));
                }
            },
        };
        descriptors.push(Descriptor {
            entries,
            limit_override,
            hits: d.hits_addend,
            refund: d.is_negative_hits,
        });
    }
    Ok(Request {
        domain: req.domain,
        descriptors,
        hits_addend: req.hits_addend,
    })
}

/// The first thing a request asks beyond charging hits: a refund
/// (`is_negative_hits`) or a request `limit` override. Either lets a caller
/// rewrite counts (reset its own counter, or give a key a limit of its
/// choosing), so each listener refuses them unless its setting allows
/// them; `None` for a plain charge.
pub fn adjustment(req: &Request) -> Option<String> {
    req.descriptors.iter().enumerate().find_map(|(i, d)| {
        if d.refund {
            Some(format!("descriptor {i} is a refund (is_negative_hits)"))
        } else if d.limit_override.is_some() {
            Some(format!("descriptor {i} carries a limit override"))
        } else {
            None
        }
    })
}
