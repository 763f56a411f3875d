//! Command line and config file (ARCHITECTURE.md, "Collector command line").
//!
//! `--config FILE` reads a TOML file with the same settings (snake_case keys); flags given on
//! the command line win over the file. The raw settings are then [`validate`](RawConfig)d into
//! a [`Config`], whose errors name the setting.
//!
//! One concern: the collector's settings, each written three times on purpose (the flag with
//! its help, the file key, the validated field with its default and check), so the file grows
//! with every setting rather than with any logic.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use kvroute::api::RegisterRequest;

use crate::hub::{Limits, MAX_WORKERS};

/// `--listen` default: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9090";

/// The collector's command line. Every flag can also be set in the `--config` file.
#[derive(Clone, Debug, Default, Parser)]
#[command(
    name = "kvroute-collector",
    version,
    about = "kvroute collector: subscribes to vLLM/SGLang KV events over ZMQ, keeps the prefix index, serves the indexer HTTP API and the filter feed."
)]
pub struct Cli {
    /// TOML file with the same settings as the flags (snake_case keys, `worker = [SPEC, ...]`); flags win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to serve HTTP on [default: 127.0.0.1:9090, loopback only].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Bearer token required on /register and /unregister.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "KVROUTE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Bearer token required on /query, /query_by_hash, /workers, /v1/feed and /v1/load.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "KVROUTE_READ_TOKEN",
        hide_env_values = true
    )]
    pub read_token: Option<String>,
    /// Directory for the state snapshot (registrations, index, last seq per worker), written periodically and on shutdown, loaded on start.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Serving port used to derive a worker's address from the IP of its ZMQ endpoint.
    #[arg(long, value_name = "PORT")]
    pub default_serving_port: Option<u16>,
    /// Register a worker at start: instance_id=A,endpoint=tcp://IP:PORT,model=M,block_size=N[,address=IP:PORT][,dp_rank=R][,replay=tcp://...][,tenant=T][,lora=L][,cache_salt=S]. Repeatable.
    #[arg(long = "worker", value_name = "SPEC")]
    pub workers: Vec<String>,
    /// Most blocks one worker may hold; stores past it are dropped and counted [default: 4194304].
    #[arg(long, value_name = "N")]
    pub max_blocks_per_worker: Option<usize>,
    /// Largest HTTP request body, bytes [default: 4194304].
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Most token ids (or hashes) one query may carry [default: 262144].
    #[arg(long, value_name = "N")]
    pub max_query_tokens: Option<usize>,
    /// Entries kept in the feed log; readers further behind get a snapshot [default: 1000000].
    #[arg(long, value_name = "N")]
    pub feed_log_entries: Option<usize>,
    /// Largest /v1/feed page, bytes [default: 1048576].
    #[arg(long, value_name = "BYTES")]
    pub max_feed_bytes: Option<usize>,
    /// How long a disconnected worker keeps its blocks before they are dropped, seconds [default: 60].
    #[arg(long, value_name = "SECS")]
    pub keep_disconnected_secs: Option<f64>,
    /// How long a replay may take before it is given up, seconds [default: 5].
    #[arg(long, value_name = "SECS")]
    pub replay_timeout_secs: Option<f64>,
    /// Interval between state snapshots with --state-dir, seconds [default: 30].
    #[arg(long, value_name = "SECS")]
    pub snapshot_interval_secs: Option<f64>,
    /// Most HTTP requests served at once [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_concurrent_requests: Option<usize>,
    /// Most HTTP connections open at once; when all are taken the oldest one waiting on its client is shed, and with none to shed a newcomer gets 503 [default: the descriptor limit (raised to the hard limit at start) less max(half of it, 1024), at most 16384; a larger value is cut to that budget].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Of --max-connections, slots only connections answered 2xx on /v1/feed, /query* or /v1/load may hold; newcomers never shed them [default: an eighth of the cap].
    #[arg(long, value_name = "N")]
    pub reserved_connections: Option<usize>,
    /// How long a client may take to send a request's headers, seconds [default: 10].
    #[arg(long, value_name = "SECS")]
    pub header_read_timeout_secs: Option<f64>,
    /// How long a client may take to send a request's body, seconds; then 408 [default: 10].
    #[arg(long, value_name = "SECS")]
    pub body_read_timeout_secs: Option<f64>,
    /// Longest gap between a request body's bytes, seconds; then 408 [default: 1].
    #[arg(long, value_name = "SECS")]
    pub body_stall_timeout_secs: Option<f64>,
    /// Slowest request body taken after its first second, bytes per second; a slower one gets 408; 0: no rate rule [default: 32768].
    #[arg(long, value_name = "BYTES")]
    pub min_body_bytes_per_sec: Option<u64>,
    /// On SIGTERM, how long in-flight requests may run before they are cut and the final snapshot is written, seconds [default: 10].
    #[arg(long, value_name = "SECS")]
    pub shutdown_timeout_secs: Option<f64>,
    /// Largest ZMQ frame taken from an engine (ZMQ_MAXMSGSIZE); a publisher sending more is disconnected and counted [default: 8388608].
    #[arg(long, value_name = "BYTES")]
    pub max_zmq_message_bytes: Option<usize>,
    /// Allow a non-loopback --listen without --admin-token (anyone who reaches it may /register).
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Served names (LoRA names) one registration's events may add [default: 64].
    #[arg(long, value_name = "N")]
    pub max_aliases_per_worker: Option<usize>,
    /// Served names in all [default: 16384].
    #[arg(long, value_name = "N")]
    pub max_aliases: Option<usize>,
    /// dp ranks one registration's batches may name besides its own [default: 64].
    #[arg(long, value_name = "N")]
    pub max_dp_ranks_per_worker: Option<usize>,
    /// Workers named by batches' dp ranks in all; the other slots stay for /register [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_dp_workers: Option<usize>,
    /// SGLang page records held in all [default: 16777216].
    #[arg(long, value_name = "N")]
    pub max_pages: Option<usize>,
    /// Most blocks applied per hold of the state lock; bigger batches go in slices [default: 8192].
    #[arg(long, value_name = "N")]
    pub ingest_slice_blocks: Option<usize>,
    /// /health says "degraded" while a batch has been applying longer than this, seconds [default: 2].
    #[arg(long, value_name = "SECS")]
    pub ingest_lag_degraded_secs: Option<f64>,
    /// A gateway that has not posted /v1/load for this long is dropped from the fleet sums, seconds [default: 5].
    #[arg(long, value_name = "SECS")]
    pub gateway_timeout_secs: Option<f64>,
    /// Most gateways reporting load at once; a new one past it is refused [default: 64].
    #[arg(long, value_name = "N")]
    pub max_gateways: Option<usize>,
    /// Interval between scrapes of each engine's /metrics, seconds; 0 disables [default: 0.5].
    #[arg(long, value_name = "SECS")]
    pub scrape_interval_secs: Option<f64>,
    /// Longest one engine /metrics scrape may take, seconds [default: 0.25].
    #[arg(long, value_name = "SECS")]
    pub scrape_timeout_secs: Option<f64>,
    /// Age past which an engine sample is reported stale, seconds [default: 2].
    #[arg(long, value_name = "SECS")]
    pub engine_stale_secs: Option<f64>,
    /// An engine whose /metrics answered once and has failed for this long is taken as down and no longer routed to, until it answers again, seconds [default: 5].
    #[arg(long, value_name = "SECS")]
    pub engine_down_secs: Option<f64>,
    /// Alarm `engine_silent` when an engine serving traffic sent no KV event for this long, seconds [default: 300].
    #[arg(long, value_name = "SECS")]
    pub alarm_silent_secs: Option<f64>,
    /// The truth check's sliding window: kvroute's predicted cached tokens against the engines' reported reuse, seconds [default: 60].
    #[arg(long, value_name = "SECS")]
    pub truth_window_secs: Option<f64>,
    /// Alarm `hash_mismatch` when predicted and engine-reported reuse differ by more than this factor either way (over 1) [default: 2].
    #[arg(long, value_name = "FACTOR")]
    pub hash_mismatch_factor: Option<f64>,
    /// ... and the larger of the two reached this many tokens within the window [default: 4096].
    #[arg(long, value_name = "TOKENS")]
    pub hash_mismatch_min_tokens: Option<u64>,
    /// ... and all that held for this long: longer than a request takes from its gateway's report to its engine's next scrape, seconds [default: 15].
    #[arg(long, value_name = "SECS")]
    pub hash_mismatch_hold_secs: Option<f64>,
    /// Alarm `gateway_stale` when a gateway that reported stops for this long, or reports a feed lag this long, seconds [default: 30].
    #[arg(long, value_name = "SECS")]
    pub alarm_gateway_stale_secs: Option<f64>,
    /// Largest engine /metrics page read; reading stops there [default: 1048576].
    #[arg(long, value_name = "BYTES")]
    pub max_metrics_bytes: Option<usize>,
    /// A model's Hugging Face tokenizer for text requests: MODEL=DIR, DIR holding tokenizer.json (and tokenizer_config.json for the chat template). Repeatable.
    #[arg(long = "tokenizer", value_name = "MODEL=DIR")]
    pub tokenizers: Vec<String>,
    /// Most --tokenizer models (each holds its vocabulary in memory, ~50-100 MB) [default: 16].
    #[arg(long, value_name = "N")]
    pub max_tokenizers: Option<usize>,
    /// Largest text of one text request (a prompt, or all messages' content), bytes; more gets 413 [default: 1048576].
    #[arg(long, value_name = "BYTES")]
    pub max_text_bytes: Option<usize>,
    /// Most messages in one chat request; more gets 413 [default: 2048].
    #[arg(long, value_name = "N")]
    pub max_messages: Option<usize>,
    #[command(flatten)]
    pub nats: crate::bus::settings::NatsArgs,
}

