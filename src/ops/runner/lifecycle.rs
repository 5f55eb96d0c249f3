//! A running topology: its logs, health and stats, what it started (by
//! pid), killing one component, and stopping everything in reverse
//! dependency order.

use super::*;

impl Topology {
    /// The last `n` lines of a component's log.
    pub fn log_tail(&self, name: &str, n: usize) -> String {
        let Some(c) = self.components.iter().find(|c| c.name == name) else {
            return String::new();
        };
        let text = std::fs::read_to_string(&c.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    pub(super) async fn healthy(&self, name: &str) -> bool {
        let p = &self.ports;
        match name {
            REDIS => redis_ping(p.redis).await,
            UPSTREAM => self
                .http
                .get(&format!("http://127.0.0.1:{}/", p.upstream), &[])
                .await
                .is_ok_and(|r| r.status == 200),
            NGINX => {
                crate::ops::http_client::grpc_serving(&format!("http://127.0.0.1:{}", p.nginx))
                    .await
            }
            ENVOY => {
                let admin = format!("http://127.0.0.1:{}", p.envoy_admin);
                let ready = self
                    .http
                    .get(&format!("{admin}/ready"), &[])
                    .await
                    .is_ok_and(|r| r.status == 200);
                ready && self.envoy_healthy_replicas().await == Some(REPLICAS as u64)
            }
            replica => match replica_index(replica).and_then(|i| p.replicas.get(i)) {
                Some(r) => self
                    .http
                    .get(&format!("http://127.0.0.1:{}/readyz", r.http), &[])
                    .await
                    .is_ok_and(|r| r.status == 200),
                None => false,
            },
        }
    }

    /// Replicas Envoy's health checks consider healthy.
    pub async fn envoy_healthy_replicas(&self) -> Option<u64> {
        self.envoy_stat("cluster.leasehold.membership_healthy")
            .await
    }

    /// One Envoy counter or gauge from the admin interface.
    pub async fn envoy_stat(&self, name: &str) -> Option<u64> {
        let url = format!(
            "http://127.0.0.1:{}/stats?filter=^{}$",
            self.ports.envoy_admin,
            name.replace('.', "\\.")
        );
        let r = self.http.get(&url, &[]).await.ok()?;
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }

    /// (name, pid) of every running component.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.components
            .iter()
            .filter_map(|c| c.pid().map(|p| (c.name.clone(), p)))
            .collect()
    }

    /// Where each component listens, for people.
    pub fn describe(&self) -> String {
        let p = &self.ports;
        let mut rows = vec![
            (
                "envoy (HTTP, rate limited)".to_string(),
                format!(
                    "http://127.0.0.1:{}/  (try: curl -i -H 'x-user: alice' ...)",
                    p.envoy
                ),
            ),
            (
                "envoy admin".into(),
                format!("http://127.0.0.1:{}/", p.envoy_admin),
            ),
            (
                "nginx (gRPC balancer)".into(),
                format!(
                    "127.0.0.1:{0}  (grpcurl -plaintext 127.0.0.1:{0} list)",
                    p.nginx
                ),
            ),
        ];
        for (i, r) in p.replicas.iter().enumerate() {
            rows.push((
                replica_name(i + 1),
                format!(
                    "grpc 127.0.0.1:{}  http http://127.0.0.1:{}/metrics  admin http://127.0.0.1:{}/status.html",
                    r.grpc, r.http, r.admin
                ),
            ));
        }
        rows.push((
            "upstream".into(),
            format!("http://127.0.0.1:{}/", p.upstream),
        ));
        rows.push(("redis".into(), format!("redis://127.0.0.1:{}", p.redis)));
        rows.push(("configs and logs".into(), self.dir.display().to_string()));
        rows.iter()
            .map(|(what, where_)| format!("{what:<28} {where_}\n"))
            .collect()
    }

    /// kill -9 a component and reap it.
    pub async fn kill9(&mut self, name: &str) -> anyhow::Result<()> {
        let report = self.report.clone();
        let c = self.component(name)?;
        if let Some(mut child) = c.child.take() {
            let pid = child.pid();
            child.kill();
            report(&format!("killed {name} (pid {pid}) with SIGKILL"));
        }
        Ok(())
    }

    /// Stops every component still running, in reverse dependency order
    /// (Envoy, then nginx and the upstream, then the replicas together, then
    /// Redis): SIGTERM, then SIGKILL after a grace period. Safe to call twice.
    pub async fn stop(&mut self) {
        let report = self.report.clone();
        for tier in [vec![ENVOY], vec![NGINX, UPSTREAM], vec![], vec![REDIS]] {
            let mut stopping = Vec::new();
            for c in self.components.iter_mut() {
                let in_tier = if tier.is_empty() {
                    replica_index(&c.name).is_some()
                } else {
                    tier.contains(&c.name.as_str())
                };
                if !in_tier {
                    continue;
                }
                if let Some(child) = c.child.take() {
                    let _ = child.signal("TERM");
                    stopping.push((c.name.clone(), child.pid(), child));
                }
            }
            let waits = stopping
                .into_iter()
                .map(|(name, pid, mut child)| async move {
                    let how = match child.wait_exit_async(STOP_GRACE).await {
                        Some(s) => format!("stopped ({s})"),
                        None => {
                            child.kill();
                            "killed after the grace period".to_string()
                        }
                    };
                    format!("{name} pid {pid}: {how}")
                });
            for line in futures::future::join_all(waits).await {
                report(&line);
            }
        }
    }

    pub fn http(&self) -> &crate::ops::http_client::HttpClient {
        &self.http
    }
}
