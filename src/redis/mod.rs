//! The only module that knows fred: connection pool, the Lua scripts (loaded
//! once, called by SHA, reloaded transparently after NOSCRIPT), per-call
//! deadlines and membership heartbeats. Callers get domain values and a
//! [`CallError`] that says whether the call may have been applied.
//!
//! Every call carries a token of its own (the last ARGV of a script, the
//! message of a PING) that its reply must end with. fred pairs replies with
//! calls by order on a connection, so a path that swallowed a call but
//! kept the connection open would otherwise hand each later reply to the
//! call before it. A reply without its call's token takes the connection
//! out of service: it is closed and replaced, and the call counts as
//! possibly applied. A connection on which a call has gone the reply
//! timeout without any reply is replaced too (fred's unresponsive check),
//! and a recovering replica PINGs every connection before it decides on
//! Redis again ([`Redis::check_connections`]).

mod batch;
pub mod inspect;
pub mod keys;
pub mod membership;
pub mod migrate;
pub mod scripts;
pub mod tls;
pub mod topology;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;

pub use crate::domain::backend::CallError;
use fred::types::config::{Options, ReconnectPolicy, TcpConfig, UnresponsiveConfig};
pub use scripts::{decide_sha, replay_sha};
use scripts::{DECIDE_LUA, MEMBERS_LUA, REPLAY_LUA};

/// Connection settings.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// redis://[user:password@]host:port[/db] or rediss:// for TLS.
    pub url: String,
    pub pool_size: usize,
    /// How long a decision call keeps trying to reach a connection: a call
    /// that has not left by then provably never ran.
    pub deadline: Duration,
    /// How long a decision call that left waits for its reply (the caller
    /// decides without it much sooner, see the resilient engine's budget).
    pub reply_timeout: Duration,
    /// CA and client certificate for `rediss://`.
    pub tls: tls::RedisTls,
}

struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    fn new(source: &'static str) -> Self {
        Script {
            source,
            sha: fred::util::sha1_hash(source),
        }
    }
}

/// A pool of pipelined connections to one Redis.
pub struct Redis {
    pool: Pool,
    /// Where batches and reconnections run (see [`crate::tasks`]).
    home: crate::tasks::Home,
    config: Config,
    deadline: Duration,
    reply_timeout: Duration,
    decide: Script,
    members: Script,
    replay: Script,
    migrate: Script,
    lock: Script,
    /// The next call's token (see the module docs).
    tokens: AtomicU64,
    /// Decision calls waiting for their connection ([`batch`]).
    queues: batch::Queues,
    /// Script calls that carried decisions, and the decisions they carried.
    batches: AtomicU64,
    batched: AtomicU64,
    /// Decision calls Redis has answered, a Cluster's refusal of one for a
    /// slot being moved included ([`Redis::heard`]).
    heard: AtomicU64,
    /// Slots refused as moving, and since when ([`MovingSlots`]).
    moving: MovingSlots,
    /// The URL with any password replaced, for logs.
    pub display_url: String,
    /// Failed calls per node ([`topology`]).
    node_failures: parking_lot::Mutex<std::collections::HashMap<String, u64>>,
    /// Restarts pool clients that stopped ([`supervise`]); stopped by
    /// [`Redis::quit`] and on drop.
    supervisor: tokio::task::JoinHandle<()>,
    /// Pool clients restarted so far.
    restarts: Arc<AtomicU64>,
    /// Redis's configured hz as last read ([`Redis::configured_hz`]), 0
    /// until read.
    hz: AtomicU64,
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.supervisor.abort();
    }
}

/// How often [`supervise`] looks at the pool's clients.
const SUPERVISE_EVERY: Duration = Duration::from_millis(100);

/// Starts again any pool client whose connection task has ended. fred ends
/// it for good when it cannot follow a redirection or read a Cluster's
/// slot map (it used to on every ASK, when fred still followed them with
/// no attempt left): without a restart, every later call on that client
/// would wait unanswered until its deadline.
fn supervise(
    clients: Vec<Client>,
    mut handles: Vec<fred::types::ConnectHandle>,
    restarts: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SUPERVISE_EVERY);
        loop {
            tick.tick().await;
            for (client, handle) in clients.iter().zip(handles.iter_mut()) {
                if handle.is_finished() {
                    tracing::warn!(
                        client = client.id(),
                        "a Redis client stopped (a redirection or a slot map it could not follow); starting it again"
                    );
                    restarts.fetch_add(1, Ordering::Relaxed);
                    *handle = client.connect();
                }
            }
        }
    })
}

