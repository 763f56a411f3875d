//! The plugin configuration: the JSON of ARCHITECTURE.md ("Filter configuration"), parsed with serde
//! into raw structs that refuse unknown keys, then validated into [`Config`].
//!
//! Every key but `collector.cluster` has a default; see filter/README.md for the table.
//!
//! One concern: every key of the plugin configuration, its default and its check, in one
//! place so that the README's table and the parser can be read side by side (the `text`
//! keys are in `text_config.rs`).

use std::fmt;
use std::time::Duration;

use kvroute::intake::FieldKind;
use kvroute::mirror::Limits;
use kvroute::router::{Cold, Policy, PolicyConfig};
use kvroute::select::Weights;
use serde::Deserialize;

use crate::text_config::RawText;
pub use crate::text_config::TextConfig;

/// Where one value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A request header (lowercase name).
    Header(String),
    /// A top-level field of the JSON body.
    Body(String),
    /// A property path (Envoy metadata or filter state), read with `get_property`.
    Metadata(Vec<String>),
}

impl Source {
    pub fn is_body(&self) -> bool {
        matches!(self, Source::Body(_))
    }
}

/// Index access mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A shared-data copy of the index, synced from `/v1/feed` by one VM.
    Local,
    /// A `/query` callout per request.
    Remote,
}

/// A configuration error, naming the key.
#[derive(Debug)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() || self.path == "." {
            write!(f, "invalid kvroute configuration: {}", self.message)
        } else {
            write!(
                f,
                "invalid kvroute configuration at key `{}`: {}",
                self.path, self.message
            )
        }
    }
}

