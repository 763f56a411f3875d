//! The simulated fleet of a scenario (engines in this process) and the real collector in
//! front of it.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{Engine, EngineConfig};
use kvroute_sim::tokenizer::TextTokenizer;
use kvroute_sim::wire::EventFormat;

use super::args::{BenchArgs, SCRAPE_INTERVAL_MS};
use super::policy::Slot;
use super::report::EngineLoad;

/// The simulated engines of a bench, serving on loopback.
#[derive(Debug)]
pub struct Fleet {
    pub engines: Vec<Engine>,
    /// Base URLs, `http://127.0.0.1:port`.
    pub urls: Vec<String>,
    /// Instance ids.
    pub names: Vec<String>,
    /// The model they serve.
    pub model: String,
    /// The real tokenizer's directory, when they use one (the collector gets it too).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Each engine's KV-event PUB and replay endpoints as registered with the collector and
    /// the peers (a closed port when the fleet publishes no events).
    pub event_endpoints: Vec<(String, Option<String>)>,
    /// Each engine's prefill rate, tokens per simulated second.
    pub prefill_tokens_per_s: Vec<f64>,
    /// The engines' HTTP servers (aborted by [`Fleet::stop`]).
    servers: Vec<tokio::task::AbortHandle>,
}

/// How a scenario's fleet departs from the flags' even one.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetSpec {
    /// Engines.
    pub engines: usize,
    /// Engine 0's prefill and decode rates relative to the flags' (1.0: the same; 0.5: half
    /// the prefill tokens per second and twice the time per output token).
    pub engine0_speed: f64,
    /// Whether the engines publish KV events. Off, no engine binds a PUB socket and each is
    /// registered at a closed port, so the collector and the peers learn nothing of caches.
    pub events: bool,
}

impl FleetSpec {
    /// The fleet of the flags: `--engines` identical engines publishing events.
    pub fn even(a: &BenchArgs) -> FleetSpec {
        FleetSpec {
            engines: a.engines,
            engine0_speed: 1.0,
            events: true,
        }
    }

    /// Each engine's prefill rate (tokens/s) and time per output token under `a`'s rates.
    pub fn rates(&self, a: &BenchArgs) -> Vec<(f64, Duration)> {
        let decode = Duration::from_secs_f64(a.decode_ms_per_token / 1000.0);
        (0..self.engines)
            .map(|i| {
                let f = if i == 0 { self.engine0_speed } else { 1.0 };
                (a.prefill_tokens_per_s * f, decode.div_f64(f.max(1e-6)))
            })
            .collect()
    }
}

impl Fleet {
    /// The engines as the in-process routers see them.
    pub fn slots(&self) -> Vec<Slot> {
        self.urls
            .iter()
            .zip(&self.names)
            .map(|(u, n)| Slot {
                url: u.clone(),
                instance_id: n.clone(),
            })
            .collect()
    }

