//! Conversion between Envoy's RLS v3 wire forms and the decision layer's
//! types, shared by both transports: units and codes (one mapping each),
//! request validation with size bounds ([`validate`]), the response message,
//! and the protojson forms of `POST /json` ([`json`]). No I/O and no
//! transport types: gRPC and HTTP only move bytes in and out of it.

pub mod json;
pub mod validate;

use std::time::Duration;

use crate::decision::{Code, Decision};
use crate::limit::Unit;
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::rls::rate_limit_response::{
    rate_limit::Unit as ResponseUnit, Code as WireCode, DescriptorStatus, RateLimit,
};
use crate::proto::rls::RateLimitResponse;

pub use validate::{adjustment, to_domain, Bounds};

/// A unit number as requests carry it (`envoy.type.v3.RateLimitUnit`);
/// `None` for UNKNOWN and undefined numbers.
pub fn unit_from_wire(value: i32) -> Option<Unit> {
    match RateLimitUnit::try_from(value).ok()? {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Week => Some(Unit::Week),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}

/// A unit's number by its protojson name ("MINUTE", any case).
pub fn unit_number(name: &str) -> Option<i32> {
    RateLimitUnit::from_str_name(&name.to_ascii_uppercase()).map(|u| u as i32)
}

/// A unit as responses carry it (the same numbers, another enum).
pub fn unit_to_wire(unit: Unit) -> ResponseUnit {
    match unit {
        Unit::Second => ResponseUnit::Second,
        Unit::Minute => ResponseUnit::Minute,
        Unit::Hour => ResponseUnit::Hour,
        Unit::Day => ResponseUnit::Day,
        Unit::Week => ResponseUnit::Week,
        Unit::Month => ResponseUnit::Month,
        Unit::Year => ResponseUnit::Year,
    }
}

pub fn code_to_wire(code: Code) -> WireCode {
    match code {
        Code::Ok => WireCode::Ok,
        Code::OverLimit => WireCode::OverLimit,
    }
}

/// The protojson name of a code ("OK", "OVER_LIMIT").
pub fn code_name(code: Code) -> &'static str {
    code_to_wire(code).as_str_name()
}

/// The protojson name of a wire code number ("UNKNOWN" when undefined).
pub fn wire_code_name(code: i32) -> &'static str {
    WireCode::try_from(code).map_or("UNKNOWN", |c| c.as_str_name())
}

/// Decision → RateLimitResponse.
pub fn to_response(decision: Decision) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code_to_wire(decision.overall) as i32,
        statuses: decision
            .statuses
            .into_iter()
            .map(|s| DescriptorStatus {
                code: code_to_wire(s.code) as i32,
                current_limit: s.current_limit.map(|l| RateLimit {
                    name: l.name,
                    requests_per_unit: l.requests_per_unit,
                    unit: unit_to_wire(l.unit) as i32,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.reset_ms.map(|ms| {
                    let d = Duration::from_millis(ms);
                    prost_types::Duration {
                        seconds: d.as_secs() as i64,
                        nanos: d.subsec_nanos() as i32,
                    }
                }),
                quota: None,
            })
            .collect(),
        response_headers_to_add: decision
            .headers
            .into_iter()
            .map(|(key, value)| header(key, value))
            .collect(),
        ..Default::default()
    }
}

/// A response header for Envoy to add.
pub fn header(key: String, value: String) -> HeaderValue {
    HeaderValue {
        key,
        value,
        raw_value: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_round_trips_through_numbers_and_names() {
        for unit in Unit::ALL {
            let n = unit_to_wire(unit) as i32;
            assert_eq!(unit_from_wire(n), Some(unit), "{unit:?}");
            assert_eq!(unit_number(unit.as_str()), Some(n), "{unit:?} by name");
        }
        assert_eq!(unit_from_wire(0), None);
        assert_eq!(unit_from_wire(8), None);
        assert_eq!(unit_number("UNKNOWN"), Some(0));
        assert_eq!(unit_number("fortnight"), None);
        assert_eq!(code_name(Code::OverLimit), "OVER_LIMIT");
        assert_eq!(wire_code_name(99), "UNKNOWN");
    }
}
