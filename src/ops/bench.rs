//! `leasehold bench`: a closed-loop load generator. C callers share N HTTP/2
//! connections; each caller sends one ShouldRateLimit, waits for the answer,
//! and sends the next, for a fixed duration. Latency goes into an HDR
//! histogram per caller, merged at the end.

use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use tonic::transport::{Channel, Endpoint};

use super::http_client::endpoint_uri;
use crate::proto::common::rate_limit_descriptor::Entry;
use crate::proto::common::RateLimitDescriptor;
use crate::proto::rls::rate_limit_response::Code;
use crate::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use crate::proto::rls::RateLimitRequest;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Server address, host:port or http://host:port.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub addr: String,
    /// Rate-limit domain.
    #[arg(long)]
    pub domain: String,
    /// Descriptor key; values are spread over `--keys` distinct values.
    #[arg(long, default_value = "key")]
    pub key: String,
    /// Distinct descriptor values (1 = one hot key).
    #[arg(long, default_value_t = 1)]
    pub keys: u64,
    /// Calls in flight.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// HTTP/2 connections the callers share.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Pad every value to this many bytes (0: as generated).
    #[arg(long, default_value_t = 0)]
    pub value_bytes: usize,
    /// Every call a value never sent before (ignores --keys).
    #[arg(long)]
    pub unique: bool,
    /// Stop after this many calls in all (0: run for --duration only).
    #[arg(long, default_value_t = 0)]
    pub requests: u64,
    /// Hits per call (request hits_addend).
    #[arg(long, default_value_t = 1)]
    pub hits: u32,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What a run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub requests: u64,
    pub ok: u64,
    pub over_limit: u64,
    pub errors: u64,
    pub seconds: f64,
    pub requests_per_second: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    pub first_error: Option<String>,
}

struct CallerResult {
    hist: Histogram<u64>,
    ok: u64,
    over: u64,
    errors: u64,
    first_error: Option<String>,
}

pub async fn measure(args: &BenchArgs) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(
        args.concurrency > 0 && args.connections > 0 && args.keys > 0,
        "concurrency, connections and keys must be positive"
    );
    anyhow::ensure!(args.duration > 0.0, "duration must be positive");
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let ch: Channel = Endpoint::from_shared(endpoint_uri(&args.addr))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        channels.push(ch);
    }
    let run_for = Duration::from_secs_f64(args.duration);
    let start = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    let template = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for i in 0..args.concurrency {
        let client = RateLimitServiceClient::new(channels[i % channels.len()].clone());
        callers.spawn(caller(
            i,
            client,
            args.clone(),
            template.clone(),
            start,
            run_for,
        ));
    }
    let mut total = template;
    let (mut ok, mut over, mut errors, mut first_error) = (0, 0, 0, None);
    while let Some(joined) = callers.join_next().await {
        let r = joined?;
        total.add(&r.hist)?;
        ok += r.ok;
        over += r.over;
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let requests = ok + over + errors;
    Ok(BenchReport {
        requests,
        ok,
        over_limit: over,
        errors,
        seconds,
        requests_per_second: requests as f64 / seconds,
        p50_us: total.value_at_quantile(0.50),
        p90_us: total.value_at_quantile(0.90),
        p99_us: total.value_at_quantile(0.99),
        p999_us: total.value_at_quantile(0.999),
        max_us: total.max(),
        first_error,
    })
}

/// One closed-loop caller: a call, its latency, the next call, until
/// `run_for` has passed since `start`.
async fn caller(
    i: usize,
    mut client: RateLimitServiceClient<Channel>,
    args: BenchArgs,
    hist: Histogram<u64>,
    start: Instant,
    run_for: Duration,
) -> CallerResult {
    let mut r = CallerResult {
        hist,
        ok: 0,
        over: 0,
        errors: 0,
        first_error: None,
    };
    // A per-caller xorshift spreads callers over the key space without a
    // shared counter.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1);
    // This caller's share of --requests.
    let quota = match args.requests {
        0 => u64::MAX,
        n => {
            n / args.concurrency.max(1) as u64
                + u64::from((i as u64) < n % args.concurrency.max(1) as u64)
        }
    };
    let mut sent = 0u64;
    while start.elapsed() < run_for && sent < quota {
        sent += 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut value = if args.unique {
            format!("u{i}-{sent}")
        } else if args.keys == 1 {
            "hot".to_string()
        } else {
            format!("k{}", x % args.keys)
        };
        if value.len() < args.value_bytes {
            value.extend(std::iter::repeat_n('v', args.value_bytes - value.len()));
        }
        let req = RateLimitRequest {
            domain: args.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: args.key.clone(),
                    value,
                }],
                ..Default::default()
            }],
            hits_addend: args.hits,
        };
        let t = Instant::now();
        let res = client.should_rate_limit(req).await;
        let us = t.elapsed().as_micros() as u64;
        let _ = r.hist.record(us.max(1));
        match res {
            Ok(resp) => match Code::try_from(resp.get_ref().overall_code) {
                Ok(Code::OverLimit) => r.over += 1,
                _ => r.ok += 1,
            },
            Err(s) => {
                r.errors += 1;
                r.first_error
                    .get_or_insert_with(|| format!("{}: {}", s.code(), s.message()));
            }
        }
    }
    r
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let r = measure(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "{} requests in {:.2}s: {:.0} requests/s\n  ok {}  over_limit {}  errors {}\n  latency p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  max {:.3} ms",
        r.requests,
        r.seconds,
        r.requests_per_second,
        r.ok,
        r.over_limit,
        r.errors,
        r.p50_us as f64 / 1e3,
        r.p90_us as f64 / 1e3,
        r.p99_us as f64 / 1e3,
        r.p999_us as f64 / 1e3,
        r.max_us as f64 / 1e3,
    );
    if let Some(e) = r.first_error {
        println!("  first error: {e}");
    }
    Ok(())
}