/// The `--config` file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub admin_token: Option<String>,
    pub read_token: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub default_serving_port: Option<u16>,
    #[serde(default, alias = "workers")]
    pub worker: Vec<String>,
    pub max_blocks_per_worker: Option<usize>,
    pub max_body_bytes: Option<usize>,
    pub max_query_tokens: Option<usize>,
    pub feed_log_entries: Option<usize>,
    pub max_feed_bytes: Option<usize>,
    pub keep_disconnected_secs: Option<f64>,
    pub replay_timeout_secs: Option<f64>,
    pub snapshot_interval_secs: Option<f64>,
    pub max_concurrent_requests: Option<usize>,
    pub max_connections: Option<usize>,
    pub reserved_connections: Option<usize>,
    pub header_read_timeout_secs: Option<f64>,
    pub body_read_timeout_secs: Option<f64>,
    pub body_stall_timeout_secs: Option<f64>,
    pub min_body_bytes_per_sec: Option<u64>,
    pub shutdown_timeout_secs: Option<f64>,
    pub max_zmq_message_bytes: Option<usize>,
    #[serde(default)]
    pub insecure_no_auth: bool,
    pub max_aliases_per_worker: Option<usize>,
    pub max_aliases: Option<usize>,
    pub max_dp_ranks_per_worker: Option<usize>,
    pub max_dp_workers: Option<usize>,
    pub max_pages: Option<usize>,
    pub ingest_slice_blocks: Option<usize>,
    pub ingest_lag_degraded_secs: Option<f64>,
    pub gateway_timeout_secs: Option<f64>,
    pub max_gateways: Option<usize>,
    pub scrape_interval_secs: Option<f64>,
    pub scrape_timeout_secs: Option<f64>,
    pub engine_stale_secs: Option<f64>,
    pub engine_down_secs: Option<f64>,
    pub alarm_silent_secs: Option<f64>,
    pub truth_window_secs: Option<f64>,
    pub hash_mismatch_factor: Option<f64>,
    pub hash_mismatch_min_tokens: Option<u64>,
    pub hash_mismatch_hold_secs: Option<f64>,
    pub alarm_gateway_stale_secs: Option<f64>,
    pub max_metrics_bytes: Option<usize>,
    #[serde(default, alias = "tokenizers")]
    pub tokenizer: Vec<String>,
    pub max_tokenizers: Option<usize>,
    pub max_text_bytes: Option<usize>,
    pub max_messages: Option<usize>,
    /// The `[nats]` table: the `--nats*` settings without the prefix.
    pub nats: Option<crate::bus::settings::NatsFile>,
}

