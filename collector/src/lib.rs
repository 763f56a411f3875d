//! kvroute-collector: the native companion of the kvroute filter.
//!
//! It subscribes to the KV events of vLLM and SGLang engines over ZMQ, keeps the prefix index
//! (the core's [`kvroute::index::Index`]), and serves the indexer HTTP API and the binary feed
//! the filter pulls (ARCHITECTURE.md, "KV events in", "HTTP API of the collector").
//!
//! # Layout
//!
//! - [`zmq`]: one subscriber task per registered worker; sequence tracking, replay, restarts.
//! - [`decode`]: msgpack batches of every engine version → normalized events, read with
//!   [`msgpack`]'s bounded reader.
//! - [`chunk`]: SGLang pages → blocks of the registered size.
//! - [`hub`]: the state behind one lock, split by job: registry, ingest (in bounded slices),
//!   query, persistence.
//! - [`feedlog`]: the bounded delta log and paged snapshots of `/v1/feed`.
//! - [`api`]: the axum handlers, `app(state) -> Router`; [`fastjson`]: the `/query` body fast path.
//! - [`server`]: accept loop, connection cap, header timeout, bounded shutdown; [`edge`]:
//!   per-request size limits and deadlines.
//! - [`fleet`]: gateways' load reports and engines' samples, summed per worker;
//!   [`fleet_api`]: `/v1/load`; [`scrape`]: the engines' `/metrics` scraper; [`truth`]:
//!   predicted against engine-reported reuse; [`alarm`]: the silent failures.
//! - [`shared`]: the state every task shares ([`Shared`]), and the `--state-dir` snapshots
//!   taken of it ([`state`]: the file); `workers`: registering starts a worker's subscriber.
//! - [`ui`]: the fleet page (`/ui/`) and its `/v1/fleet/overview`.
//! - [`text`]: the models' tokenizers (`--tokenizer`) for `/tokenize` and text `/query`.
//! - [`bus`]: the optional NATS JetStream event bus between collectors (`--nats`), and the
//!   reader of an NVIDIA Dynamo fleet's KV events on the same server (`--dynamo-namespace`).
//! - [`config`]: command line and config file.
//!
//! It must not hold the hub's lock across an `.await`, and must not let one engine's bad
//! input cost more than that input.

pub mod alarm;
pub mod api;
pub mod bus;
pub mod chunk;
pub mod config;
pub mod decode;
pub mod edge;
pub mod explain;
pub mod fastjson;
pub mod feedlog;
pub mod fleet;
pub mod fleet_api;
pub mod health;
pub mod hub;
pub mod metrics;
pub mod msgpack;
pub mod reply;
pub mod scrape;
pub mod server;
pub mod shared;
pub mod state;
pub mod text;
pub mod truth;
pub mod ui;
mod workers;
pub mod zmq;

use std::future::Future;

use tokio::net::TcpListener;
use tracing::info;

pub use api::app;
pub use config::Config;
use hub::HubError;
pub use shared::{AppState, Shared};

/// Errors of starting or running the collector.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("worker {spec}: {source}")]
    Worker { spec: String, source: HubError },
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] text::TokenizeError),
}

/// Builds the collector's state: loads `--state-dir` when set, registers the `--worker`s, and
/// starts every subscriber (restored ones replay from their last sequence number + 1).
///
/// # Errors
/// A `--worker` that is invalid or conflicts.
pub fn start(config: Config) -> Result<AppState, Error> {
    let shared = Shared::new(config);
    // At start, so a bad directory stops the collector with its path instead of failing
    // requests later.
    shared.tokenizers.load_all(&shared.metrics)?;
    let mut resume = Vec::new();
    if let Some(dir) = shared.config.state_dir.clone() {
        resume = shared::load_state(&shared, &dir);
    }
    for (id, last_seq) in resume {
        shared.start_subscriber(id, last_seq);
    }
    for req in shared.config.workers.clone() {
        let spec = format!("{}/{}", req.instance_id, req.dp_rank.unwrap_or(0));
        shared
            .register(req)
            .map_err(|source| Error::Worker { spec, source })?;
    }
    Ok(shared)
}

/// Runs the collector on a bound listener until `shutdown` resolves, then stops the
/// subscribers and writes the final state snapshot.
///
/// # Errors
/// A bad `--worker`, or the HTTP server failing.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let shared = start(config)?;
    serve(listener, shared, shutdown).await
}

/// The accept loop's limits: the connection cap from `--max-connections` and the descriptor
/// limit in force (main raises it to the hard limit first), logged once.
fn server_limits(config: &Config) -> server::ServerLimits {
    let soft_fds = server::fd_soft_limit().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read the descriptor limit; assuming 1024");
        1024
    });
    let (max_connections, source) = server::connection_cap(config.max_connections, soft_fds);
    if let server::CapSource::Clamped { asked } = source {
        tracing::warn!(
            asked,
            max_connections,
            soft_fds,
            "--max-connections is more than the descriptor limit leaves for connections; cut"
        );
    }
    let reserved_connections = config
        .reserved_connections
        .unwrap_or_else(|| server::default_reserved(max_connections))
        .min(max_connections.saturating_sub(1));
    info!(
        max_connections,
        reserved_connections,
        soft_fds,
        derived = source == server::CapSource::Derived,
        "connection cap"
    );
    server::ServerLimits {
        max_connections,
        reserved_connections,
        header_read_timeout: config.header_read_timeout,
        shutdown_timeout: config.shutdown_timeout,
    }
}

/// Serves an already started collector (see [`start`]) until `shutdown` resolves.
///
/// # Errors
/// The HTTP server failing.
pub async fn serve(
    listener: TcpListener,
    shared: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let snapshots = shared.config.state_dir.clone().map(|dir| {
        let shared = shared.clone();
        let every = shared
            .config
            .snapshot_interval
            .max(std::time::Duration::from_millis(100));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                shared::save_state(&shared, &dir).await;
            }
        })
    });
    let bus_tasks = bus::task::spawn(&shared);
    let scraper = tokio::spawn(scrape::run(
        shared.clone(),
        scrape::ScrapeConfig {
            interval: shared.config.scrape_interval,
            timeout: shared.config.scrape_timeout,
            max_bytes: shared.config.max_metrics_bytes,
            down_after: shared.config.engine_down,
        },
    ));
    info!(addr = %listener.local_addr()?, "serving");
    let limits = server_limits(&shared.config);
    let as_gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    shared
        .metrics
        .http_max_connections
        .set(as_gauge(limits.max_connections));
    shared
        .metrics
        .http_reserved_connections
        .set(as_gauge(limits.reserved_connections));
    let counters = server::ServerCounters {
        refused: shared.metrics.http_connections_refused.clone(),
        shed: shared.metrics.http_connections_shed.clone(),
    };
    let result =
        server::serve_http(listener, app(shared.clone()), limits, counters, shutdown).await;
    if let Some(task) = snapshots {
        task.abort();
    }
    scraper.abort();
    // Before the final snapshot: nothing from the stream is applied after it.
    bus_tasks.stop();
    shared.stop_subscribers();
    if let Some(dir) = shared.config.state_dir.clone() {
        shared::save_state(&shared, &dir).await;
    }
    result.map_err(Error::Io)
}
