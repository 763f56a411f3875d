//! `kvroute-sim`: `engine` (a simulated vLLM/SGLang engine; `--tokenizer DIR` for real text)
//! and `replay` (a Mooncake trace against a URL). `--help` on each describes its flags. The routing comparison is
//! `kvroute-bench routing`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_sim::cache::CacheConfig;
use kvroute_sim::engine::{Engine, EngineConfig, EngineModel};
use kvroute_sim::replay::{self, Api, ReplayConfig, Target};
use kvroute_sim::tokenizer::TextTokenizer;
use kvroute_sim::trace;
use kvroute_sim::wire::EventFormat;

#[derive(Parser)]
#[command(
    name = "kvroute-sim",
    version,
    about = "Engine simulator and trace replayer for kvroute"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a simulated engine: OpenAI-style HTTP plus KV events over ZMQ.
    Engine(EngineArgs),
    /// Replay a Mooncake-format trace against a URL and record per-request results.
    Replay(ReplayArgs),
}

#[derive(clap::Args)]
struct EngineArgs {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Instance id (response header `x-kvroute-sim-engine`); default: the listen address.
    #[arg(long)]
    name: Option<String>,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Timing model: serial (one FCFS prefill server, fixed time per output token) or vllm
    /// (vLLM V1's scheduler: steps with a token budget shared by decodes and chunked
    /// prefill, preemption when the KV cache is full).
    #[arg(long, value_enum, default_value_t = EngineModel::Serial)]
    engine_model: EngineModel,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per dp rank (default: 400k tokens of an 8B model on one H100).
    #[arg(long, default_value_t = 25_000)]
    capacity_blocks: usize,
    /// Prefill throughput on uncached tokens, tokens/s.
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tokens_per_s: f64,
    /// Fixed time from end of prefill to first token, ms.
    #[arg(long, default_value_t = 15.0)]
    prefill_overhead_ms: f64,
    /// Time per output token, ms.
    #[arg(long, default_value_t = 8.0)]
    decode_ms_per_token: f64,
    /// Concurrency limit per rank (vLLM max_num_seqs).
    #[arg(long, default_value_t = 256)]
    max_running: usize,
    /// Time dilation: every duration is divided by this (match `replay --speed`).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Data-parallel ranks (each with its own cache; event ports offset by the rank).
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// KV event format: vllm-0.33 | vllm-0.23 | sglang | sglang-0.5.18.
    #[arg(long, default_value = "vllm-0.33")]
    event_format: EventFormat,
    /// ZMQ PUB endpoint of rank 0 (binds), e.g. tcp://127.0.0.1:5557. Omit: no events.
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER replay endpoint of rank 0 (binds).
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// Topic frame of KV event messages.
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 1_000)]
    buffer_steps: usize,
    /// Seed of the engine's block hashes (default: the instance id).
    #[arg(long)]
    hash_seed: Option<String>,
    /// Output tokens per SSE chunk.
    #[arg(long, default_value_t = 1)]
    stream_interval: usize,
    /// Tokens per scheduler step (vLLM max_num_batched_tokens): KV events of one admission
    /// go out in batches of at most this many tokens' blocks.
    #[arg(long, default_value_t = 8192)]
    max_batched_tokens: usize,
    /// Longest prompt plus output accepted, tokens.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: usize,
    /// A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json): text prompts
    /// and chat messages are tokenized with it. Omit: the toy `t<id>` tokenizer.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Mooncake-format JSONL trace.
    #[arg(long)]
    trace: PathBuf,
    /// Base URL of the target, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    target: String,
    /// Trace time compression (use the engines' --speed).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Per-request results, JSON lines.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Send prompts as `t<id>` text instead of token ids.
    #[arg(long)]
    text: bool,
    /// Model name in requests.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Cap on output tokens per request.
    #[arg(long)]
    max_output_tokens: Option<usize>,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kvroute_sim=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    match Cli::parse().cmd {
        Cmd::Engine(a) => run_engine(a).await,
        Cmd::Replay(a) => run_replay(a).await,
    }
}

async fn run_engine(a: EngineArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("bind {}", a.listen))?;
    let addr = listener.local_addr()?;
    let tokenizer = match &a.tokenizer {
        Some(dir) => TextTokenizer::from_dir(dir)
            .with_context(|| format!("--tokenizer {}", dir.display()))?,
        None => TextTokenizer::Toy,
    };
    let cfg = EngineConfig {
        tokenizer,
        name: a.name.unwrap_or_else(|| addr.to_string()),
        model: a.model,
        engine_model: a.engine_model,
        cache: CacheConfig {
            block_size_tokens: a.block_size,
            capacity_blocks: a.capacity_blocks,
        },
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        prefill_overhead: Duration::from_secs_f64(a.prefill_overhead_ms / 1000.0),
        decode_per_token: Duration::from_secs_f64(a.decode_ms_per_token / 1000.0),
        max_running: a.max_running,
        speed: a.speed,
        dp_size: a.dp_size,
        event_format: a.event_format,
        events_endpoint: a.kv_events_endpoint,
        replay_endpoint: a.kv_events_replay_endpoint,
        topic: a.kv_events_topic,
        buffer_steps: a.buffer_steps,
        hash_seed: a.hash_seed.unwrap_or_default(),
        stream_interval_tokens: a.stream_interval,
        max_batched_tokens: a.max_batched_tokens,
        max_model_len: a.max_model_len,
        ..EngineConfig::default()
    };
    let engine = Engine::start(cfg).await?;
    for (rank, (ep, replay)) in engine.event_endpoints().iter().enumerate() {
        tracing::info!(rank, endpoint = %ep, replay = ?replay, "kv events");
    }
    tracing::info!(%addr, "engine listening");
    axum::serve(listener, engine.app())
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

async fn run_replay(a: ReplayArgs) -> anyhow::Result<()> {
    let records = trace::load(&a.trace)?;
    let cfg = ReplayConfig {
        speed: a.speed,
        limit: a.limit,
        api: if a.text {
            Api::CompletionsText
        } else {
            Api::CompletionsIds
        },
        model: a.model,
        max_output_tokens: a.max_output_tokens,
        ..ReplayConfig::default()
    };
    let n = a.limit.map_or(records.len(), |l| l.min(records.len()));
    let bar = indicatif::ProgressBar::new(n as u64);
    let results = replay::run(&records, Target::Url(a.target), &cfg, Some(bar.clone())).await;
    bar.finish_and_clear();
    if let Some(out) = &a.out {
        let mut text = String::new();
        for r in &results {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        std::fs::write(out, text).with_context(|| format!("write {}", out.display()))?;
    }
    let s = replay::summarize(&results, &[]);
    println!("{}", serde_json::to_string_pretty(&s)?);
    Ok(())
}
