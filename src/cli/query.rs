//! `leasehold query`: one ShouldRateLimit call, printed for people.

use clap::Args;

use crate::proto::common::rate_limit_descriptor::Entry;
use crate::proto::common::RateLimitDescriptor;
use crate::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use crate::proto::rls::{RateLimitRequest, RateLimitResponse};

#[derive(Args, Debug)]
pub struct QueryArgs {
    /// Server address, host:port or http://host:port.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub addr: String,
    /// Rate-limit domain.
    #[arg(long)]
    pub domain: String,
    /// Hits to add (request hits_addend).
    #[arg(long, default_value_t = 0)]
    pub hits: u32,
    /// Descriptors, one per argument: KEY=VALUE[,KEY=VALUE]...
    #[arg(required = true, value_name = "KEY=VALUE[,KEY=VALUE]...")]
    pub descriptors: Vec<String>,
}

/// Parses `k=v,k2=v2` into a descriptor. A value may contain '=' (only the
/// first splits); an entry without '=' has an empty value.
pub fn parse_descriptor(text: &str) -> Result<RateLimitDescriptor, String> {
    let entries = text
        .split(',')
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k.is_empty() {
                return Err(format!(
                    "descriptor '{text}' has an entry with an empty key"
                ));
            }
            Ok(Entry {
                key: k.to_owned(),
                value: v.to_owned(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RateLimitDescriptor {
        entries,
        ..Default::default()
    })
}

pub use crate::ops::http_client::endpoint_uri;

pub async fn run(args: QueryArgs) -> anyhow::Result<()> {
    let descriptors = args
        .descriptors
        .iter()
        .map(|d| parse_descriptor(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut client = RateLimitServiceClient::connect(endpoint_uri(&args.addr)).await?;
    let response = client
        .should_rate_limit(RateLimitRequest {
            domain: args.domain.clone(),
            descriptors,
            hits_addend: args.hits,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))?
        .into_inner();
    print!("{}", render(&args.descriptors, &response));
    Ok(())
}

/// Human-readable decision.
pub fn render(descriptors: &[String], r: &RateLimitResponse) -> String {
    let mut out = format!("overall: {}\n", crate::rls::wire_code_name(r.overall_code));
    for (i, s) in r.statuses.iter().enumerate() {
        let what = descriptors.get(i).map(String::as_str).unwrap_or("?");
        out.push_str(&format!(
            "  [{i}] {what}: {}",
            crate::rls::wire_code_name(s.code)
        ));
        if let Some(l) = &s.current_limit {
            let unit = crate::rls::unit_from_wire(l.unit)
                .map(|u| u.as_str())
                .unwrap_or("unknown");
            out.push_str(&format!(
                " limit={}/{unit} remaining={}",
                l.requests_per_unit, s.limit_remaining
            ));
            if !l.name.is_empty() {
                out.push_str(&format!(" name={}", l.name));
            }
        } else if s.limit_remaining == u32::MAX {
            out.push_str(" unlimited");
        } else {
            out.push_str(" no limit");
        }
        if let Some(d) = &s.duration_until_reset {
            out.push_str(&format!(
                " reset_in={:.3}s",
                d.seconds as f64 + f64::from(d.nanos) / 1e9
            ));
        }
        out.push('\n');
    }
    for h in &r.response_headers_to_add {
        out.push_str(&format!("  header {}: {}\n", h.key, h.value));
    }
    out
}