/// The URL schemes `redis_url` accepts (fred's): one Redis, a Cluster (any
/// node seeds the topology) or a primary behind Sentinel, each plain or TLS.
pub const URL_SCHEMES: [&str; 6] = [
    "redis://",
    "rediss://",
    "redis-cluster://",
    "rediss-cluster://",
    "redis-sentinel://",
    "rediss-sentinel://",
];

/// Whether the URL asks for TLS (`rediss…://`).
pub fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss")
}

/// Whether a URL is well formed for fred: a known scheme and what its
/// topology needs (a Sentinel service name, say). The error names the URL
/// with its passwords redacted.
pub fn check_url(url: &str) -> Result<(), String> {
    if !URL_SCHEMES.iter().any(|s| url.starts_with(s)) {
        return Err(format!(
            "'{}' must start with one of {}",
            redact_url(url),
            URL_SCHEMES.join(", ")
        ));
    }
    Config::from_url(url).map(|_| ()).map_err(|e| {
        format!(
            "'{}' is not a valid Redis URL: {}",
            redact_url(url),
            e.details()
        )
    })
}

/// The URL with every password replaced by `***`: the one in the
/// authority (`user:password@`, or a lone `password@`) and any query
/// parameter whose name contains "password" (`sentinelPassword`). The
/// authority ends at the last `@` before the query's first `=`, so a
/// password with a `?` or `/` in it is hidden too; without a scheme
/// everything up to the last `@` is.
pub fn redact_url(url: &str) -> String {
    let after = url.find("://").map_or(0, |s| s + 3);
    let rest = &url[after..];
    let params_from = rest.find('=').unwrap_or(rest.len());
    let at = rest[..params_from].rfind('@');
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..after]);
    let tail = match at {
        Some(at) => {
            match rest[..at].split_once(':') {
                Some((user, _)) if after > 0 => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                _ => out.push_str("***"),
            }
            &rest[at..]
        }
        None => rest,
    };
    let (host, query) = match tail.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (tail, None),
    };
    out.push_str(host);
    if let Some(query) = query {
        out.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                    format!("{name}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out.push_str(&pairs.join("&"));
    }
    out
}

