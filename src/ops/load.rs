//! Paced load through the topology's two front doors, Envoy (HTTP) and nginx
//! (gRPC), recording one [`Sample`] per call: when it was sent and answered,
//! what the client saw and, for gRPC, the window the server reported and the
//! replica that answered. The samples are the raw facts the failover demo and
//! the topology tests judge; nothing here interprets them.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::proto::common::rate_limit_descriptor::Entry;
use crate::proto::common::RateLimitDescriptor;
use crate::proto::rls::rate_limit_response::Code;
use crate::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use crate::proto::rls::RateLimitRequest;

pub use crate::REPLICA_HEADER;

pub use super::http_client::{grpc_serving, HttpClient, HttpReply};

/// Which front door a call went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    Envoy,
    Nginx,
}

/// What the client saw.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Seen {
    /// Allowed with a rate-limit decision (HTTP 200 with x-ratelimit-limit, or gRPC OK).
    Admitted,
    /// Over the limit (HTTP 429 or gRPC OVER_LIMIT).
    Denied,
    /// HTTP 200 without rate-limit headers: Envoy could not reach any replica
    /// and failed open. Let through without a grant.
    FailOpen,
    /// Anything else: an HTTP status other than 200/429, a gRPC error, a timeout.
    Error(String),
}

/// One call.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub via: Via,
    /// Unix milliseconds when the call was sent and answered.
    pub sent_ms: u64,
    pub done_ms: u64,
    pub seen: Seen,
    /// gRPC only: the start (unix ms) of the window the server charged, from
    /// `duration_until_reset`.
    pub window_ms: Option<u64>,
    /// gRPC only: the replica that answered.
    pub replica: Option<String>,
}

impl Sample {
    /// The window (start, unix ms) this call is attributed to and whether
    /// that is certain: gRPC calls carry it; an HTTP call is certain when it
    /// was sent and answered within one window, away from its edges by more
    /// than [`CLOCK_SLACK_MS`].
    pub fn window(&self, unit_ms: u64) -> (u64, bool) {
        if let Some(w) = self.window_ms {
            return (w, true);
        }
        let sent = self.sent_ms.saturating_sub(CLOCK_SLACK_MS) / unit_ms;
        let done = (self.done_ms + CLOCK_SLACK_MS) / unit_ms;
        let mid = (self.sent_ms + self.done_ms) / 2 / unit_ms;
        (mid * unit_ms, sent == done)
    }

    /// Every window (start, unix ms) this call may have been charged in:
    /// one when [`Sample::window`] is certain, else each window from the
    /// send to the answer (widened by [`CLOCK_SLACK_MS`]). Judges give each of
    /// them a tolerance of one for this call.
    pub fn candidates(&self, unit_ms: u64) -> Vec<u64> {
        let (w, certain) = self.window(unit_ms);
        if certain {
            return vec![w];
        }
        let first = self.sent_ms.saturating_sub(CLOCK_SLACK_MS) / unit_ms;
        let last = (self.done_ms + CLOCK_SLACK_MS) / unit_ms;
        (first..=last).map(|i| i * unit_ms).collect()
    }
}

/// A replica deciding locally places a call in a window by its estimate of
/// Redis's clock (learned from replies), which can be a few milliseconds off
/// the client's: HTTP calls this close to a window edge are "uncertain".
pub const CLOCK_SLACK_MS: u64 = 10;

/// What to send.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Envoy ingress, e.g. http://127.0.0.1:10000
    pub envoy_url: String,
    /// nginx gRPC balancer, e.g. http://127.0.0.1:8090
    pub nginx_uri: String,
    /// The rate-limit domain for gRPC calls (Envoy has its own).
    pub domain: String,
    /// The `user` both paths send (header x-user / descriptor entry).
    pub user: String,
    pub path: String,
    /// Calls per second through each door.
    pub envoy_rate: u32,
    pub nginx_rate: u32,
    /// Concurrent callers per door.
    pub workers: u32,
    /// The rule's window, for attributing gRPC answers.
    pub unit_ms: u64,
}

/// Load in progress.
pub struct Load {
    stop: watch::Sender<bool>,
    workers: Vec<JoinHandle<()>>,
    collector: JoinHandle<Vec<Sample>>,
}