    /// Stops the engines' HTTP servers (open connections end with their clients).
    pub fn stop(&self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

/// A loopback port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_or(1, |a| a.port())
}

/// Starts `a.engines` engines in this process, each with HTTP, PUB and replay sockets on
/// loopback.
///
/// # Errors
/// A socket that cannot bind.
pub async fn start_fleet(a: &BenchArgs) -> anyhow::Result<Fleet> {
    start_fleet_with(a, super::args::MODEL, None).await
}

/// Starts `a.engines` engines serving `model`, tokenizing text with the real tokenizer in
/// `tokenizer` (else the toy `t<id>` words).
///
/// # Errors
/// A socket that cannot bind, a tokenizer that does not load.
pub async fn start_fleet_with(
    a: &BenchArgs,
    model: &str,
    tokenizer: Option<&Path>,
) -> anyhow::Result<Fleet> {
    start_fleet_spec(a, &FleetSpec::even(a), model, tokenizer).await
}

/// Starts the fleet `spec` describes, serving `model` (see [`start_fleet_with`]).
///
/// # Errors
/// A socket that cannot bind, a tokenizer that does not load.
pub async fn start_fleet_spec(
    a: &BenchArgs,
    spec: &FleetSpec,
    model: &str,
    tokenizer: Option<&Path>,
) -> anyhow::Result<Fleet> {
    let text = match tokenizer {
        Some(dir) => {
            TextTokenizer::from_dir(dir).with_context(|| format!("tokenizer {}", dir.display()))?
        }
        None => TextTokenizer::Toy,
    };
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    let mut names = Vec::new();
    let mut servers = Vec::new();
    let rates = spec.rates(a);
    for (i, &(prefill_tokens_per_s, decode_per_token)) in rates.iter().enumerate() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let name = format!("engine-{i}");
        let e = Engine::start(EngineConfig {
            name: name.clone(),
            model: model.into(),
            tokenizer: text.clone(),
            cache: CacheConfig {
                block_size_tokens: a.block_size,
                capacity_blocks: a.capacity_blocks,
            },
            prefill_tokens_per_s,
            decode_per_token,
            engine_model: a.engine_model,
            speed: a.speed,
            event_format: EventFormat::Vllm033,
            events_endpoint: spec.events.then(|| "tcp://127.0.0.1:0".into()),
            replay_endpoint: spec.events.then(|| "tcp://127.0.0.1:0".into()),
            stream_interval_tokens: a.stream_interval,
            ..EngineConfig::default()
        })
        .await?;
        let app = e.app();
        servers.push(tokio::spawn(async move { axum::serve(listener, app).await }).abort_handle());
        urls.push(format!("http://{addr}"));
        names.push(name);
        engines.push(e);
    }
    let event_endpoints = engines
        .iter()
        .map(|e| {
            e.event_endpoints().into_iter().next().unwrap_or_else(|| {
                // Registered all the same: a fleet whose events never arrive.
                (format!("tcp://127.0.0.1:{}", closed_port()), None)
            })
        })
        .collect();
    Ok(Fleet {
        engines,
        urls,
        names,
        model: model.into(),
        tokenizer: tokenizer.map(Path::to_path_buf),
        event_endpoints,
        prefill_tokens_per_s: rates.iter().map(|r| r.0).collect(),
        servers,
    })
}

/// Starts the real collector in-process (its library, configured from the same command line
/// as its binary), registered with every engine, with the fleet's tokenizer; returns its URL.
///
/// # Errors
/// A collector that refuses the configuration.
pub async fn start_collector(a: &BenchArgs, fleet: &Fleet) -> anyhow::Result<String> {
    start_collector_until(a, fleet, std::future::pending()).await
}

/// [`start_collector`], serving until `shutdown` resolves (then its subscribers and scraper
/// stop too).
///
/// # Errors
/// A collector that refuses the configuration.
pub async fn start_collector_until(
    a: &BenchArgs,
    fleet: &Fleet,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<String> {
    let mut args = vec![
        "kvroute-collector".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--scrape-interval-secs".into(),
        format!("{}", a.gateway_ms(SCRAPE_INTERVAL_MS) / 1000.0),
    ];
    for (i, (ep, replay)) in fleet.event_endpoints.iter().enumerate() {
        let addr = fleet.urls[i].trim_start_matches("http://");
        let mut spec = format!(
            "instance_id={},endpoint={ep},model={},block_size={},address={addr}",
            fleet.names[i], fleet.model, a.block_size
        );
        if let Some(r) = replay {
            spec.push_str(&format!(",replay={r}"));
        }
        args.push("--worker".into());
        args.push(spec);
    }
    if let Some(dir) = &fleet.tokenizer {
        args.push("--tokenizer".into());
        args.push(format!("{}={}", fleet.model, dir.display()));
    }
    let cli = <kvroute_collector::config::Cli as Parser>::try_parse_from(&args)
        .context("collector command line")?;
    let config = cli.into_config().context("collector config")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let shared = kvroute_collector::start(config).context("collector start")?;
    tokio::spawn(async move {
        if let Err(e) = kvroute_collector::serve(listener, shared, shutdown).await {
            tracing::error!(error = %e, "collector stopped");
        }
    });
    Ok(url)
}

pub(crate) async fn drain(fleet: &Fleet) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let busy = fleet.engines.iter().any(|e| {
            let s = e.stats(0);
            s.running + s.waiting > 0
        });
        if !busy || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) async fn drain_and_reset(fleet: &Fleet) {
    drain(fleet).await;
    for e in &fleet.engines {
        if !e.reset_prefix_cache() {
            tracing::warn!(engine = ?e, "prefix cache not reset: engine busy");
        }
    }
}

pub(crate) fn engine_load(fleet: &Fleet) -> EngineLoad {
    let mut l = EngineLoad::default();
    for e in &fleet.engines {
        let s = e.stats(0);
        l.requests.push(s.requests_finished);
        l.prompt_tokens.push(s.prompt_tokens);
        l.cached_tokens.push(s.prefix_hits_tokens);
    }
    l
}