impl Redis {
    /// Builds the pool and starts connecting in the background; never waits
    /// for Redis, so a Redis that is down at startup does not stop the
    /// server from starting.
    pub fn connect(cfg: &RedisConfig) -> Result<Redis, String> {
        let config = Config::from_url(&cfg.url)
            .map_err(|e| format!("invalid Redis URL {}: {e}", redact_url(&cfg.url)))?;
        let mut config = Config {
            fail_fast: false,
            ..config
        };
        if config.tls.is_some() && !cfg.tls.is_default() {
            config.tls = Some(fred::types::config::TlsConfig::from(
                cfg.tls.client_config()?,
            ));
        }
        let mut builder = Builder::from_config(config.clone());
        let reply_timeout = cfg.reply_timeout.max(cfg.deadline);
        builder.with_connection_config(|c| {
            // A connect that has not completed in a second is abandoned and
            // tried afresh (below), so after a black hole heals a new SYN
            // goes out within about a second, not after TCP's backoff.
            c.connection_timeout = Duration::from_secs(1);
            // The same for the handshake on a new connection (HELLO or
            // PING, SELECT, CLIENT ID, INFO): a path that swallows it is
            // given up on as soon as a call's reply would be.
            c.internal_command_timeout = reply_timeout;
            // A connection on which a call has waited past the reply timeout
            // is not trusted again: it is closed and replaced. Packets a
            // black hole dropped would otherwise be retransmitted only
            // after TCP's backoff (seconds), and bytes a broken path
            // swallowed would leave replies out of step with calls.
            c.unresponsive = UnresponsiveConfig {
                max_timeout: Some(reply_timeout),
                interval: (reply_timeout / 4).max(Duration::from_millis(10)),
            };
            // Never resend a script on reconnect: a resent call could count twice.
            c.max_command_attempts = 1;
            // No Cluster redirection followed by fred: the write after a
            // MOVED would be a second attempt, failed as if the call might
            // have run, and a script's declared keys are never all on the
            // target of an ASK (its base keys are never written), where it
            // would only get TRYAGAIN. The call comes back refused instead
            // (after MOVED with the new slot map read) and is sent again
            // (`eval`). Set here: fred takes a command's 0 for "the default".
            c.max_redirections = 0;
            // Pipelined calls are small writes: Nagle's algorithm would hold
            // one behind the delayed ACK of the previous (40 ms).
            c.tcp = TcpConfig {
                nodelay: Some(true),
                ..Default::default()
            };
        });
        builder.set_policy(ReconnectPolicy::new_exponential(0, 50, 250, 2));
        let pool = builder
            .build_pool(cfg.pool_size.max(1))
            .map_err(|e| format!("cannot build Redis pool: {e}"))?;
        let restarts = Arc::new(AtomicU64::new(0));
        let supervisor = supervise(
            pool.clients().to_vec(),
            pool.connect_pool(),
            restarts.clone(),
        );
        let cluster = config.server.is_clustered();
        Ok(Redis {
            pool,
            config,
            deadline: cfg.deadline,
            reply_timeout,
            decide: Script::new(DECIDE_LUA),
            members: Script::new(MEMBERS_LUA),
            replay: Script::new(REPLAY_LUA),
            migrate: Script::new(migrate::MIGRATE_LUA),
            lock: Script::new(migrate::LOCK_LUA),
            tokens: AtomicU64::new(1),
            queues: batch::Queues::new(cfg.pool_size, cluster),
            home: crate::tasks::Home::here(),
            batches: AtomicU64::new(0),
            batched: AtomicU64::new(0),
            heard: AtomicU64::new(0),
            moving: MovingSlots::default(),
            display_url: redact_url(&cfg.url),
            node_failures: Default::default(),
            supervisor,
            restarts,
            hz: AtomicU64::new(0),
        })
    }