impl Load {
    /// Starts the callers; every sample also goes to `tap` when given (for a
    /// live timeline).
    pub fn start(spec: LoadSpec, tap: Option<mpsc::UnboundedSender<Sample>>) -> Load {
        let (stop, stopped) = watch::channel(false);
        let (tx, mut rx) = mpsc::unbounded_channel::<Sample>();
        let spec = Arc::new(spec);
        let http = HttpClient::new();
        let mut workers = Vec::new();
        for door in [Via::Envoy, Via::Nginx] {
            let rate = match door {
                Via::Envoy => spec.envoy_rate,
                Via::Nginx => spec.nginx_rate,
            };
            if rate == 0 {
                continue;
            }
            let n = spec.workers.max(1);
            for w in 0..n {
                let period = Duration::from_secs_f64(f64::from(n) / f64::from(rate));
                // Stagger the workers across one period so the doors see an
                // even stream rather than bursts.
                let offset = period.mul_f64(f64::from(w) / f64::from(n));
                let (spec, tx, mut stopped, http) =
                    (spec.clone(), tx.clone(), stopped.clone(), http.clone());
                workers.push(tokio::spawn(async move {
                    tokio::time::sleep(offset).await;
                    let mut grpc = None;
                    let mut tick = tokio::time::interval(period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tokio::select! {
                            _ = tick.tick() => {}
                            _ = stopped.changed() => break,
                        }
                        if *stopped.borrow() {
                            break;
                        }
                        let sample = match door {
                            Via::Envoy => envoy_call(&http, &spec).await,
                            Via::Nginx => nginx_call(&mut grpc, &spec).await,
                        };
                        if tx.send(sample).is_err() {
                            break;
                        }
                    }
                }));
            }
        }
        drop(tx);
        let collector = tokio::spawn(async move {
            let mut all = Vec::new();
            while let Some(s) = rx.recv().await {
                if let Some(tap) = &tap {
                    let _ = tap.send(s.clone());
                }
                all.push(s);
            }
            all
        });
        Load {
            stop,
            workers,
            collector,
        }
    }

    /// Stops the callers, waits for the calls in flight and returns every sample.
    pub async fn finish(self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        for w in self.workers {
            let _ = w.await;
        }
        self.collector.await.unwrap_or_default()
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

async fn envoy_call(http: &HttpClient, spec: &LoadSpec) -> Sample {
    let sent_ms = unix_ms();
    let url = format!("{}{}", spec.envoy_url, spec.path);
    let seen = match http.get(&url, &[("x-user", &spec.user)]).await {
        Ok(r) if r.status == 200 && r.header("x-ratelimit-limit").is_some() => Seen::Admitted,
        Ok(r) if r.status == 200 => Seen::FailOpen,
        Ok(r) if r.status == 429 => Seen::Denied,
        Ok(r) => Seen::Error(format!("http {}", r.status)),
        Err(e) => Seen::Error(format!("{e:#}")),
    };
    Sample {
        via: Via::Envoy,
        sent_ms,
        done_ms: unix_ms(),
        seen,
        window_ms: None,
        replica: None,
    }
}

async fn nginx_call(
    client: &mut Option<RateLimitServiceClient<Channel>>,
    spec: &LoadSpec,
) -> Sample {
    let sent_ms = unix_ms();
    let mut sample = Sample {
        via: Via::Nginx,
        sent_ms,
        done_ms: sent_ms,
        seen: Seen::Error("not sent".into()),
        window_ms: None,
        replica: None,
    };
    if client.is_none() {
        match Channel::from_shared(spec.nginx_uri.clone()) {
            Ok(ep) => {
                // Lazy: a refused connection becomes this call's error, and
                // the channel reconnects by itself afterwards.
                *client = Some(RateLimitServiceClient::new(
                    ep.connect_timeout(Duration::from_secs(1)).connect_lazy(),
                ));
            }
            Err(e) => {
                sample.seen = Seen::Error(e.to_string());
                return sample;
            }
        }
    }
    let Some(c) = client.as_mut() else {
        return sample;
    };
    let req = RateLimitRequest {
        domain: spec.domain.clone(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: spec.user.clone(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let mut request = tonic::Request::new(req);
    request.set_timeout(Duration::from_secs(2));
    let result = c.should_rate_limit(request).await;
    sample.done_ms = unix_ms();
    match result {
        Ok(resp) => {
            sample.replica = resp
                .metadata()
                .get(REPLICA_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let resp = resp.into_inner();
            sample.seen = if resp.overall_code == Code::OverLimit as i32 {
                Seen::Denied
            } else {
                Seen::Admitted
            };
            if let Some(d) = resp
                .statuses
                .first()
                .and_then(|s| s.duration_until_reset.as_ref())
            {
                let reset_ms = d.seconds.max(0) as u64 * 1000 + d.nanos.max(0) as u64 / 1_000_000;
                // Window ends are multiples of the unit; rounding removes the
                // call's latency from the estimate.
                let end =
                    (sample.done_ms + reset_ms + spec.unit_ms / 2) / spec.unit_ms * spec.unit_ms;
                sample.window_ms = Some(end.saturating_sub(spec.unit_ms));
            }
        }
        Err(status) => {
            sample.seen = Seen::Error(format!("grpc {:?}: {}", status.code(), status.message()));
        }
    }
    sample
}