/// `--tokenizer MODEL=DIR`: where a served model's tokenizer lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerSpec {
    /// The model name requests carry (`model` / `model_name`).
    pub model: String,
    /// Directory with `tokenizer.json` (and `tokenizer_config.json`).
    pub dir: PathBuf,
}

/// The validated settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// HTTP listen address.
    pub listen: SocketAddr,
    pub admin_token: Option<String>,
    pub read_token: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub default_serving_port: Option<u16>,
    /// Workers registered at start.
    pub workers: Vec<RegisterRequest>,
    pub max_blocks_per_worker: usize,
    /// Page records the SGLang re-chunker keeps per worker.
    pub max_pages_per_worker: usize,
    pub max_body_bytes: usize,
    pub max_query_tokens: usize,
    pub feed_log_entries: usize,
    pub max_feed_bytes: usize,
    pub keep_disconnected: Duration,
    pub replay_timeout: Duration,
    pub snapshot_interval: Duration,
    pub max_concurrent_requests: usize,
    /// Open HTTP connections at most (see `server::connection_cap`); `None`: derived from the
    /// descriptor limit when serving.
    pub max_connections: Option<usize>,
    /// Of the cap, slots kept for proven gateway connections; `None`: an eighth of the cap.
    pub reserved_connections: Option<usize>,
    pub header_read_timeout: Duration,
    /// The whole request body within this.
    pub body_read_timeout: Duration,
    /// Longest gap between a request body's bytes.
    pub body_stall_timeout: Duration,
    /// Slowest request body past its first second, bytes per second; 0: no rate rule.
    pub min_body_bytes_per_sec: u64,
    /// Bound on graceful shutdown before the final snapshot.
    pub shutdown_timeout: Duration,
    /// `ZMQ_MAXMSGSIZE` of every socket towards an engine.
    pub max_zmq_message_bytes: usize,
    /// A non-loopback listener without an admin token was asked for explicitly.
    pub insecure_no_auth: bool,
    /// Caps on what engines' events may create.
    pub limits: Limits,
    /// `/health` is degraded while a batch has been applying longer than this.
    pub ingest_lag_degraded: Duration,
    /// Gateways silent this long leave the fleet sums.
    pub gateway_timeout: Duration,
    pub max_gateways: usize,
    /// Engine `/metrics` scrape interval; zero disables scraping.
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    pub engine_stale: Duration,
    /// Failing `/metrics` after answering: down past this.
    pub engine_down: Duration,
    /// Alarm `engine_silent` after an engine served traffic this long without a KV event.
    pub alarm_silent: Duration,
    /// The truth check: window, `hash_mismatch` factor and volume floor.
    pub truth: crate::truth::TruthConfig,
    /// Alarm `gateway_stale` when a gateway's reports stop, or its feed lags, this long.
    pub alarm_gateway_stale: Duration,
    pub max_metrics_bytes: usize,
    /// Tokenizers for text requests, one per model.
    pub tokenizers: Vec<TokenizerSpec>,
    /// Size limits of text requests.
    pub text_limits: kvroute_text::Limits,
    /// The NATS event bus (`--nats`); `None`: off, engines over ZMQ only.
    pub nats: Option<crate::bus::settings::BusConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            admin_token: None,
            read_token: None,
            state_dir: None,
            default_serving_port: None,
            workers: Vec::new(),
            max_blocks_per_worker: 1 << 22,
            max_pages_per_worker: 1 << 22,
            max_body_bytes: 4 << 20,
            max_query_tokens: 1 << 18,
            feed_log_entries: 1_000_000,
            max_feed_bytes: 1 << 20,
            keep_disconnected: Duration::from_secs(60),
            replay_timeout: Duration::from_secs(5),
            snapshot_interval: Duration::from_secs(30),
            max_concurrent_requests: 1024,
            // From the descriptor limit when serving (server::connection_cap).
            max_connections: None,
            reserved_connections: None,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            body_stall_timeout: crate::edge::DEFAULT_BODY_STALL_TIMEOUT,
            min_body_bytes_per_sec: crate::edge::DEFAULT_MIN_BODY_BYTES_PER_SEC,
            shutdown_timeout: Duration::from_secs(10),
            // A real engine batch is a few KiB; vLLM's largest is far under this.
            max_zmq_message_bytes: 8 << 20,
            insecure_no_auth: false,
            limits: Limits::default(),
            ingest_lag_degraded: Duration::from_secs(2),
            gateway_timeout: Duration::from_secs(5),
            max_gateways: 64,
            scrape_interval: Duration::from_millis(500),
            scrape_timeout: Duration::from_millis(250),
            engine_stale: Duration::from_secs(2),
            engine_down: Duration::from_secs(5),
            alarm_silent: Duration::from_secs(300),
            truth: crate::truth::TruthConfig::default(),
            alarm_gateway_stale: Duration::from_secs(30),
            max_metrics_bytes: 1 << 20,
            tokenizers: Vec::new(),
            text_limits: kvroute_text::Limits::default(),
            nats: None,
        }
    }
}