    /// How many decision calls Redis has answered so far, refusals for a
    /// slot being moved included: a Cluster moving a slot is answering,
    /// not silent, even while the calls for that slot wait for it. (Not a
    /// heartbeat's answer: on a Cluster it may come from another node.)
    pub fn heard(&self) -> u64 {
        self.heard.load(Ordering::Relaxed)
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Whether this is a Redis Cluster (calls must keep to one slot each).
    pub fn is_cluster(&self) -> bool {
        self.config.server.is_clustered()
    }

    /// PING with a timeout; the error text says what went wrong (refused,
    /// authentication, not a Redis server, timeout).
    pub async fn ping(&self, timeout: Duration) -> Result<(), String> {
        let carrier = self.pool.next();
        let result = match self.ping_on(carrier, timeout).await {
            Ok(()) => return Ok(()),
            Err(CallError::Timeout(_)) => {
                replace(&self.home, carrier);
                format!("no answer within {timeout:?}")
            }
            Err(e @ CallError::Reply(_)) => {
                replace(&self.home, carrier);
                format!("{e} (connection replaced)")
            }
            Err(e) => e.to_string(),
        };
        Err(match self.diagnose(timeout).await {
            Some(cause) => format!("{result}; a direct connection attempt says: {cause}"),
            None => result,
        })
    }

    /// Redis's configured `hz` (`INFO server`, from one node of a
    /// Cluster), within `timeout`; None when it cannot be read (no answer,
    /// or INFO not allowed to this user). Its active expiry cycle runs up
    /// to a quarter of each 1000/hz ms period at once (25 ms at the
    /// default hz of 10), and a call waits behind it. Kept for
    /// [`Redis::hz`].
    pub async fn configured_hz(&self, timeout: Duration) -> Option<u64> {
        let info = self
            .pool
            .next()
            .info::<String>(Some(fred::types::InfoKind::Server));
        let text = tokio::time::timeout(timeout, info).await.ok()?.ok()?;
        let hz = parse_hz(&text)?;
        self.hz.store(hz, Ordering::Relaxed);
        Some(hz)
    }

    /// Redis's hz as last read, None until read.
    pub fn hz(&self) -> Option<u64> {
        Some(self.hz.load(Ordering::Relaxed)).filter(|&hz| hz > 0)
    }

    /// PINGs every connected connection of the pool at once, each with its
    /// own token; one that does not answer within `timeout`, or answers out
    /// of step, is replaced (see the module docs) before this returns, so a
    /// recovering replica does not go back to Redis with a connection that
    /// sat idle through a fault and stalled. A connection being (re)made is
    /// skipped: its handshake proves it. Ok when at least one answered.
    pub async fn check_connections(&self, timeout: Duration) -> Result<(), CallError> {
        if self.is_cluster() {
            // Off Redis anyway: learn the slot map afresh first. After a
            // failover, a client that reconnected while the old master was
            // still listed would otherwise keep calling it.
            let syncs = self.pool.clients().iter().map(|carrier| async move {
                if let Ok(Err(e)) = tokio::time::timeout(timeout, carrier.sync_cluster()).await {
                    tracing::debug!(error = %e, "refreshing the cluster's slot map");
                }
            });
            futures::future::join_all(syncs).await;
        }
        let pings = self.pool.clients().iter().map(|carrier| async move {
            if !carrier.is_connected() {
                return Err(CallError::NotConnected(format!(
                    "{} ({:?})",
                    self.display_url,
                    carrier.state()
                )));
            }
            let result = self.ping_on(carrier, timeout).await;
            if matches!(result, Err(CallError::Timeout(_) | CallError::Reply(_))) {
                let _ = tokio::time::timeout(timeout, carrier.force_reconnection()).await;
            }
            result
        });
        let results = futures::future::join_all(pings).await;
        if results.iter().any(Result::is_ok) {
            return Ok(());
        }
        Err(results
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_else(|| CallError::NotConnected(self.display_url.clone())))
    }

    /// One PING on `carrier` with a token of its own as the message: Ok only
    /// when that token comes back within `timeout` (a reply out of step is
    /// `Reply`, silence `Timeout`). The caller decides what to replace.
    async fn ping_on(&self, carrier: &Client, timeout: Duration) -> Result<(), CallError> {
        // The timeout is ours, not fred's: a PING that gets no answer must
        // read as silence, which replaces the connection.
        let client = carrier.with_options(&Options {
            max_attempts: Some(1),
            ..Default::default()
        });
        let token = self.tokens.fetch_add(1, Ordering::Relaxed).to_string();
        let pong = client.ping::<Value>(Some(token.clone()));
        match tokio::time::timeout(timeout, pong).await {
            Ok(Ok(v)) if echoes(&v, &token) => Ok(()),
            Ok(Ok(other)) => Err(CallError::Reply(format!(
                "{other:?} is not this PING's reply"
            ))),
            Ok(Err(e)) if e.kind() == &ErrorKind::Timeout => Err(CallError::Timeout(timeout)),
            Ok(Err(e)) => Err(CallError::Redis(e.to_string())),
            Err(_) => Err(CallError::Timeout(timeout)),
        }
    }

    /// One connection attempt without retries, to surface why the pool
    /// cannot connect (refused, WRONGPASS, a peer that does not speak RESP),
    /// which the reconnecting pool only reports as timeouts.
    async fn diagnose(&self, timeout: Duration) -> Option<String> {
        let config = Config {
            fail_fast: true,
            ..self.config.clone()
        };
        let mut builder = Builder::from_config(config);
        builder.with_connection_config(|c| {
            c.connection_timeout = timeout;
            c.internal_command_timeout = timeout;
            c.max_command_attempts = 1;
        });
        let client = builder.build().ok()?;
        let outcome = tokio::time::timeout(timeout, client.init()).await;
        // quit() can wait on a peer that never answers: bound it too.
        let _ = tokio::time::timeout(timeout, client.quit()).await;
        match outcome {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "no answer within {timeout:?} (is this a Redis server?)"
            )),
        }
    }

    /// Runs a script by SHA, its reply awaited within `deadline`, loading it
    /// on NOSCRIPT. A call that provably never left (no connected client) is
    /// retried for half the configured deadline (or `deadline`, if shorter),
    /// so a Redis restart shorter than that costs latency, not an error.
    /// A call a Cluster refused because its slot is being moved (MOVED,
    /// ASK, TRYAGAIN: it did not run) is sent again for up to
    /// [`MOVING_RETRY`] deadlines: one slot moves in milliseconds, and a
    /// moving slot is no outage. `affinity` picks the connection (see
    /// [`Redis::decide`]); None takes the next connected one.
    async fn eval(
        &self,
        script: &Script,
        keys: Vec<String>,
        args: Vec<Value>,
        deadline: Duration,
        affinity: Option<u64>,
    ) -> Result<Value, CallError> {
        // Set once a call was written to a connection: from then on, a
        // timeout may hide an execution, whatever state the pool is in now.
        // (That connection is replaced by fred's unresponsive check once
        // it has gone the reply timeout without a reply.)
        let sent = AtomicBool::new(false);
        let started = std::time::Instant::now();
        // Half the budget: a call that cannot leave is reported as such
        // while the caller is still waiting, so it decides on a lease at once
        // instead of taking the silence for a slow answer.
        let send_within = (self.deadline / 2).min(deadline);
        // Converted once: fred's keys and values share their bytes, so the
        // copies each attempt hands to fred are reference counts, not new
        // strings.
        let keys: Vec<Key> = keys.into_iter().map(Key::from).collect();
        let moving_within = (self.deadline * MOVING_RETRY).min(deadline);
        let attempt = async {
            let mut pause = Duration::ZERO;
            loop {
                match self.eval_once(script, &keys, &args, affinity, &sent).await {
                    Err(Attempt::Failed(CallError::NotConnected(_)))
                        if started.elapsed() < send_within =>
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await
                    }
                    Err(Attempt::Moving(_)) if started.elapsed() < moving_within => {
                        // After MOVED the client has its new map already,
                        // so the first retry goes at once; ASK and TRYAGAIN
                        // last until the slot has moved (milliseconds).
                        tokio::time::sleep(pause).await;
                        pause =
                            (pause * 2).clamp(Duration::from_millis(1), Duration::from_millis(8));
                    }
                    Err(Attempt::Moving(why)) => {
                        let slot = keys.first().map_or(0, Key::cluster_hash);
                        let now = std::time::Instant::now();
                        if self.moving.refused(slot, started, now) {
                            return Err(CallError::SlotMoving(format!(
                                "{}: {why}",
                                self.display_url
                            )));
                        }
                        // Stuck, not moving (say a reshard that died
                        // midway): unreachable, as far as its calls go.
                        return Err(CallError::NotConnected(format!(
                            "{} (slot {slot} refused as moving for over {STUCK_MOVING:?}: {why})",
                            self.display_url
                        )));
                    }
                    Err(Attempt::Failed(e)) => return Err(e),
                    Ok(v) => {
                        if self.is_cluster() {
                            self.moving
                                .answered(keys.first().map_or(0, Key::cluster_hash));
                        }
                        return Ok(v);
                    }
                }
            }
        };
        match tokio::time::timeout(deadline, attempt).await {
            Ok(result) => result,
            Err(_) if sent.load(Ordering::SeqCst) => Err(CallError::Timeout(deadline)),
            Err(_) => Err(CallError::NotConnected(format!(
                "{} (no connection within {deadline:?})",
                self.display_url
            ))),
        }
    }

    /// The connection for a call: with an affinity, always the same one
    /// while it is connected, so calls for one key reach Redis in the order
    /// they were sent.
    fn client(&self, affinity: Option<u64>) -> &Client {
        let clients = self.pool.clients();
        match affinity {
            Some(a) if !clients.is_empty() => {
                let c = &clients[(a % clients.len() as u64) as usize];
                if c.is_connected() {
                    c
                } else {
                    self.pool.next_connected()
                }
            }
            _ => self.pool.next_connected(),
        }
    }

    async fn eval_once(
        &self,
        script: &Script,
        keys: &[Key],
        args: &[Value],
        affinity: Option<u64>,
        sent: &AtomicBool,
    ) -> Result<Value, Attempt> {
        let carrier = self.client(affinity);
        if !carrier.is_connected() {
            return Err(Attempt::Failed(CallError::NotConnected(format!(
                "{} ({:?})",
                self.display_url,
                carrier.state()
            ))));
        }
        let client = carrier.with_options(&Options {
            max_attempts: Some(1),
            fail_fast: true,
            ..Default::default()
        });
        sent.store(true, Ordering::SeqCst);
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        let mut args = args.to_vec();
        args.push(Value::Integer(token as i64));
        let keys = keys.to_vec();
        let first_key = keys.first().cloned();
        let result = match client
            .evalsha::<Value, _, _, _>(&script.sha, keys.clone(), args.clone())
            .await
        {
            Err(e) if e.details().starts_with("NOSCRIPT") || e.to_string().contains("NOSCRIPT") => {
                // After SCRIPT FLUSH or a Redis restart: load and retry once.
                let loaded = if self.is_cluster() {
                    client.script_load_cluster::<(), _>(script.source).await
                } else {
                    client.script_load::<(), _>(script.source).await
                };
                match loaded {
                    Ok(_) => {
                        client
                            .evalsha::<Value, _, _, _>(&script.sha, keys, args)
                            .await
                    }
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        // Decision calls only: a heartbeat answered by one Cluster node
        // says nothing of another that holds the decisions' keys.
        if std::ptr::eq(script, &self.decide) && result.as_ref().map_or_else(moving_slot, |_| true)
        {
            self.heard.fetch_add(1, Ordering::Relaxed);
        }
        match result {
            Ok(v) => match strip_token(v, token) {
                Ok(v) => Ok(v),
                Err(other) => {
                    replace(&self.home, carrier);
                    Err(Attempt::Failed(CallError::Reply(format!(
                        "{other:?} is not this call's reply (connection replaced)"
                    ))))
                }
            },
            // Written to the socket or not, an I/O failure may have reached Redis.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::IO | ErrorKind::Canceled | ErrorKind::Timeout
                ) =>
            {
                self.node_failed(self.node_of(first_key.as_ref()));
                Err(Attempt::Failed(CallError::Timeout(self.deadline)))
            }
            // Its slot is being moved: provably not applied, sent again.
            Err(e) if moving_slot(&e) => {
                sent.store(false, Ordering::SeqCst);
                Err(Attempt::Moving(e.to_string()))
            }
            // No node serves the slot (a failover): provably not applied,
            // so it may be sent again while the caller still waits.
            Err(e) if refused_by_cluster(&e) => Err(Attempt::Failed(CallError::NotConnected(
                format!("{} ({e})", self.display_url),
            ))),
            Err(e) => {
                self.node_failed(self.node_of(first_key.as_ref()));
                Err(Attempt::Failed(CallError::Redis(e.to_string())))
            }
        }
    }

    /// Runs the decision script; the reply is its flat integer array.
    /// Calls with the same `affinity` (the caller passes a hash of the
    /// first counter key) share a connection and an ordering group, so
    /// Redis runs them in the order they were sent: a refund sent after a
    /// charge cannot run before it and make it see its own field lowered.
    ///
    /// Calls queued while a call is in flight are sent together
    /// ([`batch`]). On a Cluster every key must be in `slot`.
    pub async fn decide(
        self: &Arc<Self>,
        slot: u16,
        call: scripts::DecideArgs,
        affinity: u64,
    ) -> Result<Vec<i64>, CallError> {
        let slot = if self.is_cluster() { slot } else { 0 };
        self.decide_coalesced(slot, call, affinity).await
    }

    /// (script calls that carried decisions, decisions they carried).
    pub fn batch_counts(&self) -> (u64, u64) {
        (
            self.batches.load(Ordering::Relaxed),
            self.batched.load(Ordering::Relaxed),
        )
    }

    /// Runs the replay script with its own budget (off the request path).
    pub async fn replay(
        &self,
        keys: Vec<String>,
        args: Vec<String>,
        deadline: Duration,
    ) -> Result<Vec<i64>, CallError> {
        let args = args.into_iter().map(Value::from).collect();
        let value = self.eval(&self.replay, keys, args, deadline, None).await?;
        integers(value)
    }

    /// Runs the membership script with its own (longer) budget.
    pub async fn members(
        &self,
        keys: Vec<String>,
        args: Vec<String>,
        deadline: Duration,
    ) -> Result<Vec<Value>, CallError> {
        let args = args.into_iter().map(Value::from).collect();
        match self.eval(&self.members, keys, args, deadline, None).await? {
            Value::Array(items) => Ok(items),
            other => Err(CallError::Reply(format!("{other:?}"))),
        }
    }

    /// Closes the connections; bounded, because QUIT waits for a reply a
    /// dead or hung Redis never sends.
    pub async fn quit(&self) {
        self.supervisor.abort();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.pool.quit()).await;
    }
}

