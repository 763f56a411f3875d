//! `kvroute-sim bench`: the routing comparison on one trace and one simulated fleet.
//!
//! # How it runs
//!
//! - The fleet is `--engines` simulated engines **in this process** (one tokio runtime), each
//!   with its own HTTP port and KV-event PUB + replay sockets on loopback, all running
//!   `--speed` times faster than real time. In-process engines let the oracle read every cache
//!   exactly and keep the run inside the machine's two cores.
//! - A real `kvroute-collector` also runs in-process (its library, started exactly as its
//!   binary does from the same command line), subscribed to every engine's ZMQ events.
//! - Each policy runs in turn on the same trace. Before each, the fleet drains and every
//!   engine resets its prefix cache (publishing `AllBlocksCleared`, so the collector and
//!   vllm-router drop their state too).
//! - Policies: `round-robin`, `least-request`, `kvroute` (collector `/query` + the core's
//!   `select::pick`), `oracle` (the same decision on exact cache contents), and the PyPI peers
//!   `vllm-router` (`kv_aware`, token-id prompts, fed the engines' events) and `sglang-router`
//!   (`cache_aware`, `t<id>` text prompts), run as child processes from `--venv`.
//! - Times are simulated seconds (measured wall time × `--speed`).

pub mod peers;
pub mod policy;
pub mod report;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cache::CacheConfig;
use crate::engine::{Engine, EngineConfig};
use crate::replay::{self, Api, ReplayConfig, Target};
use crate::trace;
use crate::wire::EventFormat;
use peers::{Peer, PeerEngine};
use policy::{KvAware, LeastRequest, MatchSource, RoundRobin, Slot};
use report::{EngineLoad, PolicyResult};

/// All policies, in run order.
pub const POLICIES: [&str; 6] = [
    "round-robin",
    "least-request",
    "kvroute",
    "oracle",
    "vllm-router",
    "sglang-router",
];

/// Flags of `kvroute-sim bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Mooncake-format trace.
    #[arg(
        long,
        default_value = "testdata/traces/mooncake_synthetic_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Time compression of engines and replay (simulated time / wall time).
    #[arg(long, default_value_t = 10.0)]
    pub speed: f64,
    /// Arrival-rate multiplier over the trace's own rate.
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Comma-separated policies to run (default: all).
    #[arg(long, value_delimiter = ',', default_values_t = POLICIES.map(String::from))]
    pub policies: Vec<String>,
    /// Output directory (results.json, results.md, PNG plots, per-request JSONL).
    #[arg(long, default_value = "sim/bench-out")]
    pub out: PathBuf,
    /// Python venv with vllm-router and sglang-router.
    #[arg(long, default_value = "sim/.venv-peers")]
    pub venv: PathBuf,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 25_000)]
    pub capacity_blocks: usize,
    /// Prefill throughput per engine, tokens/s (simulated).
    #[arg(long, default_value_t = 20_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Time per output token, ms (simulated).
    #[arg(long, default_value_t = 8.0)]
    pub decode_ms_per_token: f64,
    /// Output tokens per SSE chunk.
    #[arg(long, default_value_t = 16)]
    pub stream_interval: usize,
    /// Seed of the routers' tie-breaks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Window of the hit-rate-over-time plot, trace seconds.
    #[arg(long, default_value_t = 30.0)]
    pub window_s: f64,
}

const MODEL: &str = "sim-model";