/// Most `--tokenizer` models by default.
pub const DEFAULT_MAX_TOKENIZERS: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("--config {path}: {msg}")]
    File { path: String, msg: String },
    #[error("--worker {spec:?}: {msg}")]
    Worker { spec: String, msg: String },
    #[error("--{flag}: {msg}")]
    Value { flag: &'static str, msg: String },
    #[error("--tokenizer {spec:?}: {msg}")]
    Tokenizer { spec: String, msg: String },
    #[error("--listen {listen} is not loopback and no --admin-token is set: anyone who reaches it could /register endpoints; set --admin-token, or pass --insecure-no-auth to accept that")]
    OpenWithoutAuth { listen: SocketAddr },
}

impl Cli {
    /// Merges the `--config` file under the flags and validates the result.
    ///
    /// # Errors
    /// An unreadable or invalid file, a bad worker spec or an out-of-range value.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                    path: path.display().to_string(),
                    msg: e.to_string(),
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::File {
                    path: path.display().to_string(),
                    msg: e.to_string(),
                })?
            }
            None => FileConfig::default(),
        };
        let d = Config::default();
        let secs = |flag: &'static str,
                    v: Option<f64>,
                    default: Duration|
         -> Result<Duration, ConfigError> {
            match v {
                None => Ok(default),
                Some(s) if (0.0..1e9).contains(&s) => Ok(Duration::from_secs_f64(s)),
                Some(s) => Err(ConfigError::Value {
                    flag,
                    msg: format!("{s} is not a number of seconds"),
                }),
            }
        };
        let positive =
            |flag: &'static str, v: Option<usize>, default: usize| -> Result<usize, ConfigError> {
                match v {
                    None => Ok(default),
                    Some(0) => Err(ConfigError::Value {
                        flag,
                        msg: "must be at least 1".into(),
                    }),
                    Some(n) => Ok(n),
                }
            };
        let positive_secs = |flag: &'static str,
                             v: Option<f64>,
                             default: Duration|
         -> Result<Duration, ConfigError> {
            match secs(flag, v, default)? {
                d if d.is_zero() => Err(ConfigError::Value {
                    flag,
                    msg: "must be more than 0".into(),
                }),
                d => Ok(d),
            }
        };
        // An empty token would switch auth off without anyone noticing.
        let token = |flag: &'static str, v: Option<String>| match v {
            Some(t) if t.trim().is_empty() => Err(ConfigError::Value {
                flag,
                msg: "empty token; leave the setting out for no token".into(),
            }),
            v => Ok(v),
        };
        let admin_token = token("admin-token", self.admin_token.or(file.admin_token))?;
        let read_token = token("read-token", self.read_token.or(file.read_token))?;
        let listen = self.listen.or(file.listen).unwrap_or(d.listen);
        let insecure_no_auth = self.insecure_no_auth || file.insecure_no_auth;
        if !listen.ip().is_loopback() && admin_token.is_none() && !insecure_no_auth {
            return Err(ConfigError::OpenWithoutAuth { listen });
        }
        let mut specs = file.worker.clone();
        specs.extend(self.workers.iter().cloned());
        let workers = specs
            .iter()
            .map(|s| parse_worker_spec(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tokenizer_specs = file.tokenizer.clone();
        tokenizer_specs.extend(self.tokenizers.iter().cloned());
        let tokenizers = parse_tokenizer_specs(
            &tokenizer_specs,
            positive(
                "max-tokenizers",
                self.max_tokenizers.or(file.max_tokenizers),
                DEFAULT_MAX_TOKENIZERS,
            )?,
        )?;
        let text_limits = kvroute_text::Limits {
            max_text_bytes: positive(
                "max-text-bytes",
                self.max_text_bytes.or(file.max_text_bytes),
                d.text_limits.max_text_bytes,
            )?,
            max_messages: positive(
                "max-messages",
                self.max_messages.or(file.max_messages),
                d.text_limits.max_messages,
            )?,
        };
        let max_blocks_per_worker = positive(
            "max-blocks-per-worker",
            self.max_blocks_per_worker.or(file.max_blocks_per_worker),
            d.max_blocks_per_worker,
        )?;
        let feed_log_given = self.feed_log_entries.or(file.feed_log_entries).is_some();
        let mut config = Config {
            listen,
            admin_token,
            read_token,
            state_dir: self.state_dir.or(file.state_dir),
            default_serving_port: self.default_serving_port.or(file.default_serving_port),
            workers,
            max_blocks_per_worker,
            max_pages_per_worker: max_blocks_per_worker,
            max_body_bytes: positive(
                "max-body-bytes",
                self.max_body_bytes.or(file.max_body_bytes),
                d.max_body_bytes,
            )?,
            max_query_tokens: positive(
                "max-query-tokens",
                self.max_query_tokens.or(file.max_query_tokens),
                d.max_query_tokens,
            )?,
            feed_log_entries: positive(
                "feed-log-entries",
                self.feed_log_entries.or(file.feed_log_entries),
                d.feed_log_entries,
            )?,
            max_feed_bytes: positive(
                "max-feed-bytes",
                self.max_feed_bytes.or(file.max_feed_bytes),
                d.max_feed_bytes,
            )?,
            keep_disconnected: secs(
                "keep-disconnected-secs",
                self.keep_disconnected_secs.or(file.keep_disconnected_secs),
                d.keep_disconnected,
            )?,
            replay_timeout: secs(
                "replay-timeout-secs",
                self.replay_timeout_secs.or(file.replay_timeout_secs),
                d.replay_timeout,
            )?,
            snapshot_interval: secs(
                "snapshot-interval-secs",
                self.snapshot_interval_secs.or(file.snapshot_interval_secs),
                d.snapshot_interval,
            )?,
            max_concurrent_requests: positive(
                "max-concurrent-requests",
                self.max_concurrent_requests
                    .or(file.max_concurrent_requests),
                d.max_concurrent_requests,
            )?,
            max_connections: match self.max_connections.or(file.max_connections) {
                None => None,
                n => Some(positive("max-connections", n, 1)?),
            },
            reserved_connections: self.reserved_connections.or(file.reserved_connections),
            header_read_timeout: positive_secs(
                "header-read-timeout-secs",
                self.header_read_timeout_secs
                    .or(file.header_read_timeout_secs),
                d.header_read_timeout,
            )?,
            body_read_timeout: positive_secs(
                "body-read-timeout-secs",
                self.body_read_timeout_secs.or(file.body_read_timeout_secs),
                d.body_read_timeout,
            )?,
            body_stall_timeout: positive_secs(
                "body-stall-timeout-secs",
                self.body_stall_timeout_secs
                    .or(file.body_stall_timeout_secs),
                d.body_stall_timeout,
            )?,
            min_body_bytes_per_sec: self
                .min_body_bytes_per_sec
                .or(file.min_body_bytes_per_sec)
                .unwrap_or(d.min_body_bytes_per_sec),
            shutdown_timeout: positive_secs(
                "shutdown-timeout-secs",
                self.shutdown_timeout_secs.or(file.shutdown_timeout_secs),
                d.shutdown_timeout,
            )?,
            max_zmq_message_bytes: positive(
                "max-zmq-message-bytes",
                self.max_zmq_message_bytes.or(file.max_zmq_message_bytes),
                d.max_zmq_message_bytes,
            )?,
            insecure_no_auth,
            limits: Limits {
                aliases_per_worker: positive(
                    "max-aliases-per-worker",
                    self.max_aliases_per_worker.or(file.max_aliases_per_worker),
                    d.limits.aliases_per_worker,
                )?,
                aliases: positive(
                    "max-aliases",
                    self.max_aliases.or(file.max_aliases),
                    d.limits.aliases,
                )?,
                dp_ranks_per_worker: positive(
                    "max-dp-ranks-per-worker",
                    self.max_dp_ranks_per_worker
                        .or(file.max_dp_ranks_per_worker),
                    d.limits.dp_ranks_per_worker,
                )?,
                dp_workers: match self.max_dp_workers.or(file.max_dp_workers) {
                    Some(n) if n >= MAX_WORKERS => {
                        return Err(ConfigError::Value {
                            flag: "max-dp-workers",
                            msg: format!(
                                "must be below {MAX_WORKERS}, leaving slots for /register"
                            ),
                        })
                    }
                    v => positive("max-dp-workers", v, d.limits.dp_workers)?,
                },
                pages: positive(
                    "max-pages",
                    self.max_pages.or(file.max_pages),
                    d.limits.pages,
                )?,
                slice_blocks: positive(
                    "ingest-slice-blocks",
                    self.ingest_slice_blocks.or(file.ingest_slice_blocks),
                    d.limits.slice_blocks,
                )?,
            },
            ingest_lag_degraded: secs(
                "ingest-lag-degraded-secs",
                self.ingest_lag_degraded_secs
                    .or(file.ingest_lag_degraded_secs),
                d.ingest_lag_degraded,
            )?,
            gateway_timeout: secs(
                "gateway-timeout-secs",
                self.gateway_timeout_secs.or(file.gateway_timeout_secs),
                d.gateway_timeout,
            )?,
            max_gateways: positive(
                "max-gateways",
                self.max_gateways.or(file.max_gateways),
                d.max_gateways,
            )?,
            scrape_interval: secs(
                "scrape-interval-secs",
                self.scrape_interval_secs.or(file.scrape_interval_secs),
                d.scrape_interval,
            )?,
            scrape_timeout: match secs(
                "scrape-timeout-secs",
                self.scrape_timeout_secs.or(file.scrape_timeout_secs),
                d.scrape_timeout,
            )? {
                t if t.is_zero() => {
                    return Err(ConfigError::Value {
                        flag: "scrape-timeout-secs",
                        msg: "must be more than 0".into(),
                    })
                }
                t => t,
            },
            engine_stale: secs(
                "engine-stale-secs",
                self.engine_stale_secs.or(file.engine_stale_secs),
                d.engine_stale,
            )?,
            engine_down: secs(
                "engine-down-secs",
                self.engine_down_secs.or(file.engine_down_secs),
                d.engine_down,
            )?,
            alarm_silent: secs(
                "alarm-silent-secs",
                self.alarm_silent_secs.or(file.alarm_silent_secs),
                d.alarm_silent,
            )?,
            truth: crate::truth::TruthConfig {
                window: positive_secs(
                    "truth-window-secs",
                    self.truth_window_secs.or(file.truth_window_secs),
                    d.truth.window,
                )?,
                factor: match self.hash_mismatch_factor.or(file.hash_mismatch_factor) {
                    None => d.truth.factor,
                    Some(f) if f > 1.0 && f < 1e9 => f,
                    Some(f) => {
                        return Err(ConfigError::Value {
                            flag: "hash-mismatch-factor",
                            msg: format!("{f}: must be more than 1"),
                        })
                    }
                },
                min_tokens: self
                    .hash_mismatch_min_tokens
                    .or(file.hash_mismatch_min_tokens)
                    .unwrap_or(d.truth.min_tokens),
                hold: secs(
                    "hash-mismatch-hold-secs",
                    self.hash_mismatch_hold_secs
                        .or(file.hash_mismatch_hold_secs),
                    d.truth.hold,
                )?,
            },
            alarm_gateway_stale: positive_secs(
                "alarm-gateway-stale-secs",
                self.alarm_gateway_stale_secs
                    .or(file.alarm_gateway_stale_secs),
                d.alarm_gateway_stale,
            )?,
            max_metrics_bytes: positive(
                "max-metrics-bytes",
                self.max_metrics_bytes.or(file.max_metrics_bytes),
                d.max_metrics_bytes,
            )?,
            tokenizers,
            text_limits,
            nats: self
                .nats
                .into_config(file.nats, listen.port())
                .map_err(|e| ConfigError::Value {
                    flag: e.flag,
                    msg: e.msg,
                })?,
        };
        // An ingest process reads only its share of the engines: its feed is partial and no
        // gateway reads it (they read index replicas), so the log a gateway would need is
        // memory for nothing (~50 MB at the full default, and still filling minutes after a
        // restart).
        let ingest_only = config
            .nats
            .as_ref()
            .is_some_and(|n| n.role == crate::bus::settings::Role::Ingest);
        if ingest_only && !feed_log_given {
            config.feed_log_entries = INGEST_FEED_LOG_ENTRIES;
        }
        Ok(config)
    }
}