/// The reply without its last item when that item is `token`; otherwise
/// the reply as it came.
fn strip_token(value: Value, token: u64) -> Result<Value, Value> {
    match value {
        Value::Array(mut items) if items.last() == Some(&Value::Integer(token as i64)) => {
            items.pop();
            Ok(Value::Array(items))
        }
        other => Err(other),
    }
}

/// How one attempt of a call ended, when it did not succeed.
enum Attempt {
    /// The call failed as `CallError` says.
    Failed(CallError),
    /// Its slot is being moved: it did not run.
    Moving(String),
}

/// How many configured deadlines a call refused for a moving slot is sent
/// again for.
const MOVING_RETRY: u32 = 10;

/// How long a slot's calls may keep being refused as moving and still be
/// a busy Cluster's (denied, no breaker failure). A reshard moves one slot
/// in milliseconds, or seconds on a loaded machine; a slot refused for
/// longer is stuck (a reshard that died midway, left in migrating state),
/// and its calls fail as unreachable, so the breaker trips and leases
/// decide rather than every request for it being denied.
const STUCK_MOVING: Duration = Duration::from_secs(10);

/// Slots whose calls are being refused as moving, each with the time its
/// first refused call was sent; forgotten once a call for it is answered.
/// At most one entry per Cluster slot.
#[derive(Default)]
struct MovingSlots(parking_lot::Mutex<std::collections::HashMap<u16, std::time::Instant>>);

