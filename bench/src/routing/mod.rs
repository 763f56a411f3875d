//! `kvroute-bench routing`: the routing comparison on one trace and one simulated fleet.
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
//! - Policies: `kvroute` is the **shipped path**: a real Envoy with the real filter (.wasm,
//!   `--wasm` / `KVROUTE_WASM`) and the in-process collector, Envoy's fallback round-robin
//!   ([`gateway`]). Beside it, in process: `round-robin`, `least-request`, `kvroute-inproc`
//!   (collector `/query` + the core's `select::pick`, prefill released at the first token),
//!   `oracle` (the same decision on exact cache contents), `longest-prefix` (deepest match
//!   wins, as vllm-router); and the PyPI peers `vllm-router` (`kv_aware`, token-id prompts, fed
//!   the engines' events) and `sglang-router` (`cache_aware`, `t<id>` text prompts), run as
//!   child processes from `--venv`.
//! - Scenarios: `trace` (a: one gateway, the Mooncake trace), `replicas` (b: two Envoys
//!   sharing the collector, requests alternating, with fleet-wide load on and off) and `burst`
//!   (c: a hot shared prefix, see [`burst`]). Each writes `<out>/<scenario>/`; `<out>/results.md`
//!   holds every table and the targets.
//! - Times are simulated seconds (measured wall time × `--speed`).

pub mod burst;
pub mod gateway;
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

use gateway::{Gateway, GatewaySetup};
use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{Engine, EngineConfig};
use kvroute_sim::replay::{self, Api, ReplayConfig, Target};
use kvroute_sim::trace;
use kvroute_sim::wire::EventFormat;
use peers::{Peer, PeerEngine};
use policy::{Alternate, Choice, KvAware, LeastRequest, MatchSource, RoundRobin, Slot};
use report::{EngineLoad, PolicyResult};

/// All policies.
pub const POLICIES: [&str; 10] = [
    "round-robin",
    "least-request",
    "kvroute-inproc",
    "oracle",
    "kvroute",
    "vllm-router",
    "sglang-router",
    "kvroute-2gw",
    "kvroute-2gw-nofleet",
    "longest-prefix",
];

/// The scenarios and their policies, in run order.
pub const SCENARIOS: [(&str, &[&str]); 3] = [
    (
        "trace",
        &[
            "round-robin",
            "least-request",
            "kvroute-inproc",
            "oracle",
            "kvroute",
            "vllm-router",
            "sglang-router",
        ],
    ),
    ("replicas", &["kvroute-2gw", "kvroute-2gw-nofleet"]),
    (
        "burst",
        &[
            "round-robin",
            "kvroute",
            "longest-prefix",
            "vllm-router",
            "sglang-router",
        ],
    ),
];

/// How the gateway's and collector's own periods relate to the simulation's clock.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// Shipped periods in simulated time (wall periods divided by `--speed`).
    Scaled,
    /// Shipped periods in wall time.
    Wall,
}

/// Shipped defaults of the periods `--gateway-clock` scales, milliseconds: the filter's feed
/// pull, its speculative entries' lifetime, the collector's engine scrape.
const SYNC_INTERVAL_MS: f64 = 100.0;
const SPECULATIVE_TTL_MS: f64 = 2_000.0;
const SCRAPE_INTERVAL_MS: f64 = 500.0;

impl BenchArgs {
    /// `ms` of shipped wall time as the gateway should run it in this benchmark.
    fn gateway_ms(&self, ms: f64) -> f64 {
        match self.gateway_clock {
            Clock::Scaled => (ms / self.speed.max(1e-9)).max(1.0),
            Clock::Wall => ms,
        }
    }
}