fn err(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.to_owned(),
        message: message.into(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    collector: RawCollector,
    #[serde(default)]
    index: RawIndex,
    #[serde(default = "default_token_sources")]
    tokens: RawSources,
    #[serde(default = "default_model_sources")]
    model: RawSources,
    #[serde(default = "default_tenant_sources")]
    tenant: RawSources,
    #[serde(default = "default_salt_sources")]
    cache_salt: RawSources,
    #[serde(default = "default_max_body_bytes")]
    max_body_bytes: u64,
    #[serde(default = "default_destination_header")]
    destination_header: String,
    #[serde(default = "default_dp_rank_header")]
    dp_rank_header: String,
    #[serde(default)]
    debug_header: Option<String>,
    #[serde(default)]
    load: RawLoad,
    #[serde(default)]
    route: RawRoute,
    #[serde(default)]
    weights: RawWeights,
    #[serde(default)]
    text: RawText,
    #[serde(default)]
    log_level: Option<String>,
    #[serde(default)]
    random_seed: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCollector {
    cluster: String,
    #[serde(default)]
    failover_clusters: Vec<String>,
    #[serde(default = "default_authority")]
    authority: String,
    #[serde(default = "default_query_timeout")]
    query_timeout_ms: u32,
    #[serde(default = "default_feed_timeout")]
    feed_timeout_ms: u32,
    #[serde(default)]
    read_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIndex {
    #[serde(default = "default_mode")]
    mode: Mode,
    #[serde(default = "default_sync_interval")]
    sync_interval_ms: u32,
    #[serde(default = "default_stale_after")]
    stale_after_ms: u64,
    #[serde(default)]
    reuse_ms: Option<u32>,
    #[serde(default = "default_buckets")]
    buckets: u32,
    #[serde(default = "default_max_workers")]
    max_workers: u32,
    #[serde(default = "default_max_bucket_keys")]
    max_bucket_keys: u16,
    #[serde(default = "default_max_models")]
    max_models: u16,
    #[serde(default = "default_max_blocks_per_tick")]
    max_blocks_per_tick: u64,
}

impl Default for RawIndex {
    fn default() -> Self {
        RawIndex {
            mode: default_mode(),
            sync_interval_ms: default_sync_interval(),
            stale_after_ms: default_stale_after(),
            reuse_ms: None,
            buckets: default_buckets(),
            max_workers: default_max_workers(),
            max_bucket_keys: default_max_bucket_keys(),
            max_models: default_max_models(),
            max_blocks_per_tick: default_max_blocks_per_tick(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSources {
    sources: Vec<String>,
    #[serde(default)]
    default: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoad {
    #[serde(default = "default_load_ttl")]
    ttl_ms: u64,
    #[serde(default)]
    gateway_id: Option<String>,
    #[serde(default = "default_true")]
    fleet: bool,
    #[serde(default)]
    max_waiting: Option<u32>,
    #[serde(default)]
    max_kv_usage: Option<f64>,
    #[serde(default = "default_decode_tokens")]
    default_decode_tokens: u32,
    #[serde(default)]
    prefill_tokens_per_s: Option<u32>,
}

impl Default for RawLoad {
    fn default() -> Self {
        RawLoad {
            ttl_ms: default_load_ttl(),
            gateway_id: None,
            fleet: true,
            max_waiting: None,
            max_kv_usage: None,
            default_decode_tokens: default_decode_tokens(),
            prefill_tokens_per_s: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    #[serde(default)]
    cold: Option<Cold>,
    #[serde(default = "default_speculative_ttl")]
    speculative_ttl_ms: u64,
    #[serde(default)]
    max_hit_queue_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    replica_tie_band: Option<f64>,
    /// The additive affinity this replaced: accepted so that existing configurations load,
    /// and ignored (logged) because it could outweigh a real queue.
    #[serde(default)]
    replica_spread_tokens: Option<u64>,
}

impl Default for RawRoute {
    fn default() -> Self {
        RawRoute {
            cold: None,
            speculative_ttl_ms: default_speculative_ttl(),
            max_hit_queue_tokens: None,
            temperature: None,
            replica_tie_band: None,
            replica_spread_tokens: None,
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_decode_tokens() -> u32 {
    256
}
fn default_speculative_ttl() -> u64 {
    2000
}

/// The cost weights; absent ones keep [`Weights::default`]'s.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawWeights {
    #[serde(default)]
    gpu: Option<f64>,
    #[serde(default)]
    cpu: Option<f64>,
    #[serde(default)]
    disk: Option<f64>,
    #[serde(default)]
    overlap: Option<f64>,
    #[serde(default)]
    request: Option<f64>,
}
fn default_token_sources() -> RawSources {
    RawSources {
        sources: [
            "header:x-token-ids",
            "body:prompt",
            "body:prompt_token_ids",
            "body:input_ids",
        ]
        .map(str::to_owned)
        .to_vec(),
        default: None,
    }
}
fn default_model_sources() -> RawSources {
    RawSources {
        sources: vec!["body:model".into(), "header:x-model".into()],
        default: None,
    }
}
fn default_tenant_sources() -> RawSources {
    RawSources {
        sources: vec!["header:x-tenant-id".into()],
        default: Some("default".into()),
    }
}
fn default_salt_sources() -> RawSources {
    RawSources {
        sources: vec!["body:cache_salt".into()],
        default: None,
    }
}
fn default_max_body_bytes() -> u64 {
    1_000_000
}
fn default_destination_header() -> String {
    "x-gateway-destination-endpoint".into()
}
fn default_dp_rank_header() -> String {
    "x-data-parallel-rank".into()
}
fn default_authority() -> String {
    "kvroute-collector".into()
}
fn default_query_timeout() -> u32 {
    20
}
fn default_feed_timeout() -> u32 {
    1000
}
fn default_mode() -> Mode {
    Mode::Local
}
fn default_sync_interval() -> u32 {
    // Two gateways see each other's bookings a report and a pull later: at 100 ms, 16 engines
    // behind two gateways queued cold prompts behind each other's long ones (bench scale
    // scenario, TTFT p50 0.25 s against 0.15 s at 25 ms).
    25
}
fn default_stale_after() -> u64 {
    5000
}
fn default_reuse() -> u32 {
    // A worker reads the sync state and the fleet totals at most every 2 ms instead of for
    // every request (two shared-data reads, ~3 µs in Envoy's V8); the pages they follow
    // come every 25 ms, so a page is seen at most 2 ms later. Too long when `sync_interval_ms`
    // is near it (README, "Defaults, and the scenario that breaks each").
    2
}
fn default_buckets() -> u32 {
    16384
}
fn default_max_workers() -> u32 {
    256
}
fn default_max_bucket_keys() -> u16 {
    4096
}
fn default_max_models() -> u16 {
    1024
}
fn default_max_blocks_per_tick() -> u64 {
    262_144
}
fn default_load_ttl() -> u64 {
    120_000
}

/// One value's sources, in order, and its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sources {
    pub sources: Vec<Source>,
    pub default: Option<String>,
}

impl Sources {
    pub fn needs_body(&self) -> bool {
        self.sources.iter().any(Source::is_body)
    }
}

/// Whole milliseconds of `d`, saturating: the unit of the host clock and of the core's
/// shared-data timestamps.
// Its callers are the wasm-only contexts; native builds see it only in tests.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Most clusters in `collector.failover_clusters`.
pub const MAX_FAILOVER_CLUSTERS: usize = 8;

/// Body fields giving a request's decode budget, first present wins.
pub const DECODE_FIELDS: [&str; 2] = ["max_completion_tokens", "max_tokens"];

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Collector cluster name (Envoy cluster the callouts go to). Required.
    pub cluster: String,
    /// The feed's clusters in failover order: `cluster`, then `collector.failover_clusters`.
    /// Feed pulls and load reports stay on one until it fails twice in a
    /// row, then move to the next (the feed's cursor belongs to one collector).
    pub feed_clusters: Vec<String>,
    /// `:authority` of callouts. Default `kvroute-collector`.
    pub authority: String,
    /// `/query` callout timeout (JSON `query_timeout_ms`). Default 20 ms.
    pub query_timeout: Duration,
    /// `/v1/feed` callout timeout (JSON `feed_timeout_ms`). Default 1 s.
    pub feed_timeout: Duration,
    /// Bearer token for the collector's read endpoints. Default none.
    pub read_token: Option<String>,
    /// `local` (default) or `remote`.
    pub mode: Mode,
    /// Feed pull period (JSON `sync_interval_ms`). Default 25 ms.
    pub sync_interval: Duration,
    /// Older index → fail open (JSON `stale_after_ms`). Default 5 s.
    pub stale_after: Duration,
    /// How long a worker reuses the sync state and fleet totals it read (JSON `reuse_ms`;
    /// 0: read for every request; less than `sync_interval`). Default 2 ms, or
    /// `sync_interval_ms - 1` if that is less.
    pub reuse: Duration,
    /// Shared-data layout sizes (buckets default 16384, max_workers 256,
    /// max_bucket_keys 4096, max_models 1024).
    pub limits: Limits,
    /// Block holds the lease holder applies per tick before waiting for the next. Default 262144.
    pub max_blocks_per_tick: u64,
    pub tokens: Sources,
    pub model: Sources,
    pub tenant: Sources,
    pub cache_salt: Sources,
    /// Bodies larger than this are not buffered: continue unrouted (`too_large`). Default 1000000.
    pub max_body_bytes: u64,
    /// Route header. Default `x-gateway-destination-endpoint`.
    pub destination_header: String,
    /// dp-rank header. Default `x-data-parallel-rank`.
    pub dp_rank_header: String,
    /// Optional response header with the decision. Default none.
    pub debug_header: Option<String>,
    /// Time-to-live of in-flight load counts (JSON `load.ttl_ms`). Default 120 s.
    pub load_ttl: Duration,
    /// This Envoy's name in `/v1/load` reports (JSON `load.gateway_id`). Default: a random id
    /// made once per Envoy and kept in shared data.
    pub gateway_id: Option<String>,
    /// Report this Envoy's load and decide on the fleet's (JSON `load.fleet`). Default true.
    pub fleet: bool,
    /// Decode tokens booked for a request without `max_tokens` / `max_completion_tokens`
    /// (JSON `load.default_decode_tokens`). Default 256.
    pub default_decode_tokens: u32,
    /// Each engine's prefill rate, tokens per second, at which the booked prefill drains
    /// (JSON `load.prefill_tokens_per_s`; 0 = no drain). Default: learned per engine from
    /// requests that found it idle.
    pub prefill_rate: Option<u32>,
    /// How long a routed request's blocks count as held by its engine before its KV events
    /// arrive (JSON `route.speculative_ttl_ms`; 0 = off). Default 2 s.
    pub speculative_ttl: Duration,
    /// The decision's rules: cold requests, saturation, hot-spot guard, and the weights.
    pub policy: Policy,
    pub weights: Weights,
    /// Text requests: exact through the collector, approximate in the filter.
    pub text: TextConfig,
    /// `trace|debug|info|warn|error|critical`. Default `warn`.
    pub log_level: log::LevelFilter,
    /// Fixed seed of the tie-break randomness (tests). Default: from the VM id and clock.
    pub random_seed: Option<u64>,
    /// The JSON body fields to extract, in one list for the scanner.
    pub body_fields: Vec<(String, FieldKind)>,
}

impl Config {
    /// Whether any source of any value is the body.
    pub fn needs_body(&self) -> bool {
        self.tokens.needs_body()
            || self.text.enabled()
            || self.model.needs_body()
            || self.tenant.needs_body()
            || self.cache_salt.needs_body()
    }

    /// Index of a body field in [`Config::body_fields`].
    pub fn body_field(&self, name: &str) -> Option<usize> {
        self.body_fields.iter().position(|(n, _)| n == name)
    }
}

/// Parses and validates one configuration document (no Higress wrapper).
///
/// # Errors
/// [`ConfigError`] naming the key.
pub fn parse(json: &[u8]) -> Result<Config, ConfigError> {
    let de = &mut serde_json::Deserializer::from_slice(json);
    let raw: RawConfig = serde_path_to_error::deserialize(de)
        .map_err(|e| err(&e.path().to_string(), e.inner().to_string()))?;
    validate(raw)
}

/// Parses a configuration given as a JSON value.
///
/// # Errors
/// [`ConfigError`] naming the key.
pub fn from_value(v: serde_json::Value) -> Result<Config, ConfigError> {
    let raw: RawConfig = serde_path_to_error::deserialize(v)
        .map_err(|e| err(&e.path().to_string(), e.inner().to_string()))?;
    validate(raw)
}

fn sources(path: &str, raw: RawSources, tokens: bool) -> Result<Sources, ConfigError> {
    let mut out = Vec::new();
    for (i, s) in raw.sources.iter().enumerate() {
        let p = format!("{path}.sources[{i}]");
        let (kind, rest) = s.split_once(':').ok_or_else(|| {
            err(
                &p,
                format!("`{s}`: expected header:NAME, body:FIELD or metadata:PATH"),
            )
        })?;
        if rest.is_empty() {
            return Err(err(&p, format!("`{s}`: empty name")));
        }
        out.push(match kind {
            "header" => Source::Header(rest.to_ascii_lowercase()),
            "body" => Source::Body(rest.to_owned()),
            "metadata" => {
                let sep = if rest.contains('/') { '/' } else { '.' };
                let parts: Vec<String> = rest.split(sep).map(str::to_owned).collect();
                if parts.iter().any(String::is_empty) {
                    return Err(err(&p, format!("`{s}`: empty path segment")));
                }
                Source::Metadata(parts)
            }
            other => {
                return Err(err(
                    &p,
                    format!("unknown source kind `{other}` (header, body, metadata)"),
                ))
            }
        });
    }
    if tokens && out.is_empty() {
        return Err(err(
            &format!("{path}.sources"),
            "at least one token source is needed",
        ));
    }
    Ok(Sources {
        sources: out,
        default: raw.default.filter(|d| !d.is_empty()),
    })
}

/// The decision's knobs, spread over three sections of the filter's configuration, checked by
/// the one [`PolicyConfig::validate`]; an error names the knob's path in this configuration.
fn policy(raw: &RawConfig) -> Result<Policy, ConfigError> {
    let (w, load, route) = (&raw.weights, &raw.load, &raw.route);
    PolicyConfig {
        gpu: w.gpu,
        cpu: w.cpu,
        disk: w.disk,
        overlap: w.overlap,
        request: w.request,
        cold: route.cold,
        max_waiting: load.max_waiting,
        max_kv_usage: load.max_kv_usage,
        max_hit_queue_tokens: route.max_hit_queue_tokens,
        temperature: route.temperature,
        replica_tie_band: route.replica_tie_band,
    }
    .validate()
    .map_err(|e| {
        let section = match e.knob {
            "gpu" | "cpu" | "disk" | "overlap" | "request" => "weights",
            "max_waiting" | "max_kv_usage" => "load",
            _ => "route",
        };
        err(&format!("{section}.{}", e.knob), e.reason)
    })
}

fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    if raw.collector.cluster.is_empty() {
        return Err(err("collector.cluster", "must not be empty"));
    }
    let failover = &raw.collector.failover_clusters;
    if failover.len() > MAX_FAILOVER_CLUSTERS {
        return Err(err(
            "collector.failover_clusters",
            format!("at most {MAX_FAILOVER_CLUSTERS} clusters"),
        ));
    }
    if failover
        .iter()
        .any(|c| c.is_empty() || *c == raw.collector.cluster)
    {
        return Err(err(
            "collector.failover_clusters",
            "each must be a non-empty cluster other than collector.cluster",
        ));
    }
    let b = raw.index.buckets;
    if !b.is_power_of_two() || b > 1 << 20 {
        return Err(err(
            "index.buckets",
            format!("{b}: must be a power of two up to 1048576"),
        ));
    }
    if raw.index.max_workers == 0 || raw.index.max_workers > 65_535 {
        return Err(err("index.max_workers", "must be 1..=65535"));
    }
    if raw.index.max_bucket_keys == 0 {
        return Err(err("index.max_bucket_keys", "must be at least 1"));
    }
    if raw.index.sync_interval_ms == 0 {
        return Err(err("index.sync_interval_ms", "must be at least 1"));
    }
    let reuse_ms = match raw.index.reuse_ms {
        Some(r) if r >= raw.index.sync_interval_ms => {
            return Err(err(
                "index.reuse_ms",
                "must be less than index.sync_interval_ms (a worker would miss whole pages)",
            ));
        }
        Some(r) => r,
        None => default_reuse().min(raw.index.sync_interval_ms - 1),
    };
    if raw.index.max_blocks_per_tick == 0 {
        return Err(err("index.max_blocks_per_tick", "must be at least 1"));
    }
    if raw.max_body_bytes > u32::MAX as u64 {
        return Err(err("max_body_bytes", "must fit in 32 bits"));
    }
    for (k, v) in [
        ("destination_header", &raw.destination_header),
        ("dp_rank_header", &raw.dp_rank_header),
    ] {
        if v.is_empty() || !v.bytes().all(|c| c.is_ascii_graphic() && c != b':') {
            return Err(err(k, format!("`{v}` is not a header name")));
        }
    }
    let policy = policy(&raw)?;
    if raw.route.replica_spread_tokens.is_some() {
        log::warn!(
            "route.replica_spread_tokens is ignored: replica affinity is now a tie-break, route.replica_tie_band"
        );
    }
    if raw
        .load
        .gateway_id
        .as_ref()
        .is_some_and(|g| g.is_empty() || g.len() > 128)
    {
        return Err(err("load.gateway_id", "must be 1 to 128 bytes"));
    }
    let log_level = match raw.log_level.as_deref().unwrap_or("warn") {
        "trace" => log::LevelFilter::Trace,
        "debug" => log::LevelFilter::Debug,
        "info" => log::LevelFilter::Info,
        "warn" => log::LevelFilter::Warn,
        "error" => log::LevelFilter::Error,
        "critical" | "off" => log::LevelFilter::Off,
        other => {
            return Err(err(
                "log_level",
                format!("`{other}`: expected trace, debug, info, warn, error or critical"),
            ))
        }
    };
    let tokens = sources("tokens", raw.tokens, true)?;
    let model = sources("model", raw.model, false)?;
    let tenant = sources("tenant", raw.tenant, false)?;
    let cache_salt = sources("cache_salt", raw.cache_salt, false)?;
    let mut body_fields: Vec<(String, FieldKind)> = Vec::new();
    for (path, s, kind) in [
        ("tokens", &tokens, FieldKind::Tokens),
        ("model", &model, FieldKind::Str),
        ("tenant", &tenant, FieldKind::Str),
        ("cache_salt", &cache_salt, FieldKind::Str),
    ] {
        for src in &s.sources {
            if let Source::Body(name) = src {
                match body_fields.iter().find(|(n, _)| n == name) {
                    Some((_, k)) if *k != kind => {
                        return Err(err(
                            &format!("{path}.sources"),
                            format!("body field `{name}` is used both as tokens and as a string"),
                        ));
                    }
                    Some(_) => {}
                    None => body_fields.push((name.clone(), kind)),
                }
            }
        }
    }
    let text = raw
        .text
        .validate(&mut body_fields)
        .map_err(|(k, m)| err(k, m))?;
    // Decode work to book, read whenever the body is scanned anyway.
    for name in DECODE_FIELDS {
        if !body_fields.iter().any(|(n, _)| n == name) {
            body_fields.push((name.to_owned(), FieldKind::Uint));
        }
    }
    let feed_clusters = std::iter::once(raw.collector.cluster.clone())
        .chain(raw.collector.failover_clusters)
        .collect();
    Ok(Config {
        cluster: raw.collector.cluster,
        feed_clusters,
        authority: raw.collector.authority,
        query_timeout: Duration::from_millis(raw.collector.query_timeout_ms.into()),
        feed_timeout: Duration::from_millis(raw.collector.feed_timeout_ms.into()),
        read_token: raw.collector.read_token.filter(|t| !t.is_empty()),
        mode: raw.index.mode,
        sync_interval: Duration::from_millis(raw.index.sync_interval_ms.into()),
        stale_after: Duration::from_millis(raw.index.stale_after_ms),
        reuse: Duration::from_millis(reuse_ms.into()),
        limits: Limits {
            buckets_log2: b.trailing_zeros() as u8,
            max_workers: raw.index.max_workers,
            max_bucket_keys: raw.index.max_bucket_keys,
            max_models: raw.index.max_models,
        },
        max_blocks_per_tick: raw.index.max_blocks_per_tick,
        tokens,
        model,
        tenant,
        cache_salt,
        max_body_bytes: raw.max_body_bytes,
        destination_header: raw.destination_header.to_ascii_lowercase(),
        dp_rank_header: raw.dp_rank_header.to_ascii_lowercase(),
        debug_header: raw
            .debug_header
            .filter(|h| !h.is_empty())
            .map(|h| h.to_ascii_lowercase()),
        load_ttl: Duration::from_millis(raw.load.ttl_ms),
        gateway_id: raw.load.gateway_id,
        fleet: raw.load.fleet,
        default_decode_tokens: raw.load.default_decode_tokens,
        prefill_rate: raw.load.prefill_tokens_per_s,
        speculative_ttl: Duration::from_millis(raw.route.speculative_ttl_ms),
        weights: policy.weights,
        policy,
        text,
        log_level,
        random_seed: raw.random_seed,
        body_fields,
    })
}

/// How a Higress rule matches a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Matcher {
    /// `_match_route_`: the `route_name` property is one of these.
    Route(Vec<String>),
    /// `_match_domain_`: the `:authority` (port stripped) matches one of these
    /// (`*.example.com` suffix, `api*` prefix, or exact).
    Domain(Vec<String>),
    /// `_match_service_`: the `cluster_name` property is or ends with one of these
    /// (Higress cluster names look like `outbound|80||svc.ns.svc.cluster.local`).
    Service(Vec<String>),
    /// `_match_route_prefix_`: the `route_name` starts with one of these.
    RoutePrefix(Vec<String>),
}

/// The whole plugin configuration: the global one and, in the Higress build, per-rule ones.
#[derive(Clone, Debug)]
pub struct Plugin {
    pub global: std::rc::Rc<Config>,
    pub rules: Vec<(Matcher, std::rc::Rc<Config>)>,
}

/// Parses the plugin configuration. In the Higress build a top-level `_rules_` array is
/// Higress's wrapper: each rule names one matcher and its config keys, laid over the global
/// keys (a rule repeats only what differs). Elsewhere `_rules_` is an unknown key.
///
/// # Errors
/// [`ConfigError`] naming the key.
pub fn parse_plugin(json: &[u8]) -> Result<Plugin, ConfigError> {
    let json = if json.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        json
    };
    if !cfg!(feature = "higress") {
        return Ok(Plugin {
            global: std::rc::Rc::new(parse(json)?),
            rules: Vec::new(),
        });
    }
    let mut value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| err("", e.to_string()))?;
    let Some(obj) = value.as_object_mut() else {
        return Err(err("", "expected a JSON object"));
    };
    let rules = obj.remove("_rules_");
    // Other `_..._` keys belong to Higress's wrapper, not to this plugin.
    obj.retain(|k, _| !is_wrapper_key(k));
    let global_obj = obj.clone();
    let global = std::rc::Rc::new(from_value(value)?);
    let mut out = Vec::new();
    if let Some(rules) = rules {
        let Some(rules) = rules.as_array() else {
            return Err(err("_rules_", "expected an array"));
        };
        for (i, rule) in rules.iter().enumerate() {
            let path = format!("_rules_[{i}]");
            let Some(rule) = rule.as_object() else {
                return Err(err(&path, "expected an object"));
            };
            let mut merged = global_obj.clone();
            let mut matcher = None;
            for (k, v) in rule {
                let list = || -> Result<Vec<String>, ConfigError> {
                    serde_json::from_value::<Vec<String>>(v.clone())
                        .map_err(|e| err(&format!("{path}.{k}"), e.to_string()))
                };
                let m = match k.as_str() {
                    "_match_route_" => Some(Matcher::Route(list()?)),
                    "_match_domain_" => Some(Matcher::Domain(list()?)),
                    "_match_service_" => Some(Matcher::Service(list()?)),
                    "_match_route_prefix_" => Some(Matcher::RoutePrefix(list()?)),
                    other if is_wrapper_key(other) => None,
                    _ => {
                        merged.insert(k.clone(), v.clone());
                        None
                    }
                };
                if let Some(m) = m {
                    if matcher.is_some() {
                        return Err(err(
                            &format!("{path}.{k}"),
                            "a rule takes exactly one _match_*_ key",
                        ));
                    }
                    matcher = Some(m);
                }
            }
            let Some(matcher) = matcher else {
                return Err(err(&path, "a rule needs one _match_*_ key"));
            };
            let cfg = from_value(serde_json::Value::Object(merged)).map_err(|e| ConfigError {
                path: format!("{path}.{}", e.path),
                message: e.message,
            })?;
            out.push((matcher, std::rc::Rc::new(cfg)));
        }
    }
    Ok(Plugin { global, rules: out })
}

/// A key of Higress's wrapper (`_rules_`, `_match_*_`, and any other `_name_`).
fn is_wrapper_key(k: &str) -> bool {
    k.len() > 2 && k.starts_with('_') && k.ends_with('_')
}

/// Whether a `_match_domain_` pattern matches a host (port already stripped).
pub fn domain_matches(pattern: &str, host: &str) -> bool {
    if let Some(suffix) = pattern.strip_prefix('*') {
        host.ends_with(suffix)
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        host.starts_with(prefix)
    } else {
        pattern.eq_ignore_ascii_case(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text_config::{MESSAGES_FIELD, PROMPT_FIELD};

    #[test]
    fn millisecond_keys_become_durations() {
        let p = parse_plugin(
            br#"{"collector": {"cluster": "c", "query_timeout_ms": 25},
                 "index": {"sync_interval_ms": 50}, "load": {"ttl_ms": 1500}}"#,
        )
        .unwrap();
        let c = &p.global;
        assert_eq!(c.query_timeout, Duration::from_millis(25));
        assert_eq!(c.feed_timeout, Duration::from_secs(1), "the default");
        assert_eq!(c.sync_interval, Duration::from_millis(50));
        assert_eq!(c.stale_after, Duration::from_secs(5), "the default");
        assert_eq!(millis(c.load_ttl), 1500);
        assert_eq!(millis(Duration::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn failover_clusters_follow_the_primary_and_are_checked() {
        let c =
            parse(br#"{"collector": {"cluster": "a", "failover_clusters": ["b", "c"]}}"#).unwrap();
        assert_eq!(c.feed_clusters, ["a", "b", "c"]);
        let c = parse(br#"{"collector": {"cluster": "a"}}"#).unwrap();
        assert_eq!(c.feed_clusters, ["a"]);
        for bad in [
            r#"["a"]"#,
            r#"[""]"#,
            r#"["1","2","3","4","5","6","7","8","9"]"#,
        ] {
            let json =
                format!(r#"{{"collector": {{"cluster": "a", "failover_clusters": {bad}}}}}"#);
            let e = parse(json.as_bytes()).unwrap_err().to_string();
            assert!(e.contains("collector.failover_clusters"), "{bad}: {e}");
        }
    }

    #[test]
    fn gateways_sync_every_25_ms_by_default() {
        let c = parse(br#"{"collector": {"cluster": "c"}}"#).unwrap();
        assert_eq!(c.sync_interval, Duration::from_millis(25));
    }

    #[test]
    fn reuse_stays_below_the_sync_interval() {
        let reuse = |json: &str| parse(json.as_bytes()).map(|c| millis(c.reuse));
        assert_eq!(reuse(r#"{"collector": {"cluster": "c"}}"#).unwrap(), 2);
        let at = |ms: u32| {
            reuse(&format!(
                r#"{{"collector": {{"cluster": "c"}}, "index": {{"sync_interval_ms": {ms}}}}}"#
            ))
        };
        // Left to its default, it shrinks with a short interval.
        assert_eq!(at(2).unwrap(), 1);
        assert_eq!(at(1).unwrap(), 0);
        let set = |r: u32, ms: u32| {
            reuse(&format!(
                r#"{{"collector": {{"cluster": "c"}}, "index": {{"reuse_ms": {r}, "sync_interval_ms": {ms}}}}}"#
            ))
        };
        assert_eq!(set(0, 25).unwrap(), 0);
        assert_eq!(set(24, 25).unwrap(), 24);
        let e = set(25, 25).unwrap_err().to_string();
        assert!(e.contains("index.reuse_ms"), "{e}");
    }

    #[test]
    fn text_keys_have_defaults_and_are_checked() {
        let c = parse(br#"{"collector": {"cluster": "c"}}"#).unwrap();
        assert!(c.text.exact && c.text.approx);
        assert_eq!(c.text.block_chars, 128);
        assert_eq!(millis(c.text.ttl), 600_000);
        let kinds = |c: &Config| {
            [PROMPT_FIELD, MESSAGES_FIELD].map(|n| c.body_field(n).map(|i| c.body_fields[i].1))
        };
        assert_eq!(
            kinds(&c),
            [Some(FieldKind::TokensOrText), Some(FieldKind::Raw)]
        );
        let c = parse(
            br#"{"collector": {"cluster": "c"}, "tokens": {"sources": ["header:x-t"]},
                 "model": {"sources": ["header:x-model"]}, "cache_salt": {"sources": []},
                 "text": {"exact": false, "approx": false}}"#,
        )
        .unwrap();
        assert!(
            !c.needs_body(),
            "text off: header intake never waits for a body"
        );
        assert_eq!(kinds(&c), [None, None]);
        let c = parse(
            br#"{"collector": {"cluster": "c"}, "tokens": {"sources": ["header:x-t"]},
                 "model": {"sources": ["header:x-model"]}, "cache_salt": {"sources": []},
                 "text": {"exact": false, "block_chars": 64, "max_entries": 1024}}"#,
        )
        .unwrap();
        assert!(c.needs_body());
        assert_eq!((c.text.block_chars, c.text.max_entries), (64, 1024));
        for (bad, key) in [
            (r#""text": {"block_chars": 0}"#, "text.block_chars"),
            (r#""text": {"max_entries": 0}"#, "text.max_entries"),
            (r#""text": {"colour": 1}"#, "text.colour"),
            (r#""model": {"sources": ["body:messages"]}"#, "text"),
        ] {
            let json = format!(r#"{{"collector": {{"cluster": "c"}}, {bad}}}"#);
            let e = parse(json.as_bytes()).unwrap_err();
            assert_eq!(e.path, key, "{e}");
        }
    }

    #[test]
    fn load_and_route_keys_have_defaults_and_are_checked() {
        let c = parse(br#"{"collector": {"cluster": "c"}}"#).unwrap();
        assert_eq!(c.policy, Policy::default());
        assert_eq!(c.policy.cold, Cold::Decide);
        assert!(c.fleet);
        assert_eq!(c.gateway_id, None);
        assert_eq!(c.default_decode_tokens, 256);
        assert_eq!(c.prefill_rate, None, "learned");
        assert_eq!(millis(c.speculative_ttl), 2000);
        assert!(c.body_field("max_tokens").is_some());
        let c = parse(
            br#"{"collector": {"cluster": "c"},
                 "load": {"gateway_id": "gw-1", "fleet": false, "max_waiting": 3,
                          "max_kv_usage": 0.5, "default_decode_tokens": 64,
                          "prefill_tokens_per_s": 9000},
                 "route": {"cold": "defer", "speculative_ttl_ms": 0,
                           "max_hit_queue_tokens": null, "temperature": 0.2,
                           "replica_tie_band": 0, "replica_spread_tokens": 2048}}"#,
        )
        .unwrap();
        assert_eq!(c.gateway_id.as_deref(), Some("gw-1"));
        assert!(!c.fleet);
        assert_eq!((c.policy.max_waiting, c.policy.max_kv_permille), (3, 500));
        assert_eq!(c.policy.cold, Cold::Defer);
        assert_eq!(c.policy.max_hit_queue_tokens, None);
        assert_eq!(c.policy.temperature, 0.2);
        assert_eq!(c.policy.replica_tie_band, 0.0, "the old spread is ignored");
        assert_eq!(c.prefill_rate, Some(9000));
        assert_eq!(c.default_decode_tokens, 64);
        for (bad, key) in [
            (r#""load": {"max_kv_usage": 1.5}"#, "load.max_kv_usage"),
            (r#""load": {"gateway_id": ""}"#, "load.gateway_id"),
            (r#""route": {"cold": "maybe"}"#, "route.cold"),
            (r#""route": {"temperature": -1}"#, "route.temperature"),
            (r#""route": {"temperature": 11}"#, "route.temperature"),
            (
                r#""route": {"replica_tie_band": 65}"#,
                "route.replica_tie_band",
            ),
            (
                r#""route": {"replica_tie_band": -0.5}"#,
                "route.replica_tie_band",
            ),
            (
                r#""load": {"prefill_tokens_per_s": -1}"#,
                "load.prefill_tokens_per_s",
            ),
        ] {
            let json = format!(r#"{{"collector": {{"cluster": "c"}}, {bad}}}"#);
            let e = parse(json.as_bytes()).unwrap_err();
            assert_eq!(e.path, key, "{e}");
        }
    }
}