/// The simulated engines of a bench, serving on loopback.
#[derive(Debug)]
pub struct Fleet {
    pub engines: Vec<Engine>,
    /// Base URLs, `http://127.0.0.1:port`.
    pub urls: Vec<String>,
    /// Instance ids.
    pub names: Vec<String>,
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
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    let mut names = Vec::new();
    for i in 0..a.engines {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let name = format!("engine-{i}");
        let e = Engine::start(EngineConfig {
            name: name.clone(),
            model: MODEL.into(),
            cache: CacheConfig {
                block_size_tokens: a.block_size,
                capacity_blocks: a.capacity_blocks,
            },
            prefill_tokens_per_s: a.prefill_tokens_per_s,
            decode_per_token: Duration::from_secs_f64(a.decode_ms_per_token / 1000.0),
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
    })
}

/// Starts the real collector in-process (its library, configured from the same command line
/// as its binary), registered with every engine; returns its URL.
///
/// # Errors
/// A collector that refuses the configuration.
pub async fn start_collector(a: &BenchArgs, fleet: &Fleet) -> anyhow::Result<String> {
    let mut args = vec![
        "kvroute-collector".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    for (i, e) in fleet.engines.iter().enumerate() {
        let (ep, replay) = e.event_endpoints()[0].clone();
        let addr = fleet.urls[i].trim_start_matches("http://");
        let mut spec = format!(
            "instance_id={},endpoint={ep},model={MODEL},block_size={},address={addr}",
            fleet.names[i], a.block_size
        );
        if let Some(r) = replay {
            spec.push_str(&format!(",replay={r}"));
        }
        args.push("--worker".into());
        args.push(spec);
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

async fn drain(fleet: &Fleet) {
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

async fn drain_and_reset(fleet: &Fleet) {
    drain(fleet).await;
    for e in &fleet.engines {
        if !e.reset_prefix_cache() {
            tracing::warn!(engine = ?e, "prefix cache not reset: engine busy");
        }
    }
}

fn engine_load(fleet: &Fleet) -> EngineLoad {
    let mut l = EngineLoad::default();
    for e in &fleet.engines {
        let s = e.stats(0);
        l.requests.push(s.requests_finished);
        l.prompt_tokens.push(s.prompt_tokens);
        l.cached_tokens.push(s.prefix_hits_tokens);
    }
    l
}

/// Runs the benchmark and writes its outputs.
///
/// # Errors
/// Setup failures (trace, sockets, collector); a peer that cannot run is skipped instead.
pub async fn main(a: BenchArgs) -> anyhow::Result<()> {
    let mut records =
        trace::load(&a.trace).with_context(|| format!("trace {}", a.trace.display()))?;
    if let Some(l) = a.limit {
        records.truncate(l);
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let fleet = start_fleet(&a).await?;
    let collector = start_collector(&a, &fleet).await?;
    let slots = fleet.slots();
    let peer_engines: Vec<PeerEngine> = fleet
        .engines
        .iter()
        .zip(&fleet.urls)
        .map(|(e, u)| PeerEngine {
            url: u.clone(),
            events_endpoint: e.event_endpoints()[0].0.clone(),
        })
        .collect();
    let trace_span_s = records.last().map_or(0.0, |r| r.timestamp as f64 / 1000.0) / a.rate_scale;
    eprintln!(
        "bench: {} requests over {:.0} s of trace time at {}x → ~{:.0} s per policy; {} engines; policies: {}",
        records.len(),
        trace_span_s,
        a.speed,
        trace_span_s / a.speed,
        a.engines,
        a.policies.join(", ")
    );
    let style = ProgressStyle::with_template(
        "{prefix:>14} [{bar:40.cyan/blue}] {pos}/{len} {elapsed_precise} {msg}",
    )
    .expect("template")
    .progress_chars("=> ");
    let mut results: Vec<PolicyResult> = Vec::new();
    for name in &a.policies {
        let mut peer_running = None;
        let mut api = Api::CompletionsIds;
        let mut kv: Option<Arc<KvAware>> = None;
        let target = match name.as_str() {
            "round-robin" => Target::Routed(Arc::new(RoundRobin::new(slots.clone()))),
            "least-request" => Target::Routed(Arc::new(LeastRequest::new(slots.clone(), a.seed))),
            "kvroute" | "oracle" => {
                let source = if name == "kvroute" {
                    MatchSource::Collector {
                        client: reqwest::Client::new(),
                        url: collector.clone(),
                        model: MODEL.into(),
                    }
                } else {
                    MatchSource::Oracle {
                        engines: fleet.engines.clone(),
                    }
                };
                let k = Arc::new(KvAware::new(
                    slots.clone(),
                    source,
                    a.block_size as u32,
                    a.seed,
                ));
                kv = Some(k.clone());
                Target::Routed(k)
            }
            "vllm-router" | "sglang-router" => {
                let peer = if name == "vllm-router" {
                    Peer::VllmRouter
                } else {
                    Peer::SglangRouter
                };
                if peer == Peer::SglangRouter {
                    api = Api::CompletionsText;
                }
                match peers::start(
                    peer,
                    &a.venv,
                    &peer_engines,
                    a.block_size,
                    MODEL,
                    &a.out.join("logs"),
                )
                .await
                {
                    Ok(r) => {
                        let url = r.url.clone();
                        peer_running = Some(r);
                        Target::Url(url)
                    }
                    Err(e) => {
                        eprintln!("bench: {name} skipped: {e}");
                        results.push(PolicyResult {
                            policy: name.clone(),
                            skipped: Some(e.to_string()),
                            summary: None,
                            engines: EngineLoad::default(),
                            prefill_utilization: 0.0,
                            wall_s: 0.0,
                            query_errors: 0,
                            results: Vec::new(),
                        });
                        continue;
                    }
                }
            }
            other => anyhow::bail!("unknown policy {other:?} (known: {})", POLICIES.join(", ")),
        };
        drain_and_reset(&fleet).await;
        let cfg = ReplayConfig {
            speed: a.speed,
            api,
            model: MODEL.into(),
            arrival_scale: a.rate_scale,
            ..ReplayConfig::default()
        };
        let bar = ProgressBar::new(records.len() as u64)
            .with_style(style.clone())
            .with_prefix(name.clone());
        let started = Instant::now();
        let per_request = replay::run(&records, target, &cfg, Some(bar.clone())).await;
        let wall_s = started.elapsed().as_secs_f64();
        let summary = replay::summarize(&per_request, &fleet.names);
        bar.finish_with_message(format!(
            "hit {:.1}%  TTFT p90 {:.2}s  failed {}",
            summary.hit_rate * 100.0,
            summary.model_ttft_p90_s,
            summary.failed
        ));
        if bar.is_hidden() {
            eprintln!(
                "bench: {name}: hit {:.1}%, TTFT p50 {:.2}s p90 {:.2}s (client p90 {:.2}s), failed {}, {:.0}s wall",
                summary.hit_rate * 100.0,
                summary.model_ttft_p50_s,
                summary.model_ttft_p90_s,
                summary.ttft_p90_s,
                summary.failed,
                wall_s
            );
        }
        if let Some(p) = peer_running.take() {
            p.stop().await;
        }
        drain(&fleet).await;
        let engines = engine_load(&fleet);
        let capacity = a.engines as f64 * a.prefill_tokens_per_s * summary.duration_s;
        results.push(PolicyResult {
            policy: name.clone(),
            skipped: None,
            prefill_utilization: if capacity > 0.0 {
                engines.computed_tokens() as f64 / capacity
            } else {
                0.0
            },
            summary: Some(summary),
            engines,
            wall_s,
            query_errors: kv.as_ref().map_or(0, |k| {
                k.query_errors.load(std::sync::atomic::Ordering::Relaxed)
            }),
            results: per_request,
        });
    }
    write_outputs(&a, &results, &fleet)?;
    Ok(())
}

fn write_outputs(a: &BenchArgs, results: &[PolicyResult], _fleet: &Fleet) -> anyhow::Result<()> {
    for r in results.iter().filter(|r| r.skipped.is_none()) {
        let mut text = String::new();
        for x in &r.results {
            text.push_str(&serde_json::to_string(x)?);
            text.push('\n');
        }
        std::fs::write(a.out.join(format!("{}.jsonl", r.policy)), text)?;
    }
    let table = report::table(results);
    println!("\n{table}");
    std::fs::write(a.out.join("results.md"), &table)?;
    let json = json!({
        "config": {
            "trace": a.trace.display().to_string(), "requests": results.iter().find_map(|r| r.summary.as_ref().map(|s| s.requests)),
            "engines": a.engines, "speed": a.speed, "rate_scale": a.rate_scale, "block_size": a.block_size,
            "capacity_blocks": a.capacity_blocks, "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "decode_ms_per_token": a.decode_ms_per_token, "seed": a.seed,
        },
        "policies": results,
    });
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    if report::load_font() {
        let title = format!("{} engines, {}x speed-up", a.engines, a.speed);
        if let Err(e) = report::plot_ttft_cdf(
            results,
            &a.out.join("ttft_cdf.png"),
            &format!("TTFT CDF per policy ({title})"),
        ) {
            eprintln!("bench: TTFT plot failed: {e}");
        }
        if let Err(e) = report::plot_hit_rate(
            results,
            &a.out.join("hit_rate.png"),
            a.window_s,
            &format!("Prefix hit rate over time ({title})"),
        ) {
            eprintln!("bench: hit-rate plot failed: {e}");
        }
    } else {
        eprintln!("bench: no TTF font found; plots skipped");
    }
    Ok(())
}