/// Flags of `kvroute-bench routing`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Mooncake-format trace.
    #[arg(long, default_value = "testdata/traces/mooncake_synthetic_trace.jsonl")]
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
    /// Comma-separated policies to run (default: all), in every scenario that has them.
    #[arg(long, value_delimiter = ',', default_values_t = POLICIES.map(String::from))]
    pub policies: Vec<String>,
    /// Comma-separated scenarios: trace, replicas, burst (default: all).
    #[arg(long, value_delimiter = ',', default_values_t = SCENARIOS.map(|s| s.0.to_string()))]
    pub scenarios: Vec<String>,
    /// Output directory (results.json, results.md, PNG plots, per-request JSONL).
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Envoy binary (default: $ENVOY, else what envoy-config/install-envoy.sh installs).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// The filter (default: $KVROUTE_WASM, else the target dir's wasm32-wasip1 release build).
    #[arg(long)]
    pub wasm: Option<PathBuf>,
    /// envoy.yaml, render.py and install-envoy.sh.
    #[arg(long, default_value = "envoy-config")]
    pub envoy_config: PathBuf,
    /// Envoy worker threads per gateway.
    #[arg(long, default_value_t = 2)]
    pub envoy_concurrency: usize,
    /// Extra filter configuration, a JSON object merged into envoy.yaml's (e.g.
    /// '{"route": {"max_hit_queue_tokens": 8192}}').
    #[arg(long, default_value = "{}")]
    pub filter_config: String,
    /// The gateway's and collector's own periods: `scaled` divides them by `--speed` (feed
    /// pull and load report 100 ms, speculative TTL 2 s, engine scrape 0.5 s, all in simulated
    /// time), so the compressed run sees them as an operator's real-time fleet does; `wall`
    /// keeps the shipped values in wall time (at `--speed 10` a 100 ms feed pull is then a
    /// 1 s lag in the simulation, which no real deployment has).
    #[arg(long, value_enum, default_value_t = Clock::Scaled)]
    pub gateway_clock: Clock,
    /// Requests of the burst sharing the system prompt.
    #[arg(long, default_value_t = 64)]
    pub burst_requests: usize,
    /// Shared system prompt of the burst, tokens.
    #[arg(long, default_value_t = 8192)]
    pub burst_shared_tokens: usize,
    /// Distinct tail of each burst request, tokens.
    #[arg(long, default_value_t = 2048)]
    pub burst_tail_tokens: usize,
    /// Cold requests after the burst.
    #[arg(long, default_value_t = 64)]
    pub burst_cold: usize,
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
        "--scrape-interval-secs".into(),
        format!("{}", a.gateway_ms(SCRAPE_INTERVAL_MS) / 1000.0),
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

/// What every policy run shares.
struct Ctx {
    a: BenchArgs,
    fleet: Fleet,
    /// The collector's `ip:port`.
    collector: String,
    slots: Vec<Slot>,
    peer_engines: Vec<PeerEngine>,
    /// How to start Envoy, or why it cannot be.
    gateway: Result<GatewaySetup, String>,
    style: ProgressStyle,
}

/// A routing target and what to release after the run.
enum Prepared {
    Run {
        target: Target,
        api: Api,
        kv: Option<Arc<KvAware>>,
        // Boxed: a running child process is large beside the skip reason.
        peer: Option<Box<peers::Running>>,
        gateways: Vec<Gateway>,
    },
    Skipped(String),
}

