//! Rendering of the deployment templates under `envoy/`: one template per
//! config file, filled in for each place it runs (tests, the local runner,
//! compose), so no second hand-kept copy can drift. [`Layout`] says where
//! every component listens; [`files`] renders all templates for one layout.

use std::collections::HashMap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("template placeholder {{{{{0}}}}} has no value")]
    Missing(String),
    #[error("unterminated placeholder at byte {0}")]
    Unterminated(usize),
}

/// Replaces every `{{NAME}}` with its value; a placeholder without a value is
/// an error, so a template and its callers cannot silently disagree.
pub fn render(template: &str, vars: &HashMap<&str, String>) -> Result<String, RenderError> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or(RenderError::Unterminated(
            template.len() - rest.len() + start,
        ))?;
        let name = after[..end].trim();
        let value = vars
            .get(name)
            .ok_or_else(|| RenderError::Missing(name.to_string()))?;
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The template's `RLS_TLS` for calling leasehold over mutual TLS: Envoy
/// presents `cert`/`key`, trusts `ca` for the replicas' certificates and
/// checks that they name `server_name` (files as Envoy's host sees them).
/// Pair with `grpc_tls_cert`, `grpc_tls_key` and `grpc_tls_client_ca` on
/// the replicas.
pub fn envoy_rls_mtls(ca: &str, cert: &str, key: &str, server_name: &str) -> String {
    format!(
        r#"
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          sni: {server_name}
          common_tls_context:
            alpn_protocols: ["h2"]
            tls_certificates:
              - certificate_chain: {{ filename: "{cert}" }}
                private_key: {{ filename: "{key}" }}
            validation_context:
              trusted_ca: {{ filename: "{ca}" }}
              match_typed_subject_alt_names:
                - san_type: DNS
                  matcher: {{ exact: "{server_name}" }}"#
    )
}

/// The templates, compiled in so the runner works from any directory.
pub const ENVOY_TEMPLATE: &str = include_str!("../../envoy/envoy.yaml.tmpl");
pub const NGINX_TEMPLATE: &str = include_str!("../../envoy/nginx.conf.tmpl");
pub const UPSTREAM_TEMPLATE: &str = include_str!("../../envoy/upstream.conf.tmpl");
/// The rules and settings the topology runs with (mounted by compose, written
/// into its run directory by the local runner).
pub const TOPOLOGY_RULES: &str = include_str!("../../deploy/rules/edge.yaml");
pub const TOPOLOGY_SETTINGS: &str = include_str!("../../deploy/leasehold.toml");

/// A host and port as a config file names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Endpoint {
            host: host.into(),
            port,
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Where each component of the topology listens and how the others reach it.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The rate-limit domain Envoy asks for.
    pub domain: String,
    /// The replicas' gRPC endpoints, as Envoy and nginx reach them.
    pub replicas: Vec<Endpoint>,
    /// The dummy upstream as Envoy reaches it.
    pub upstream: Endpoint,
    /// Where the dummy upstream binds.
    pub upstream_listen: Endpoint,
    pub envoy_listen: Endpoint,
    pub envoy_admin: Endpoint,
    /// Where the nginx gRPC balancer binds.
    pub nginx_listen: Endpoint,
    /// nginx's pid and temp files.
    pub nginx_run_dir: String,
}

/// Ports inside the compose network (and published on the host).
pub mod compose_ports {
    pub const REPLICA_GRPC: u16 = 8081;
    pub const REPLICA_HTTP: u16 = 8080;
    pub const UPSTREAM: u16 = 8000;
    pub const ENVOY: u16 = 10000;
    pub const ENVOY_ADMIN: u16 = 9901;
    pub const NGINX_GRPC: u16 = 8090;
    pub const REDIS: u16 = 6379;
}

/// Replicas in the topology.
pub const REPLICAS: usize = 4;

/// The compose service name of replica `i` (1-based).
pub fn replica_service(i: usize) -> String {
    format!("leasehold-{i}")
}

