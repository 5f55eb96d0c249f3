//! The tools' clients: a small keep-alive HTTP/1.1 client (Envoy, status
//! pages, metrics, `/json`), a blocking form of it for synchronous callers
//! (the test suites), and a gRPC health probe.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tonic::transport::Channel;

/// A small HTTP/1.1 client with keep-alive.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

/// What an HTTP call returned.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(1)));
        connector.set_nodelay(true);
        HttpClient {
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// GET with headers, bounded by a 2 s timeout.
    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> anyhow::Result<HttpReply> {
        self.request("GET", url, headers, "", Duration::from_secs(2))
            .await
    }

    /// Any method; a non-empty body is sent as JSON unless `headers` set a
    /// content type. The whole call is bounded by `limit`.
    pub async fn request(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
        limit: Duration,
    ) -> anyhow::Result<HttpReply> {
        let mut req = hyper::Request::builder().method(method).uri(url);
        let typed = headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
        if !body.is_empty() && !typed {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.to_owned())))?;
        let call = async {
            let resp = self.client.request(req).await?;
            let status = resp.status().as_u16();
            let headers = resp
                .headers()
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect();
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(HttpReply {
                status,
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        };
        tokio::time::timeout(limit, call)
            .await
            .map_err(|_| anyhow::anyhow!("{method} {url}: timed out"))?
    }
}

/// One call from synchronous code: its own current-thread runtime on a
/// scoped thread, so it works inside an async runtime as well as outside.
pub fn blocking_request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
    limit: Duration,
) -> anyhow::Result<HttpReply> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(HttpClient::new().request(method, url, headers, body, limit))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("{method} {url}: the client thread panicked"))?
    })
}

/// gRPC health answers SERVING for the overall server at `uri`.
pub async fn grpc_serving(uri: &str) -> bool {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let attempt = async {
        let channel = Channel::from_shared(uri.to_string())?.connect().await?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await?;
        anyhow::Ok(reply.into_inner().status == 1)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}

/// `addr` as a URI: `host:port` gets `http://`.
pub fn endpoint_uri(addr: &str) -> String {
    if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    }
}
