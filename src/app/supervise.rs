//! Background tasks under supervision. Each runs inside [`supervised`],
//! which names it and catches a panic, so the composition root learns when
//! one ends before the stop signal: the replica then logs it, reports
//! NOT_SERVING, stops in order and exits non-zero for its orchestrator to
//! restart it, instead of serving on with stale rules or a stuck engine.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt as _;

/// How a supervised task ended: its name, and the panic message if it
/// panicked.
pub(super) type Outcome = (&'static str, Result<(), String>);

/// `task`, named, with a panic caught and turned into its message.
pub(super) async fn supervised(
    name: &'static str,
    task: impl Future<Output = ()> + Send + 'static,
) -> Outcome {
    let task = inject_panic(name, task);
    match AssertUnwindSafe(task).catch_unwind().await {
        Ok(()) => (name, Ok(())),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            (name, Err(message))
        }
    }
}

/// What a task's early end means, for the log and the exit error.
pub(super) fn describe((name, result): &Outcome) -> String {
    match result {
        Ok(()) => format!("background task '{name}' ended before the stop signal"),
        Err(panic) => format!("background task '{name}' panicked: {panic}"),
    }
}

/// Test builds only: `LH_FAULT_PANIC_TASK=<name>` makes that task panic
/// a second after it starts (after readiness), so the tests can show what supervision does
/// with the real binary. Release builds have no such hook.
#[cfg(debug_assertions)]
fn inject_panic(
    name: &'static str,
    task: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = ()> + Send + 'static {
    let inject = std::env::var("LH_FAULT_PANIC_TASK").is_ok_and(|v| v == name);
    async move {
        if inject {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            panic!("injected by LH_FAULT_PANIC_TASK");
        }
        task.await;
    }
}

#[cfg(not(debug_assertions))]
fn inject_panic(
    _name: &'static str,
    task: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = ()> + Send + 'static {
    task
}