impl Ctx {
    async fn prepare(&self, name: &str) -> anyhow::Result<Prepared> {
        let a = &self.a;
        let kv_aware = |source, choice| {
            Arc::new(
                KvAware::new(self.slots.clone(), source, a.block_size as u32, a.seed)
                    .with_choice(choice),
            )
        };
        let collector_source = || MatchSource::Collector {
            client: reqwest::Client::new(),
            url: format!("http://{}", self.collector),
            model: MODEL.into(),
        };
        let routed = |t: Arc<dyn kvroute_sim::replay::Route>, kv| Prepared::Run {
            target: Target::Routed(t),
            api: Api::CompletionsIds,
            kv,
            peer: None,
            gateways: Vec::new(),
        };
        Ok(match name {
            "round-robin" => routed(Arc::new(RoundRobin::new(self.slots.clone())), None),
            "least-request" => routed(
                Arc::new(LeastRequest::new(self.slots.clone(), a.seed)),
                None,
            ),
            "kvroute-inproc" | "longest-prefix" => {
                let choice = if name == "kvroute-inproc" {
                    Choice::Cost
                } else {
                    Choice::LongestPrefix
                };
                let k = kv_aware(collector_source(), choice);
                routed(k.clone(), Some(k))
            }
            "oracle" => {
                let k = kv_aware(
                    MatchSource::Oracle {
                        engines: self.fleet.engines.clone(),
                    },
                    Choice::Cost,
                );
                routed(k.clone(), Some(k))
            }
            "kvroute" | "kvroute-2gw" | "kvroute-2gw-nofleet" => {
                let setup = match &self.gateway {
                    Ok(s) => s,
                    Err(why) => return Ok(Prepared::Skipped(why.clone())),
                };
                let n = if name == "kvroute" { 1 } else { 2 };
                let mut keys = serde_json::Map::new();
                if name.ends_with("nofleet") {
                    keys.insert("load".into(), json!({"fleet": false}));
                }
                let addrs: Vec<String> = self
                    .fleet
                    .urls
                    .iter()
                    .map(|u| u.trim_start_matches("http://").to_string())
                    .collect();
                let mut gateways = Vec::new();
                for i in 0..n {
                    match Gateway::start(
                        setup,
                        &format!("{name}-{i}"),
                        &addrs,
                        &self.collector,
                        &keys,
                        MODEL,
                    )
                    .await
                    {
                        Ok(g) => gateways.push(g),
                        Err(e) => {
                            for g in gateways {
                                g.stop().await;
                            }
                            return Ok(Prepared::Skipped(e.to_string()));
                        }
                    }
                }
                let urls: Vec<String> = gateways.iter().map(|g| g.url.clone()).collect();
                Prepared::Run {
                    target: if n == 1 {
                        Target::Url(urls[0].clone())
                    } else {
                        Target::Routed(Arc::new(Alternate::new(urls)))
                    },
                    api: Api::CompletionsIds,
                    kv: None,
                    peer: None,
                    gateways,
                }
            }
            "vllm-router" | "sglang-router" => {
                let peer = if name == "vllm-router" {
                    Peer::VllmRouter
                } else {
                    Peer::SglangRouter
                };
                match peers::start(
                    peer,
                    &a.venv,
                    &self.peer_engines,
                    a.block_size,
                    MODEL,
                    &a.out.join("logs"),
                )
                .await
                {
                    Ok(r) => Prepared::Run {
                        target: Target::Url(r.url.clone()),
                        api: if peer == Peer::SglangRouter {
                            Api::CompletionsText
                        } else {
                            Api::CompletionsIds
                        },
                        kv: None,
                        peer: Some(Box::new(r)),
                        gateways: Vec::new(),
                    },
                    Err(e) => Prepared::Skipped(e.to_string()),
                }
            }
            other => anyhow::bail!("unknown policy {other:?} (known: {})", POLICIES.join(", ")),
        })
    }

    /// Runs `name` on `records` at `speed`; a policy that cannot start is recorded as skipped.
    async fn run(
        &self,
        scenario: &str,
        name: &str,
        records: &[trace::TraceRecord],
        speed: f64,
    ) -> anyhow::Result<PolicyResult> {
        let (target, api, kv, peer, gateways) = match self.prepare(name).await? {
            Prepared::Run {
                target,
                api,
                kv,
                peer,
                gateways,
            } => (target, api, kv, peer, gateways),
            Prepared::Skipped(why) => {
                eprintln!("bench: {scenario}/{name} skipped: {why}");
                return Ok(PolicyResult::skipped(name, why));
            }
        };
        drain_and_reset(&self.fleet).await;
        let cfg = ReplayConfig {
            speed,
            api,
            model: MODEL.into(),
            arrival_scale: self.a.rate_scale,
            ..ReplayConfig::default()
        };
        let bar = ProgressBar::new(records.len() as u64)
            .with_style(self.style.clone())
            .with_prefix(name.to_string());
        let started = Instant::now();
        let per_request = replay::run(records, target, &cfg, Some(bar.clone())).await;
        let wall_s = started.elapsed().as_secs_f64();
        let summary = replay::summarize(&per_request, &self.fleet.names);
        let line = format!(
            "hit {:.1}%  TTFT p50 {:.2}s p90 {:.2}s  failed {}",
            summary.hit_rate * 100.0,
            summary.model_ttft_p50_s,
            summary.model_ttft_p90_s,
            summary.failed
        );
        bar.finish_with_message(line.clone());
        if bar.is_hidden() {
            eprintln!("bench: {scenario}/{name}: {line}, {wall_s:.0}s wall");
        }
        let mut gateway_stats = std::collections::BTreeMap::new();
        for g in gateways {
            for (k, v) in g.filter_stats().await {
                *gateway_stats.entry(k).or_insert(0) += v;
            }
            g.stop().await;
        }
        if let Some(p) = peer {
            p.stop().await;
        }
        drain(&self.fleet).await;
        let engines = engine_load(&self.fleet);
        let capacity = self.a.engines as f64 * self.a.prefill_tokens_per_s * summary.duration_s;
        Ok(PolicyResult {
            policy: name.to_string(),
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
            gateway_stats,
            results: per_request,
        })
    }
}

