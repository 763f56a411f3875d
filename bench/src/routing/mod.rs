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
//!   (collector `/query` + the shipped decision, `kvroute::router::route`, over in-process books),
//!   `oracle` (the same decision on exact cache contents), `longest-prefix` (deepest match
//!   wins, as vllm-router); and the PyPI peers `vllm-router` (`kv_aware`, token-id prompts, fed
//!   the engines' events) and `sglang-router` (`cache_aware`, `t<id>` text prompts), run as
//!   child processes from `--venv`.
//! - Scenarios: `trace` (a: one gateway, the Mooncake trace), `replicas` (b: two Envoys
//!   sharing the collector, requests alternating, with fleet-wide load on and off), `burst`
//!   (c: a hot shared prefix, see [`burst`]) and `text` (the trace as chat and prompt text on
//!   a second fleet with a real tokenizer, see [`text`]). Each writes `<out>/<scenario>/`; `<out>/results.md`
//!   holds every table and the targets.
//! - Extra scenarios, run only when named: `uneven`, `heterogeneous`, `no-events`,
//!   `decode-heavy`, `failure`, `scale`, `shared-prefix`, each on a fleet and collector of its
//!   own (see [`scenarios`]).
//! - Times are simulated seconds (measured wall time × `--speed`).

pub mod args;
pub mod burst;
pub mod failure;
pub mod fleet;
pub mod floor;
pub mod gateway;
pub mod peers;
pub mod policy;
pub mod report;
pub mod scenarios;
pub mod split;
pub mod text;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

pub use args::{BenchArgs, Clock, EXTRA_SCENARIOS, MODEL, POLICIES, SCENARIOS};
use args::{SPECULATIVE_TTL_MS, SYNC_INTERVAL_MS};
use fleet::{drain, drain_and_reset, engine_load};
pub use fleet::{start_collector, start_fleet, start_fleet_with, Fleet};
use gateway::{Gateway, GatewaySetup};
use kvroute_sim::replay::{self, Api, Prompts, ReplayConfig, Target};
use kvroute_sim::trace;
use peers::{Peer, PeerEngine};
use policy::{Alternate, Choice, KvAware, LeastRequest, MatchSource, RoundRobin, Slot};
use report::PolicyResult;

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
    /// The text scenario's prepared prompts (its policies then run as [`text::policy`] says).
    prompts: Option<Arc<Prompts>>,
    /// Arrival-rate multiplier of the replays (`--rate-scale` unless a scenario sets one).
    rate_scale: f64,
    /// The client sends a failed request once more.
    retry_once: bool,
    /// The engine that fails during each run and the front it is reached through.
    failure: Option<Arc<(kvroute_sim::engine::Engine, failure::Front)>>,
    /// Dropped or sent: the collector stops.
    _collector_stop: tokio::sync::oneshot::Sender<()>,
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

/// The text scenario's context: a fleet with the real tokenizer, a collector holding it, and
/// every request's text and chat ids made before the first policy runs.
async fn text_ctx_start(
    a: &BenchArgs,
    records: &[trace::TraceRecord],
    gateway: Result<GatewaySetup, String>,
) -> anyhow::Result<Ctx> {
    let dir = a.text_tokenizer.clone();
    let fleet = start_fleet_with(a, text::TEXT_MODEL, Some(&dir)).await?;
    let started = Instant::now();
    let recs = records.to_vec();
    let prompts = tokio::task::spawn_blocking(move || {
        let tok = kvroute_sim::tokenizer::TextTokenizer::from_dir(&dir)
            .with_context(|| format!("tokenizer {}", dir.display()))?;
        anyhow::Ok(text::prepare(&recs, &tok, 2)?)
    })
    .await??;
    let tokens: usize = prompts.ids.iter().map(|i| i.len()).sum();
    eprintln!(
        "bench: text: {} prompts, {tokens} chat tokens, made and tokenized in {:.1} s",
        prompts.ids.len(),
        started.elapsed().as_secs_f64()
    );
    Ctx::new(a, fleet, gateway, Some(Arc::new(prompts))).await
}

