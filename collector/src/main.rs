//! `kvroute-collector`: reads the command line, sets up logging, binds the listener and runs
//! the collector until SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use kvroute_collector::config::Cli;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("kvroute_collector=info")),
        )
        .init();
    let config = Cli::parse().into_config()?;
    let thresholds = kvroute_collector::server::fix_malloc_thresholds();
    tracing::debug!(fixed = thresholds, "malloc mmap and trim thresholds");
    // The collector's transients (replays, catch-ups, snapshots) come in bursts; what they
    // leave free is returned every half minute, off the async workers (it takes the
    // allocator's locks for a few milliseconds).
    tokio::spawn(async {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(30));
        loop {
            tick.tick().await;
            let _ =
                tokio::task::spawn_blocking(kvroute_collector::server::release_free_memory).await;
        }
    });
    // Before anything opens descriptors; the connection cap is derived from the result.
    match kvroute_collector::server::raise_fd_limit() {
        Ok(fd) => {
            tracing::info!(soft = fd.soft, hard = fd.hard, raised_from = ?fd.raised_from, "descriptor limit")
        }
        Err(e) => tracing::warn!(error = %e, "cannot raise the descriptor limit"),
    }
    if !config.listen.ip().is_loopback() {
        if config.admin_token.is_none() {
            // Only reachable with --insecure-no-auth (into_config refuses otherwise).
            tracing::warn!(listen = %config.listen, "--insecure-no-auth: listening beyond loopback without an admin token; anyone who reaches this port can /register and /unregister workers");
        }
        if config.read_token.is_none() {
            tracing::warn!(listen = %config.listen, "listening beyond loopback without a read token: /query, /workers and /v1/feed are open");
        }
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    kvroute_collector::run(listener, config, shutdown_signal()).await?;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
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
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