/// The filter and Envoy of the shipped path, from the flags and the environment.
async fn gateway_setup(a: &BenchArgs) -> anyhow::Result<GatewaySetup> {
    let wasm = a
        .wasm
        .clone()
        .or_else(|| std::env::var_os("KVROUTE_WASM").map(PathBuf::from))
        .unwrap_or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| PathBuf::from("target"), PathBuf::from)
                .join("wasm32-wasip1/release/kvroute_filter.wasm")
        });
    let envoy = match a
        .envoy
        .clone()
        .or_else(|| std::env::var_os("ENVOY").map(PathBuf::from))
    {
        Some(e) => e,
        None => gateway::installed_envoy(&a.envoy_config).await?,
    };
    let mut filter_config = match serde_json::from_str::<serde_json::Value>(&a.filter_config)
        .context("--filter-config")?
    {
        serde_json::Value::Object(m) => m,
        other => anyhow::bail!("--filter-config must be a JSON object, not {other}"),
    };
    // The scaled speculative TTL, unless the caller set one.
    let mut scaled = serde_json::Map::new();
    scaled.insert(
        "route".into(),
        json!({"speculative_ttl_ms": a.gateway_ms(SPECULATIVE_TTL_MS).round() as u64}),
    );
    gateway::merge(&mut scaled, &filter_config);
    filter_config = scaled;
    Ok(GatewaySetup {
        envoy,
        wasm,
        config_dir: a.envoy_config.clone(),
        concurrency: a.envoy_concurrency.max(1),
        filter_config,
        work_dir: a.out.join("logs"),
        sync_interval_ms: a.gateway_ms(SYNC_INTERVAL_MS).round() as u32,
    })
}