impl MovingSlots {
    /// A call for `slot`, sent at `sent`, was refused for as long as it was
    /// retried. True while the slot has been refused for at most
    /// [`STUCK_MOVING`] (counted from the earliest such call); false once
    /// it is stuck.
    fn refused(&self, slot: u16, sent: std::time::Instant, now: std::time::Instant) -> bool {
        let mut slots = self.0.lock();
        let since = slots.entry(slot).or_insert(sent);
        if sent < *since {
            *since = sent;
        }
        now.saturating_duration_since(*since) <= STUCK_MOVING
    }

    /// A call for `slot` was answered: it has moved.
    fn answered(&self, slot: u16) {
        let mut slots = self.0.lock();
        if !slots.is_empty() {
            slots.remove(&slot);
        }
    }
}

/// A Cluster's refusal to run a command because its slot is being moved,
/// which means it did not run: a redirection not followed (MOVED: the slot
/// has moved, and fred has read the new map; ASK: it is moving) or
/// TRYAGAIN (some of its keys have moved already).
fn moving_slot(e: &fred::error::Error) -> bool {
    (*e.kind() == ErrorKind::Routing && e.details().starts_with("Too many redirections"))
        || has_code(e, "TRYAGAIN")
}

/// A Cluster's refusal to run a command for want of a node, which means it
/// did not run: CLUSTERDOWN (no node serves the slot, e.g. during a
/// failover).
fn refused_by_cluster(e: &fred::error::Error) -> bool {
    has_code(e, "CLUSTERDOWN")
}