/// The feed log of a `--nats-role ingest` process unless set ([`Config::feed_log_entries`]).
pub const INGEST_FEED_LOG_ENTRIES: usize = 10_000;

/// Parses `--tokenizer MODEL=DIR` specs: a model at most once, at most `max` of them.
///
/// # Errors
/// A spec without `=`, an empty model or directory, a model given twice, or too many.
pub fn parse_tokenizer_specs(
    specs: &[String],
    max: usize,
) -> Result<Vec<TokenizerSpec>, ConfigError> {
    let mut out: Vec<TokenizerSpec> = Vec::with_capacity(specs.len());
    for spec in specs {
        let err = |msg: &str| ConfigError::Tokenizer {
            spec: spec.clone(),
            msg: msg.to_owned(),
        };
        // Split at the first '=': directories may hold one, served model names do not.
        let (model, dir) = spec.split_once('=').ok_or_else(|| err("want MODEL=DIR"))?;
        let (model, dir) = (model.trim(), dir.trim());
        if model.is_empty() || dir.is_empty() {
            return Err(err("want MODEL=DIR, both non-empty"));
        }
        if out.iter().any(|s| s.model == model) {
            return Err(err("model given twice"));
        }
        out.push(TokenizerSpec {
            model: model.to_owned(),
            dir: PathBuf::from(dir),
        });
    }
    if out.len() > max {
        return Err(ConfigError::Value {
            flag: "max-tokenizers",
            msg: format!("{} --tokenizer models, over the limit of {max}", out.len()),
        });
    }
    Ok(out)
}

