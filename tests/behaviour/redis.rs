//! The behaviour suite on the Redis engine, against a real redis-server the
//! test starts on a free port: the very cases the in-memory engine passes.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common;
use leasehold::engine::Engine;
use leasehold::settings::Settings;

/// One redis-server per test keeps cases independent; it is stopped (by
/// pid) when the returned guard drops at the end of the case, or while
/// unwinding from a failed assertion.
async fn redis_engine() -> (Arc<dyn Engine>, common::RedisServer) {
    // Counting cases use minute units: start them well inside a minute so
    // none straddles a window boundary.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let into_minute = now.as_millis() % 60_000;
    if into_minute > 55_000 {
        tokio::time::sleep(Duration::from_millis(60_100 - into_minute as u64)).await;
    }
    let dir = common::test_dir(&format!("behaviour-redis-{}", rand_suffix()));
    let server = common::RedisServer::start("redis", &dir);
    let settings = Settings {
        redis_deadline_ms: 2_000,
        ..Settings::default()
    };
    let url = server.url();
    let (engine, _redis) =
        leasehold::app::redis_engine(&settings, &url, "suite-replica", "boot".into())
            .await
            .expect("redis engine");
    (engine, server)
}

fn rand_suffix() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

behaviour_suite!(redis_engine());