fn has_code(e: &fred::error::Error, code: &str) -> bool {
    e.details().starts_with(code) || e.to_string().contains(code)
}

/// Whether a PING's reply is its own message.
/// `configured_hz` from `INFO server` (dynamic hz may raise `hz` for a
/// while under many clients; the configured value is what holds when idle),
/// else `hz`.
fn parse_hz(info: &str) -> Option<u64> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    field("configured_hz").or_else(|| field("hz"))
}

fn echoes(reply: &Value, token: &str) -> bool {
    reply.as_str().is_some_and(|s| s == token)
}

/// Takes a connection out of service: closed and replaced in the
/// background, its calls in flight failed (and counted as possibly applied
/// by their callers).
fn replace(home: &crate::tasks::Home, client: &Client) {
    let client = client.clone();
    home.spawn(async move {
        if let Err(e) = client.force_reconnection().await {
            tracing::debug!(error = %e, "replacing a Redis connection");
        }
    });
}

fn integers(value: Value) -> Result<Vec<i64>, CallError> {
    match value {
        Value::Array(items) => items
            .into_iter()
            .map(|v| match v {
                Value::Integer(i) => Ok(i),
                Value::Double(d) => Ok(d as i64),
                other => Err(CallError::Reply(format!("non-integer item {other:?}"))),
            })
            .collect(),
        other => Err(CallError::Reply(format!("{other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot being moved is excused for STUCK_MOVING from its first
    /// refused call, then is stuck; an answered call forgets it, and other
    /// slots keep their own clocks.
    #[test]
    fn a_slot_refused_as_moving_for_too_long_is_stuck() {
        let moving = MovingSlots::default();
        let t0 = std::time::Instant::now();
        let later = |d: Duration| t0 + d;
        assert!(moving.refused(7, t0, later(Duration::from_millis(50))));
        assert!(moving.refused(7, later(Duration::from_secs(5)), later(STUCK_MOVING)));
        assert!(!moving.refused(
            7,
            later(Duration::from_secs(9)),
            later(STUCK_MOVING + Duration::from_millis(1))
        ));
        assert!(moving.refused(8, later(STUCK_MOVING), later(STUCK_MOVING)));
        moving.answered(7);
        let t1 = later(STUCK_MOVING * 2);
        assert!(moving.refused(7, t1, t1 + Duration::from_millis(50)));
    }

    #[test]
    fn hz_is_read_from_info_configured_first() {
        let info = "# Server\r\nredis_version:7.0.15\r\nhz:100\r\nconfigured_hz:10\r\n";
        assert_eq!(parse_hz(info), Some(10));
        assert_eq!(parse_hz("# Server\r\nhz:50\r\n"), Some(50));
        assert_eq!(parse_hz("# Server\r\nhzz:50\r\n"), None);
        assert_eq!(parse_hz(""), None);
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://u:secret@h:6379/0"),
            "redis://u:***@h:6379/0"
        );
        assert_eq!(redact_url("rediss://secret@h:6379"), "rediss://***@h:6379");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact_url("redis-cluster://u:p%40ss@a:7000?node=b:7001&node=c:7002"),
            "redis-cluster://u:***@a:7000?node=b:7001&node=c:7002"
        );
        assert_eq!(
            redact_url("rediss-sentinel://u:one@s:26379/1?sentinelServiceName=m&sentinelUsername=su&sentinelPassword=two&node=t:26379"),
            "rediss-sentinel://u:***@s:26379/1?sentinelServiceName=m&sentinelUsername=su&sentinelPassword=***&node=t:26379"
        );
        // An '@' in the query is not the authority's.
        assert_eq!(
            redact_url("redis-sentinel://s:1?sentinelServiceName=a@b&sentinelPassword=x"),
            "redis-sentinel://s:1?sentinelServiceName=a@b&sentinelPassword=***"
        );
        // A password with '?' or '/' in it, and a URL without a scheme.
        assert_eq!(redact_url("redis://u:pa?ss@h:6379"), "redis://u:***@h:6379");
        assert_eq!(
            redact_url("redis://u:p/a@h:6379/0"),
            "redis://u:***@h:6379/0"
        );
        assert_eq!(redact_url("u:secret@h:6379"), "***@h:6379");
    }

    #[test]
    fn every_topology_url_form_is_checked() {
        for ok in [
            "redis://127.0.0.1:6379",
            "rediss://u:p@h:6380/2",
            "redis-cluster://h:7000?node=h:7001&node=h:7002",
            "rediss-cluster://u:p@h:7000",
            "redis-sentinel://h:26379/0?sentinelServiceName=main&node=h:26380",
            "rediss-sentinel://u:p@h:26379?sentinelServiceName=main&sentinelPassword=s",
        ] {
            assert_eq!(check_url(ok), Ok(()), "{ok}");
        }
        let e = check_url("redis-sentinel://u:secret@h:26379?sentinelPassword=also").unwrap_err();
        assert!(!e.contains("secret") && !e.contains("also"), "{e}");
        assert!(check_url("http://h:1").is_err_and(|e| e.contains("redis-cluster://")));
    }

    #[test]
    fn a_reply_is_accepted_only_with_its_own_token() {
        let reply = |items: Vec<i64>| Value::Array(items.into_iter().map(Value::Integer).collect());
        assert_eq!(strip_token(reply(vec![1, 2, 7]), 7), Ok(reply(vec![1, 2])));
        assert_eq!(
            strip_token(reply(vec![1, 2, 6]), 7),
            Err(reply(vec![1, 2, 6]))
        );
        assert!(strip_token(Value::String("PONG".into()), 7).is_err());
        assert!(strip_token(reply(vec![]), 7).is_err());
    }
}
