//! The command line of `kvroute-bench routing`, and its scenarios and policies.

use std::path::PathBuf;

/// All policies.
pub const POLICIES: [&str; 16] = [
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
    "kvroute-ids",
    "kvroute-text-chat",
    "kvroute-text-prompt",
    "kvroute-text-approx",
    "kvroute-2gw-80-20",
    "kvroute-2gw-95-5",
];

/// The scenarios and their policies, in run order.
pub const SCENARIOS: [(&str, &[&str]); 4] = [
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
    (
        "text",
        &[
            "round-robin",
            "kvroute-ids",
            "kvroute-text-chat",
            "kvroute-text-prompt",
            "kvroute-text-approx",
            "sglang-router",
        ],
    ),
];

/// The scenarios run only when `--scenarios` names them (`make bench-routing-scenarios`), and
/// their policies, in run order: each on a fleet of its own (see [`super::scenarios`]).
pub const EXTRA_SCENARIOS: [(&str, &[&str]); 7] = [
    (
        "uneven",
        &[
            "round-robin",
            "least-request",
            "vllm-router",
            "kvroute-2gw-80-20",
            "kvroute-2gw-95-5",
        ],
    ),
    ("heterogeneous", &BASELINES_AND_KVROUTE),
    ("no-events", &BASELINES_AND_KVROUTE),
    ("decode-heavy", &BASELINES_AND_KVROUTE),
    ("failure", &BASELINES_AND_KVROUTE),
    (
        "scale",
        &[
            "round-robin",
            "least-request",
            "vllm-router",
            "kvroute-inproc",
            "kvroute",
            "kvroute-2gw",
            "kvroute-2gw-nofleet",
        ],
    ),
    ("shared-prefix", &BASELINES_AND_KVROUTE),
];

/// The policies of most extra scenarios: the shipped path beside the peer and two blind ones.
const BASELINES_AND_KVROUTE: [&str; 4] = ["round-robin", "least-request", "vllm-router", "kvroute"];

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
pub(crate) const SYNC_INTERVAL_MS: f64 = 25.0;
pub(crate) const SPECULATIVE_TTL_MS: f64 = 2_000.0;
pub(crate) const SCRAPE_INTERVAL_MS: f64 = 500.0;

impl BenchArgs {
    /// `ms` of shipped wall time as the gateway should run it in this benchmark.
    pub(crate) fn gateway_ms(&self, ms: f64) -> f64 {
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
    /// Comma-separated scenarios: trace, replicas, burst, text (the default), and uneven,
    /// heterogeneous, no-events, decode-heavy, failure, scale, shared-prefix (named only).
    #[arg(long, value_delimiter = ',', default_values_t = SCENARIOS.map(|s| s.0.to_string()))]
    pub scenarios: Vec<String>,
    /// Runs of each policy per scenario, interleaved across the policies. Tables, plots and
    /// targets take each policy's run with the median TTFT p90; results list every run.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
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
    /// The filter's `index.sync_interval_ms` (its feed pull and load report period) in
    /// shipped milliseconds, scaled like the other periods by `--gateway-clock` [default: 25].
    #[arg(long)]
    pub sync_interval_ms: Option<f64>,
    /// The filter's `collector.query_timeout_ms`, wall milliseconds (default: envoy.yaml's
    /// shipped 20). Text requests' exact path is this callout, tokenizing included.
    #[arg(long)]
    pub query_timeout_ms: Option<u32>,
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
    /// The engines' timing model: serial (one FCFS prefill server, a fixed time per output
    /// token; the model the router's defaults were tuned on) or vllm (vLLM V1's scheduler:
    /// steps whose token budget decodes share with chunked prefill, preemption on a full KV
    /// cache; `--decode-ms-per-token` does not apply).
    #[arg(long, value_enum, default_value_t = kvroute_sim::engine::EngineModel::Serial)]
    pub engine_model: kvroute_sim::engine::EngineModel,
    /// Output tokens per SSE chunk.
    #[arg(long, default_value_t = 16)]
    pub stream_interval: usize,
    /// Seed of the routers' tie-breaks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The text scenario's tokenizer (engines, collector and client): a directory with
    /// tokenizer.json and tokenizer_config.json.
    #[arg(long, default_value = "testdata/tokenizer/qwen3")]
    pub text_tokenizer: PathBuf,
    /// `heterogeneous`: engine 0's prefill and decode rates relative to the others'.
    #[arg(long, default_value_t = 0.5)]
    pub slow_engine_speed: f64,
    /// `decode-heavy`: the slice's total decode time over its total prefill time (the trace's
    /// own outputs give ~2.5 at the default rates; outputs are stretched by one factor).
    #[arg(long, default_value_t = 10.0)]
    pub decode_ratio: f64,
    /// `scale`: engines of its fleet (two gateways in front).
    #[arg(long, default_value_t = 16)]
    pub scale_engines: usize,
    /// `scale`: the prefill utilisation its arrival rate is set for (all prompt tokens
    /// counted as computed).
    #[arg(long, default_value_t = 0.6)]
    pub scale_utilization: f64,
    /// `shared-prefix`: requests (default: `--limit`, else 800).
    #[arg(long)]
    pub shared_prefix_requests: Option<usize>,
    /// Window of the hit-rate-over-time plot, trace seconds.
    #[arg(long, default_value_t = 30.0)]
    pub window_s: f64,
}

/// The model the token-id scenarios' engines serve (toy tokenizer).
pub const MODEL: &str = "sim-model";