impl Ctx {
    /// Starts the collector in front of `fleet` and gathers what the policies need.
    async fn new(
        a: &BenchArgs,
        fleet: Fleet,
        gateway: Result<GatewaySetup, String>,
        prompts: Option<Arc<Prompts>>,
    ) -> anyhow::Result<Ctx> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let collector = fleet::start_collector_until(a, &fleet, async {
            let _ = stopped.await;
        })
        .await?;
        let peer_engines = fleet
            .event_endpoints
            .iter()
            .zip(&fleet.urls)
            .map(|((ep, _), u)| PeerEngine {
                url: u.clone(),
                events_endpoint: ep.clone(),
            })
            .collect();
        Ok(Ctx {
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
            prompts,
            rate_scale: a.rate_scale,
            retry_once: false,
            failure: None,
            _collector_stop: stop,
        })
    }

    /// Stops the engines' servers, and the collector (its stop sender goes with `self`).
    fn stop(self) {
        self.fleet.stop();
    }

    async fn prepare(&self, name: &str) -> anyhow::Result<Prepared> {
        let a = &self.a;
        let model = self.fleet.model.as_str();
        let text = if self.prompts.is_some() {
            Some(text::policy(name).with_context(|| format!("no text policy {name:?}"))?)
        } else {
            None
        };
        let kv_aware = |source, choice| {
            Arc::new(
                KvAware::new(self.slots.clone(), source, a.block_size as u32, a.seed)
                    .with_choice(choice),
            )
        };
        let collector_source = || MatchSource::Collector {
            client: reqwest::Client::new(),
            url: format!("http://{}", self.collector),
            model: model.into(),
        };
        let routed = |t: Arc<dyn kvroute_sim::replay::Route>, kv| Prepared::Run {
            target: Target::Routed(t),
            api: text.as_ref().map_or(Api::CompletionsIds, |t| t.api),
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
            name if shipped_gateways(name).is_some() => {
                let setup = match &self.gateway {
                    Ok(s) => s,
                    Err(why) => return Ok(Prepared::Skipped(why.clone())),
                };
                let n = shipped_gateways(name).unwrap_or(1);
                let mut keys = text
                    .as_ref()
                    .map_or_else(serde_json::Map::new, |t| t.filter_keys.clone());
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
                        model,
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
                    } else if let Some(w) = split::weights(name) {
                        Target::Routed(Arc::new(split::Split::new(urls, w)))
                    } else {
                        Target::Routed(Arc::new(Alternate::new(urls)))
                    },
                    api: text.as_ref().map_or(Api::CompletionsIds, |t| t.api),
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
                    model,
                    &a.out.join("logs"),
                )
                .await
                {
                    Ok(r) => Prepared::Run {
                        target: Target::Url(r.url.clone()),
                        api: if let Some(t) = &text {
                            t.api
                        } else if peer == Peer::SglangRouter {
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
            model: self.fleet.model.clone(),
            arrival_scale: self.rate_scale,
            prompts: self.prompts.clone(),
            retry_once: self.retry_once,
            ..ReplayConfig::default()
        };
        let bar = ProgressBar::new(records.len() as u64)
            .with_style(self.style.clone())
            .with_prefix(name.to_string());
        let started = Instant::now();
        let chaos = self.failure.clone().map(|f| {
            let schedule = failure::FailureSchedule::of(records, speed, self.rate_scale);
            tokio::spawn(async move { failure::run(&f.0, &f.1, schedule).await })
        });
        let per_request = replay::run(records, target, &cfg, Some(bar.clone())).await;
        if let Some(c) = chaos {
            if !c.await.unwrap_or(false) {
                eprintln!("bench: {scenario}/{name}: the failed engine still held requests at its restart; its cache was not emptied");
            }
        }
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
        let capacity = self.fleet.prefill_tokens_per_s.iter().sum::<f64>() * summary.duration_s;
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
            runs_ttft_s: Vec::new(),
            runs_hit_rate: Vec::new(),
            no_wait_ttft_s: report::no_wait_ttft(
                &per_request,
                self.a.prefill_tokens_per_s,
                kvroute_sim::engine::EngineConfig::default()
                    .prefill_overhead
                    .as_secs_f64(),
            ),
            results: per_request,
        })
    }
}

/// The gateways a shipped-path policy runs (`None`: not one of them).
fn shipped_gateways(name: &str) -> Option<usize> {
    match name {
        "kvroute"
        | "kvroute-ids"
        | "kvroute-text-chat"
        | "kvroute-text-prompt"
        | "kvroute-text-approx" => Some(1),
        "kvroute-2gw" | "kvroute-2gw-nofleet" | "kvroute-2gw-80-20" | "kvroute-2gw-95-5" => Some(2),
        _ => None,
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
        sync_interval_ms: a
            .gateway_ms(a.sync_interval_ms.unwrap_or(SYNC_INTERVAL_MS))
            .round() as u32,
        query_timeout_ms: a.query_timeout_ms,
    })
}