impl Layout {
    /// The layout inside compose: services reach each other by name.
    pub fn compose() -> Layout {
        use compose_ports::*;
        Layout {
            domain: "edge".into(),
            replicas: (1..=REPLICAS)
                .map(|i| Endpoint::new(replica_service(i), REPLICA_GRPC))
                .collect(),
            upstream: Endpoint::new("upstream", UPSTREAM),
            upstream_listen: Endpoint::new("0.0.0.0", UPSTREAM),
            envoy_listen: Endpoint::new("0.0.0.0", ENVOY),
            envoy_admin: Endpoint::new("0.0.0.0", ENVOY_ADMIN),
            nginx_listen: Endpoint::new("0.0.0.0", NGINX_GRPC),
            nginx_run_dir: "/tmp".into(),
        }
    }

    fn vars(&self) -> HashMap<&'static str, String> {
        HashMap::from([
            ("ADMIN_ADDRESS", self.envoy_admin.host.clone()),
            ("ADMIN_PORT", self.envoy_admin.port.to_string()),
            ("LISTEN_ADDRESS", self.envoy_listen.host.clone()),
            ("LISTEN_PORT", self.envoy_listen.port.to_string()),
            ("DOMAIN", self.domain.clone()),
            ("UPSTREAM_HOST", self.upstream.host.clone()),
            ("UPSTREAM_PORT", self.upstream.port.to_string()),
            ("RLS_ENDPOINTS", envoy_endpoints(&self.replicas)),
            // Plaintext to the replicas; [`envoy_rls_mtls`] for mutual TLS.
            ("RLS_TLS", String::new()),
            ("NGINX_RUN_DIR", self.nginx_run_dir.clone()),
            ("NGINX_LISTEN", self.nginx_listen.to_string()),
            ("NGINX_UPSTREAMS", nginx_upstreams(&self.replicas)),
            ("UPSTREAM_LISTEN", self.upstream_listen.to_string()),
        ])
    }
}

/// The rendered config files of one layout: (file name, contents).
pub fn files(layout: &Layout) -> Result<Vec<(&'static str, String)>, RenderError> {
    let vars = layout.vars();
    Ok(vec![
        ("envoy.yaml", render(ENVOY_TEMPLATE, &vars)?),
        ("nginx.conf", render(NGINX_TEMPLATE, &vars)?),
        ("upstream.conf", render(UPSTREAM_TEMPLATE, &vars)?),
    ])
}

/// The `lb_endpoints` entries of the Envoy `leasehold` cluster, indented to
/// sit under `lb_endpoints:`.
pub fn envoy_endpoints(targets: &[Endpoint]) -> String {
    targets
        .iter()
        .map(|e| {
            format!(
                "              - endpoint:\n                  address:\n                    socket_address: {{ address: {}, port_value: {} }}\n",
                e.host, e.port
            )
        })
        .collect::<String>()
        .trim_end()
        .to_string()
}

/// The `server` lines of nginx's `leasehold` upstream block.
pub fn nginx_upstreams(targets: &[Endpoint]) -> String {
    targets
        .iter()
        .map(|e| format!("        server {e} max_fails=1 fail_timeout=5s;\n"))
        .collect::<String>()
        .trim_end()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_rejects_missing_values() {
        let vars = HashMap::from([("A", "1".to_string()), ("B", "two".to_string())]);
        assert_eq!(render("x {{A}} y {{ B }}", &vars), Ok("x 1 y two".into()));
        assert_eq!(
            render("{{C}}", &vars),
            Err(RenderError::Missing("C".into()))
        );
        assert_eq!(render("ok {{A", &vars), Err(RenderError::Unterminated(3)));
    }

    #[test]
    fn every_template_placeholder_has_a_value() {
        let files = files(&Layout::compose()).expect("compose renders");
        assert_eq!(files.len(), 3);
        for (name, text) in files {
            assert!(!text.contains("{{"), "{name} keeps a placeholder");
        }
    }
}