/// Parses a `--worker` SPEC into the registration it stands for.
///
/// # Errors
/// An unknown or repeated key, a missing `instance_id`/`endpoint`/`model`/`block_size`, or a
/// number that does not parse.
pub fn parse_worker_spec(spec: &str) -> Result<RegisterRequest, ConfigError> {
    let err = |msg: String| ConfigError::Worker {
        spec: spec.to_owned(),
        msg,
    };
    let mut kv: Vec<(&str, &str)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| err(format!("{part:?} is not key=value")))?;
        if kv.iter().any(|(seen, _)| *seen == k) {
            return Err(err(format!("{k} given twice")));
        }
        kv.push((k.trim(), v.trim()));
    }
    let get = |names: &[&str]| {
        kv.iter()
            .find(|(k, _)| names.contains(k))
            .map(|(_, v)| v.to_string())
    };
    const KNOWN: &[&str] = &[
        "instance_id",
        "instance",
        "endpoint",
        "model",
        "model_name",
        "block_size",
        "address",
        "dp_rank",
        "replay",
        "replay_endpoint",
        "tenant",
        "tenant_id",
        "lora",
        "lora_name",
        "cache_salt",
        "salt",
    ];
    if let Some((k, _)) = kv.iter().find(|(k, _)| !KNOWN.contains(k)) {
        return Err(err(format!("unknown key {k:?}")));
    }
    let need = |names: &[&str]| get(names).ok_or_else(|| err(format!("{} is required", names[0])));
    let block_size = need(&["block_size"])?;
    let block_size: u32 = block_size
        .parse()
        .map_err(|_| err(format!("block_size {block_size:?} is not a number")))?;
    let dp_rank = match get(&["dp_rank"]) {
        Some(d) => Some(
            d.parse::<u32>()
                .map_err(|_| err(format!("dp_rank {d:?} is not a number")))?,
        ),
        None => None,
    };
    Ok(RegisterRequest {
        instance_id: need(&["instance_id", "instance"])?,
        endpoint: need(&["endpoint"])?,
        replay_endpoint: get(&["replay", "replay_endpoint"]),
        model_name: need(&["model", "model_name"])?,
        tenant_id: get(&["tenant", "tenant_id"]),
        block_size,
        dp_rank,
        lora_name: get(&["lora", "lora_name"]),
        cache_salt: get(&["cache_salt", "salt"]),
        address: get(&["address"]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn worker_spec_of_the_design_parses() {
        let r = parse_worker_spec(
            "instance_id=A,endpoint=tcp://10.0.0.5:5557,model=M,block_size=16,address=10.0.0.5:8000,dp_rank=1,replay=tcp://10.0.0.5:5558,tenant=T",
        )
        .unwrap();
        assert_eq!(r.instance_id, "A");
        assert_eq!(r.block_size, 16);
        assert_eq!(r.dp_rank, Some(1));
        assert_eq!(r.replay_endpoint.as_deref(), Some("tcp://10.0.0.5:5558"));
        assert_eq!(r.tenant_id.as_deref(), Some("T"));
        assert!(parse_worker_spec("instance_id=A,endpoint=tcp://x:1,model=M").is_err());
        assert!(
            parse_worker_spec("instance_id=A,endpoint=tcp://x:1,model=M,block_size=x").is_err()
        );
        assert!(parse_worker_spec(
            "instance_id=A,endpoint=tcp://x:1,model=M,block_size=1,colour=red"
        )
        .is_err());
    }

    #[test]
    fn every_flag_has_help() {
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        for arg in cmd.get_arguments() {
            assert!(arg.get_help().is_some(), "--{} has no help", arg.get_id());
        }
    }

    #[test]
    fn config_file_fills_what_flags_leave_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:7000\"\nadmin_token = \"a\"\nworker = [\"instance_id=A,endpoint=tcp://127.0.0.1:1,model=M,block_size=4\"]\n",
        )
        .unwrap();
        let cli = Cli::try_parse_from([
            "kvroute-collector",
            "--config",
            path.to_str().unwrap(),
            "--admin-token",
            "b",
        ])
        .unwrap();
        let c = cli.into_config().unwrap();
        assert_eq!(c.listen.port(), 7000);
        assert_eq!(c.admin_token.as_deref(), Some("b"));
        assert_eq!(c.workers.len(), 1);
        std::fs::write(&path, "colour = 1\n").unwrap();
        let cli =
            Cli::try_parse_from(["kvroute-collector", "--config", path.to_str().unwrap()]).unwrap();
        assert!(matches!(cli.into_config(), Err(ConfigError::File { .. })));
    }

    #[test]
    fn an_ingest_process_keeps_a_short_feed_log_unless_told() {
        let entries = |args: &[&str]| {
            let mut all = vec!["kvroute-collector"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all)
                .unwrap()
                .into_config()
                .unwrap()
                .feed_log_entries
        };
        let nats = ["--nats", "nats://127.0.0.1:4222", "--nats-role"];
        let full = Config::default().feed_log_entries;
        assert_eq!(entries(&[]), full);
        assert_eq!(entries(&[&nats[..], &["index"]].concat()), full);
        assert_eq!(entries(&[&nats[..], &["both"]].concat()), full);
        assert_eq!(
            entries(&[&nats[..], &["ingest"]].concat()),
            INGEST_FEED_LOG_ENTRIES
        );
        let told = ["--feed-log-entries", "200000"];
        assert_eq!(entries(&[&nats[..], &["ingest"], &told].concat()), 200_000);
    }

    #[test]
    fn auth_cannot_be_switched_off_by_accident() {
        let parse = |args: &[&str]| {
            let mut all = vec!["kvroute-collector"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all).unwrap().into_config()
        };
        assert!(matches!(
            parse(&["--admin-token", ""]),
            Err(ConfigError::Value {
                flag: "admin-token",
                ..
            })
        ));
        assert!(matches!(
            parse(&["--read-token", " "]),
            Err(ConfigError::Value {
                flag: "read-token",
                ..
            })
        ));
        assert!(matches!(
            parse(&["--listen", "0.0.0.0:9090"]),
            Err(ConfigError::OpenWithoutAuth { .. })
        ));
        assert!(parse(&["--listen", "0.0.0.0:9090", "--admin-token", "t"]).is_ok());
        let c = parse(&["--listen", "0.0.0.0:9090", "--insecure-no-auth"]).unwrap();
        assert!(c.insecure_no_auth && c.admin_token.is_none());
        assert!(matches!(
            parse(&["--header-read-timeout-secs", "0"]),
            Err(ConfigError::Value { .. })
        ));
    }

    #[test]
    fn tokenizer_specs_parse_and_are_bounded() {
        let parse = |args: &[&str]| {
            let mut all = vec!["kvroute-collector"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all).unwrap().into_config()
        };
        let c = parse(&["--tokenizer", "qwen=/models/q=1", "--max-text-bytes", "10"]).unwrap();
        assert_eq!(
            c.tokenizers,
            [TokenizerSpec {
                model: "qwen".into(),
                dir: "/models/q=1".into()
            }]
        );
        assert_eq!(c.text_limits.max_text_bytes, 10);
        assert!(matches!(
            parse(&["--tokenizer", "nodir"]),
            Err(ConfigError::Tokenizer { .. })
        ));
        assert!(matches!(
            parse(&["--tokenizer", "a=/x", "--tokenizer", "a=/y"]),
            Err(ConfigError::Tokenizer { .. })
        ));
        assert!(matches!(
            parse(&[
                "--tokenizer",
                "a=/x",
                "--tokenizer",
                "b=/y",
                "--max-tokenizers",
                "1"
            ]),
            Err(ConfigError::Value {
                flag: "max-tokenizers",
                ..
            })
        ));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "tokenizer = [\"m=/t\"]\nmax_messages = 3\n").unwrap();
        let c = parse(&["--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(c.tokenizers[0].model, "m");
        assert_eq!(c.text_limits.max_messages, 3);
    }

    #[test]
    fn listens_on_loopback_by_default() {
        let c = Cli::try_parse_from(["kvroute-collector"])
            .unwrap()
            .into_config()
            .unwrap();
        assert!(c.listen.ip().is_loopback());
    }
}
