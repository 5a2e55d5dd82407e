//! One shutdown signal for every binary: Ctrl-C or SIGTERM cancels a token
//! that relays, consumers and servers watch between units of work.

use tokio_util::sync::CancellationToken;

/// What every long-running part of a process watches to stop.
pub use tokio_util::sync::CancellationToken as ShutdownToken;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutdown signal received; finishing work in progress");
}

/// A token cancelled when the process is asked to stop.
pub fn token() -> CancellationToken {
    let token = CancellationToken::new();
    let child = token.clone();
    tokio::spawn(async move {
        signal().await;
        child.cancel();
    });
    token
}