/// Runs the benchmark and writes its outputs.
///
/// # Errors
/// Setup failures (trace, sockets, collector); a policy that cannot run is skipped instead.
pub async fn main(a: BenchArgs) -> anyhow::Result<()> {
    let mut records =
        trace::load(&a.trace).with_context(|| format!("trace {}", a.trace.display()))?;
    if let Some(l) = a.limit {
        records.truncate(l);
    }
    for s in &a.scenarios {
        anyhow::ensure!(
            SCENARIOS.iter().any(|(n, _)| n == s),
            "unknown scenario {s:?} (known: trace, replicas, burst)"
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let fleet = start_fleet(&a).await?;
    let collector = start_collector(&a, &fleet).await?;
    let gateway = gateway_setup(&a).await.map_err(|e| format!("{e:#}"));
    if let Ok(g) = &gateway {
        eprintln!(
            "bench: shipped path: {} with {}",
            g.envoy.display(),
            g.wasm.display()
        );
    }
    let peer_engines = fleet
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
        "bench: trace: {} requests over {:.0} s of trace time at {}x → ~{:.0} s per policy; {} engines; scenarios: {}",
        records.len(),
        trace_span_s,
        a.speed,
        trace_span_s / a.speed,
        a.engines,
        a.scenarios.join(", ")
    );
    let ctx = Ctx {
        slots: fleet.slots(),
        collector: collector.trim_start_matches("http://").to_string(),
        fleet,
        peer_engines,
        gateway,
        style: ProgressStyle::with_template(
            "{prefix:>20} [{bar:40.cyan/blue}] {pos}/{len} {elapsed_precise} {msg}",
        )
        .expect("template")
        .progress_chars("=> "),
        a: a.clone(),
    };
    let burst_records = burst::trace(&burst::BurstShape {
        requests: a.burst_requests,
        shared_tokens: a.burst_shared_tokens,
        tail_tokens: a.burst_tail_tokens,
        cold: a.burst_cold,
        cold_tokens: 4096,
        output_tokens: 64,
    });
    let mut all: Vec<(String, Vec<PolicyResult>)> = Vec::new();
    for (scenario, policies) in SCENARIOS {
        if !a.scenarios.iter().any(|s| s == scenario) {
            continue;
        }
        // The engines run at `--speed`: every scenario replays at it.
        let (recs, speed) = if scenario == "burst" {
            (&burst_records, a.speed)
        } else {
            (&records, a.speed)
        };
        let mut results = Vec::new();
        for name in policies
            .iter()
            .filter(|p| a.policies.iter().any(|x| x == *p))
        {
            results.push(ctx.run(scenario, name, recs, speed).await?);
        }
        write_scenario(&a, scenario, &results)?;
        all.push((scenario.to_string(), results));
    }
    write_summary(&a, &all)?;
    Ok(())
}

fn write_scenario(a: &BenchArgs, scenario: &str, results: &[PolicyResult]) -> anyhow::Result<()> {
    let dir = a.out.join(scenario);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    for r in results.iter().filter(|r| r.skipped.is_none()) {
        let mut text = String::new();
        for x in &r.results {
            text.push_str(&serde_json::to_string(x)?);
            text.push('\n');
        }
        std::fs::write(dir.join(format!("{}.jsonl", r.policy)), text)?;
    }
    std::fs::write(dir.join("results.md"), report::table(results))?;
    if !report::load_font() {
        eprintln!("bench: no TTF font found; plots skipped");
        return Ok(());
    }
    let title = format!("{scenario}: {} engines, {}x speed-up", a.engines, a.speed);
    if let Err(e) = report::plot_ttft_cdf(
        results,
        &dir.join("ttft_cdf.png"),
        &format!("TTFT CDF ({title})"),
    ) {
        eprintln!("bench: {scenario} TTFT plot failed: {e}");
    }
    if scenario == "trace" {
        if let Err(e) = report::plot_hit_rate(
            results,
            &dir.join("hit_rate.png"),
            a.window_s,
            &format!("Prefix hit rate over time ({title})"),
        ) {
            eprintln!("bench: hit-rate plot failed: {e}");
        }
    }
    Ok(())
}

fn write_summary(a: &BenchArgs, all: &[(String, Vec<PolicyResult>)]) -> anyhow::Result<()> {
    let targets = report::targets(all);
    let mut md = String::new();
    for (scenario, results) in all {
        md.push_str(&format!("### {scenario}\n\n{}\n", report::table(results)));
    }
    md.push_str(&format!(
        "### targets\n\n{}",
        report::targets_table(&targets)
    ));
    println!("\n{md}");
    std::fs::write(a.out.join("results.md"), &md)?;
    let scenarios: serde_json::Map<String, serde_json::Value> = all
        .iter()
        .map(|(s, r)| Ok((s.clone(), serde_json::to_value(r)?)))
        .collect::<Result<_, serde_json::Error>>()?;
    let json = json!({
        "config": {
            "trace": a.trace.display().to_string(), "limit": a.limit,
            "engines": a.engines, "speed": a.speed,
            "rate_scale": a.rate_scale, "block_size": a.block_size,
            "capacity_blocks": a.capacity_blocks, "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "decode_ms_per_token": a.decode_ms_per_token, "seed": a.seed,
            "filter_config": a.filter_config, "gateway_clock": format!("{:?}", a.gateway_clock),
            "burst": {"requests": a.burst_requests, "shared_tokens": a.burst_shared_tokens,
                      "tail_tokens": a.burst_tail_tokens, "cold": a.burst_cold},
        },
        "scenarios": scenarios,
        "targets": targets,
    });
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    Ok(())
}
