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
    let text = match tokenizer {
        Some(dir) => {
            TextTokenizer::from_dir(dir).with_context(|| format!("tokenizer {}", dir.display()))?
        }
        None => TextTokenizer::Toy,
    };
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    let mut names = Vec::new();
    for i in 0..a.engines {
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
            prefill_tokens_per_s: a.prefill_tokens_per_s,
            decode_per_token: Duration::from_secs_f64(a.decode_ms_per_token / 1000.0),
            engine_model: a.engine_model,
            speed: a.speed,
            event_format: EventFormat::Vllm033,
            events_endpoint: Some("tcp://127.0.0.1:0".into()),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            stream_interval_tokens: a.stream_interval,
            ..EngineConfig::default()
        })
        .await?;
        let app = e.app();
        tokio::spawn(async move { axum::serve(listener, app).await });
        urls.push(format!("http://{addr}"));
        names.push(name);
        engines.push(e);
    }
    Ok(Fleet {
        engines,
        urls,
        names,
        model: model.into(),
        tokenizer: tokenizer.map(Path::to_path_buf),
    })
}

/// Starts the real collector in-process (its library, configured from the same command line
/// as its binary), registered with every engine, with the fleet's tokenizer; returns its URL.
///
/// # Errors
/// A collector that refuses the configuration.
pub async fn start_collector(a: &BenchArgs, fleet: &Fleet) -> anyhow::Result<String> {
    let mut args = vec![
        "kvroute-collector".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--scrape-interval-secs".into(),
        format!("{}", a.gateway_ms(SCRAPE_INTERVAL_MS) / 1000.0),
    ];
    for (i, e) in fleet.engines.iter().enumerate() {
        let (ep, replay) = e.event_endpoints()[0].clone();
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
        if let Err(e) = kvroute_collector::serve(listener, shared, std::future::pending()).await {
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
