//! Read-only inspection of a counter for tools (the failover demo): its
//! total per window, read with a connection of its own, so the tools never
//! need to know the client library or the field layout.

use std::collections::BTreeMap;
use std::time::Duration;

use fred::prelude::*;

use super::keys;
use crate::key::CounterKey;

/// The total of every live window of `key` (window index → the sum of
/// every replica's count fields), within `timeout`.
pub async fn window_totals(
    url: &str,
    prefix: &str,
    key: &CounterKey,
    timeout: Duration,
) -> Result<BTreeMap<u64, i64>, String> {
    let read = async {
        let client = Builder::from_config(Config::from_url(url)?).build()?;
        client.init().await?;
        let pattern = format!("{}@*", keys::counter_base(prefix, key));
        let found: Vec<String> = client.custom(fred::cmd!("KEYS"), vec![pattern]).await?;
        let mut out = BTreeMap::new();
        for name in found {
            let Some(w) = name.rsplit('@').next().and_then(|w| w.parse::<u64>().ok()) else {
                continue;
            };
            let fields: std::collections::HashMap<String, String> = client.hgetall(&name).await?;
            let total = keys::window_total(fields.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            out.insert(w, total);
        }
        let _ = client.quit().await;
        Ok::<_, fred::error::Error>(out)
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(format!("reading counts from Redis: {e}")),
        Err(_) => Err("reading the counts from Redis timed out".into()),
    }
}