/// Runs the benchmark and writes its outputs.
///
/// # Errors
/// Setup failures (trace, sockets, collector); a policy that cannot run is skipped instead.
pub async fn main(a: BenchArgs) -> anyhow::Result<()> {
    let full = trace::load(&a.trace).with_context(|| format!("trace {}", a.trace.display()))?;
    let records = full[..a.limit.map_or(full.len(), |l| l.min(full.len()))].to_vec();
    for s in &a.scenarios {
        anyhow::ensure!(
            SCENARIOS
                .iter()
                .chain(&EXTRA_SCENARIOS)
                .any(|(n, _)| n == s),
            "unknown scenario {s:?} (known: {})",
            SCENARIOS
                .iter()
                .chain(&EXTRA_SCENARIOS)
                .map(|s| s.0)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let gateway = gateway_setup(&a).await.map_err(|e| format!("{e:#}"));
    if let Ok(g) = &gateway {
        eprintln!(
            "bench: shipped path: {} with {}",
            g.envoy.display(),
            g.wasm.display()
        );
    }
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
    // The token-id scenarios' fleet (toy tokenizer); the text scenario gets its own below.
    let ids_ctx = if a
        .scenarios
        .iter()
        .any(|s| s != "text" && SCENARIOS.iter().any(|(n, _)| n == s))
    {
        Some(Ctx::new(&a, start_fleet(&a).await?, gateway.clone(), None).await?)
    } else {
        None
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
    let mut text_ctx: Option<Ctx> = None;
    for (scenario, policies) in SCENARIOS {
        if !a.scenarios.iter().any(|s| s == scenario) {
            continue;
        }
        let ctx = if scenario == "text" {
            // Started only now, so the token-id scenarios ran with nothing else in process.
            Some(&*text_ctx.insert(text_ctx_start(&a, &records, gateway.clone()).await?))
        } else {
            ids_ctx.as_ref()
        }
        .context("scenario context")?;
        // The engines run at `--speed`: every scenario replays at it.
        let (recs, speed) = if scenario == "burst" {
            (&burst_records, a.speed)
        } else {
            (&records, a.speed)
        };
        let results = run_policies(ctx, scenario, policies, recs, speed).await?;
        write_scenario(&a, scenario, &results, a.engines, "")?;
        all.push((scenario.to_string(), results));
    }
    let mut notes = Vec::new();
    for (scenario, policies) in EXTRA_SCENARIOS {
        if !a.scenarios.iter().any(|s| s == scenario) {
            continue;
        }
        let plan = scenarios::plan(scenario, &a, &full).context("scenario plan")?;
        let ctx = extra_ctx(&a, &plan, gateway.clone()).await?;
        eprintln!("bench: {scenario}: {}", plan.note);
        let results = run_policies(&ctx, scenario, policies, &plan.records, a.speed).await?;
        write_scenario(&a, scenario, &results, plan.fleet.engines, &plan.note)?;
        all.push((scenario.to_string(), results));
        notes.push((scenario.to_string(), plan.note));
        ctx.stop();
    }
    let floor = a.scenarios.iter().any(|s| s == "trace").then(|| {
        floor::fleet_lru_ttft(
            &records,
            floor::FleetShape {
                capacity_tokens: a.engines * a.capacity_blocks * a.block_size,
                prefill_tokens_per_s: a.prefill_tokens_per_s,
                overhead_s: kvroute_sim::engine::EngineConfig::default()
                    .prefill_overhead
                    .as_secs_f64(),
            },
        )
    });
    write_summary(&a, &all, floor, &notes)?;
    Ok(())
}

/// Runs each of `policies` that `--policies` selects on `recs`, `--repeat` times interleaved;
/// returns each policy's median run.
async fn run_policies(
    ctx: &Ctx,
    scenario: &str,
    policies: &[&str],
    recs: &[trace::TraceRecord],
    speed: f64,
) -> anyhow::Result<Vec<PolicyResult>> {
    let wanted: Vec<&str> = policies
        .iter()
        .copied()
        .filter(|p| ctx.a.policies.iter().any(|x| x == p))
        .collect();
    // Runs interleave (A, B, A, B, ...), so a slow phase of the machine hits every policy.
    let mut runs: Vec<Vec<PolicyResult>> = vec![Vec::new(); wanted.len()];
    for _ in 0..ctx.a.repeat.max(1) {
        for (name, r) in wanted.iter().zip(runs.iter_mut()) {
            r.push(ctx.run(scenario, name, recs, speed).await?);
        }
    }
    Ok(runs.into_iter().filter_map(report::median_run).collect())
}

/// The fleet, collector and client settings of an extra scenario.
async fn extra_ctx(
    a: &BenchArgs,
    plan: &scenarios::Plan,
    gateway: Result<GatewaySetup, String>,
) -> anyhow::Result<Ctx> {
    let mut fleet = fleet::start_fleet_spec(a, &plan.fleet, MODEL, None).await?;
    let failure = if plan.failure {
        // Everyone, the collector included, reaches engine 0 through the front that fails.
        let backend: std::net::SocketAddr = fleet.urls[0]
            .trim_start_matches("http://")
            .parse()
            .context("engine 0 address")?;
        let front = failure::Front::start(backend).await?;
        fleet.urls[0] = format!("http://{}", front.addr);
        Some(Arc::new((fleet.engines[0].clone(), front)))
    } else {
        None
    };
    let mut ctx = Ctx::new(a, fleet, gateway, None).await?;
    ctx.rate_scale = plan.rate_scale;
    ctx.retry_once = plan.retry_once;
    ctx.failure = failure;
    Ok(ctx)
}

/// Writes `<out>/<scenario>/`: per-request JSONL, the table (with the scenario's extra
/// columns and `note` below it) and the plots.
fn write_scenario(
    a: &BenchArgs,
    scenario: &str,
    results: &[PolicyResult],
    engines: usize,
    note: &str,
) -> anyhow::Result<()> {
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
    let mut md = report::table_with(results, scenarios::columns(scenario));
    if !note.is_empty() {
        md.push_str(&format!("\n{note}\n"));
    }
    std::fs::write(dir.join("results.md"), md)?;
    if !report::load_font() {
        eprintln!("bench: no TTF font found; plots skipped");
        return Ok(());
    }
    let title = format!("{scenario}: {engines} engines, {}x speed-up", a.speed);
    if let Err(e) = report::plot_ttft_cdf(
        results,
        &dir.join("ttft_cdf.png"),
        &format!("TTFT CDF ({title})"),
    ) {
        eprintln!("bench: {scenario} TTFT plot failed: {e}");
    }
    // The failure's dip and recovery show over time as the trace's warm-up does.
    if scenario == "trace" || scenario == "failure" {
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

/// `floor`: [`floor::fleet_lru_ttft`] of the trace scenario, when it ran; `notes`: the extra
/// scenarios' lines under their tables.
fn write_summary(
    a: &BenchArgs,
    all: &[(String, Vec<PolicyResult>)],
    floor: Option<([f64; 2], f64)>,
    notes: &[(String, String)],
) -> anyhow::Result<()> {
    let targets = report::targets(all, floor.map(|f| f.0));
    let mut md = String::new();
    for (scenario, results) in all {
        md.push_str(&format!(
            "### {scenario}\n\n{}\n",
            report::table_with(results, scenarios::columns(scenario))
        ));
        if let Some((_, n)) = notes.iter().find(|(s, _)| s == scenario) {
            md.push_str(&format!("{n}\n\n"));
        }
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
            "engines": a.engines, "speed": a.speed, "repeat": a.repeat,
            "rate_scale": a.rate_scale, "block_size": a.block_size,
            "capacity_blocks": a.capacity_blocks, "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "decode_ms_per_token": a.decode_ms_per_token, "seed": a.seed,
            "filter_config": a.filter_config, "gateway_clock": format!("{:?}", a.gateway_clock),
            "sync_interval_ms": a.sync_interval_ms.unwrap_or(SYNC_INTERVAL_MS),
            "burst": {"requests": a.burst_requests, "shared_tokens": a.burst_shared_tokens,
                      "tail_tokens": a.burst_tail_tokens, "cold": a.burst_cold},
        },
        "scenarios": scenarios,
        "fleet_lru_floor": floor.map(|([p50, p90], hit_rate)| json!({
            "ttft_p50_s": p50, "ttft_p90_s": p90, "hit_rate": hit_rate,
        })),
        "targets": targets,
        "extra": {
            "slow_engine_speed": a.slow_engine_speed, "decode_ratio": a.decode_ratio,
            "scale_engines": a.scale_engines, "scale_utilization": a.scale_utilization,
            "notes": notes.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        },
    });
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policies [`Ctx::prepare`] runs in process or as peers.
    const OTHERS: [&str; 7] = [
        "round-robin",
        "least-request",
        "kvroute-inproc",
        "longest-prefix",
        "oracle",
        "vllm-router",
        "sglang-router",
    ];

    #[test]
    fn every_scenarios_policy_is_listed_and_has_a_way_to_run() {
        for (scenario, policies) in SCENARIOS.iter().chain(&EXTRA_SCENARIOS) {
            for p in *policies {
                assert!(POLICIES.contains(p), "{scenario}/{p} not in POLICIES");
                assert!(
                    shipped_gateways(p).is_some() || OTHERS.contains(p),
                    "{scenario}/{p} cannot run"
                );
            }
        }
        assert_eq!(shipped_gateways("kvroute-2gw-95-5"), Some(2));
        assert_eq!(shipped_gateways("kvroute"), Some(1));
        // The split policies are two gateways with weights; the alternating ones none.
        assert!(split::weights("kvroute-2gw-80-20").is_some());
        assert!(split::weights("kvroute-2gw").is_none());
        // The default list is the four fitted scenarios; the extra ones are named apart.
        assert!(SCENARIOS
            .iter()
            .all(|(s, _)| !EXTRA_SCENARIOS.iter().any(|(e, _)| e == s)));
    }
}
