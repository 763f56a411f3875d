//! Engine truth: scrapes each registered engine's Prometheus `/metrics` for its queue and KV
//! cache figures, into [`Fleet`](crate::fleet::Fleet).
//!
//! One scrape per serving address, however many dp ranks (workers) share it. vLLM labels its
//! series with `engine="<index>"` (the dp rank of each engine core behind one API server) and
//! SGLang with `dp_rank`; each rank's figures go to the worker of that rank. A series without
//! either label belongs to rank 0; several series of one rank (e.g. per model) are summed, and
//! the KV usage is their maximum. A rank the page does not name gets no sample.
//!
//! The scraper is its own task: a slow or dead engine costs it time, never the event path or
//! queries (it takes the hub's lock only to list the targets and the fleet's only to store a
//! sample). Every scrape is bounded in time (`--scrape-timeout-secs`), in bytes
//! (`--max-metrics-bytes`: reading stops there) and in concurrency; a failing engine is backed
//! off exponentially. The prefix-cache figures (vLLM's `vllm:prefix_cache_{hits,queries}_total`
//! and `vllm:cache_config_info`, SGLang's `sglang:cache_hit_rate`) go to the truth check
//! ([`crate::truth`]). The text format is parsed here rather than with a crate: only a dozen
//! names matter, other lines are skipped after comparing their name, and the crates that parse
//! the full format pull in a regex engine and a date library for nothing we need.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use kvroute::event::WorkerId;
use tokio::time::MissedTickBehavior;

use crate::fleet::EngineSample;
use crate::metrics::ReasonLabels;
use crate::shared::AppState;
use crate::truth::EngineReuse;
use kvroute::router::EngineLoad;

/// Scrapes in flight at once.
pub const CONCURRENCY: usize = 32;
/// Longest pause of a failing engine's scrapes.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Highest dp rank label accepted (worker ids index a 4096-slot table).
const MAX_RANK: u32 = 4096;
/// Larger queue figures are not a queue but garbage.
const MAX_COUNT: f64 = 1e9;

/// Why a scrape gave nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrapeError {
    #[error("request failed: {0}")]
    Http(String),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("no complete answer within the scrape timeout")]
    Timeout,
    #[error("page larger than {0} bytes; cut off")]
    TooLarge(usize),
    #[error("malformed metrics page: {0}")]
    Malformed(String),
    #[error("no queue metrics (vllm:num_requests_* or sglang:num_*_reqs) on the page")]
    NoMetrics,
}

impl ScrapeError {
    /// The `reason` label of the failure counter.
    pub fn reason(&self) -> &'static str {
        match self {
            ScrapeError::Http(_) => "http",
            ScrapeError::Status(_) => "status",
            ScrapeError::Timeout => "timeout",
            ScrapeError::TooLarge(_) => "too_large",
            ScrapeError::Malformed(_) => "malformed",
            ScrapeError::NoMetrics => "no_metrics",
        }
    }
}

/// One rank's figures from one page, in the unit every part uses from here to the decision.
pub type RankFigures = EngineLoad;

#[derive(Clone, Copy)]
enum Field {
    Waiting,
    Running,
    KvUsage,
    /// vLLM's deprecated name; used only when the new one is absent.
    KvUsageOld,
    /// vLLM's prefix-cache counters, tokens (the truth check, `crate::truth`).
    CacheHits,
    CacheQueries,
    /// SGLang's only reuse figure, a 0..=1 gauge.
    CacheHitRate,
    /// vLLM's cache config, an info gauge whose labels matter (`block_size`,
    /// `enable_prefix_caching`, `num_gpu_blocks`).
    CacheConfig,
}

fn field_of(name: &str) -> Option<Field> {
    Some(match name {
        "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => Field::Waiting,
        "vllm:num_requests_running" | "sglang:num_running_reqs" => Field::Running,
        "vllm:kv_cache_usage_perc" | "sglang:token_usage" => Field::KvUsage,
        "vllm:gpu_cache_usage_perc" => Field::KvUsageOld,
        // Counters carry `_total` in the text format; the bare name is accepted too.
        "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => Field::CacheHits,
        "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => Field::CacheQueries,
        "sglang:cache_hit_rate" => Field::CacheHitRate,
        "vllm:cache_config_info" => Field::CacheConfig,
        _ => return None,
    })
}

/// Larger token counters are garbage (2^53: beyond it an f64 no longer counts by one).
const MAX_TOKENS_COUNTER: f64 = 9.0e15;

#[derive(Default)]
struct Acc {
    waiting: Option<f64>,
    running: Option<f64>,
    kv: Option<f64>,
    kv_old: Option<f64>,
    reuse: EngineReuse,
}

/// One page: the load figures per dp rank, and each rank's prefix-cache figures (empty for
/// an engine that exports none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Page {
    pub load: BTreeMap<u32, RankFigures>,
    pub reuse: BTreeMap<u32, EngineReuse>,
}

/// Parses a Prometheus text page into figures per dp rank.
///
/// # Errors
/// [`ScrapeError::Malformed`] when a line of a metric we read does not parse (or holds a
/// negative, non-finite or absurd value), [`ScrapeError::NoMetrics`] when no rank has both
/// queue figures.
pub fn parse(text: &str) -> Result<BTreeMap<u32, RankFigures>, ScrapeError> {
    parse_page(text).map(|p| p.load)
}

/// [`parse`], with the prefix-cache figures of each rank as well.
///
/// # Errors
/// As [`parse`].
pub fn parse_page(text: &str) -> Result<Page, ScrapeError> {
    let mut ranks: BTreeMap<u32, Acc> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let Some(field) = field_of(&line[..name_end]) else {
            continue;
        };
        let bad = |what: &str| ScrapeError::Malformed(format!("line {}: {what}", n + 1));
        let mut rest = &line[name_end..];
        let mut rank = 0;
        let (mut block_size, mut prefix_caching, mut cache_blocks) = (None, None, None);
        if rest.starts_with('{') {
            let (labels, after) = split_labels(rest).ok_or_else(|| bad("unterminated labels"))?;
            rest = after;
            for (k, v) in labels {
                match k {
                    "engine" | "dp_rank" => {
                        rank = v
                            .parse::<u32>()
                            .ok()
                            .filter(|r| *r < MAX_RANK)
                            .ok_or_else(|| bad("rank label is not a small number"))?;
                    }
                    // Only the info gauge's labels; a bad one is no figure, not a bad page.
                    "block_size" => block_size = v.parse::<u32>().ok().filter(|b| *b > 0),
                    // "None" before vLLM has profiled its memory.
                    "num_gpu_blocks" => cache_blocks = v.parse::<u64>().ok().filter(|b| *b > 0),
                    "enable_prefix_caching" => {
                        prefix_caching = match v {
                            "True" | "true" | "1" => Some(true),
                            "False" | "false" | "0" => Some(false),
                            _ => None,
                        }
                    }
                    _ => {}
                }
            }
        }
        let value = rest
            .split_ascii_whitespace()
            .next()
            .ok_or_else(|| bad("no value"))?;
        let value: f64 = value.parse().map_err(|_| bad("value is not a number"))?;
        let max = match field {
            Field::CacheHits | Field::CacheQueries => MAX_TOKENS_COUNTER,
            _ => MAX_COUNT,
        };
        if !(0.0..=max).contains(&value) {
            return Err(bad("value out of range"));
        }
        let acc = ranks.entry(rank).or_default();
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        let max = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0).max(value));
        match field {
            Field::Waiting => add(&mut acc.waiting),
            Field::Running => add(&mut acc.running),
            Field::KvUsage => max(&mut acc.kv),
            Field::KvUsageOld => max(&mut acc.kv_old),
            Field::CacheHits => add(&mut acc.reuse.hits_tokens),
            Field::CacheQueries => add(&mut acc.reuse.queries_tokens),
            Field::CacheHitRate => {
                if value > 1.0 {
                    return Err(bad("hit rate above 1"));
                }
                max(&mut acc.reuse.hit_rate)
            }
            Field::CacheConfig => {
                acc.reuse.block_size = block_size.or(acc.reuse.block_size);
                acc.reuse.prefix_caching = prefix_caching.or(acc.reuse.prefix_caching);
                acc.reuse.cache_blocks = cache_blocks.or(acc.reuse.cache_blocks);
            }
        }
    }
    let mut page = Page::default();
    for (rank, a) in ranks {
        if !a.reuse.is_empty() {
            page.reuse.insert(rank, a.reuse);
        }
        if let (Some(waiting), Some(running)) = (a.waiting, a.running) {
            // KV usage is a fraction by both engines' definitions; a page without it reads
            // as an empty cache rather than no sample, since the queue is what matters most.
            let kv = a.kv.or(a.kv_old).unwrap_or(0.0);
            page.load
                .insert(rank, EngineLoad::from_gauges(waiting, running, kv));
        }
    }
    if page.load.is_empty() {
        return Err(ScrapeError::NoMetrics);
    }
    Ok(page)
}

/// Splits `{k="v",...} rest` into its labels and `rest`; `None` when the braces or quotes do
/// not close. Escapes (`\"`, `\\`, `\n`) are kept as written: rank values never hold them.
fn split_labels(s: &str) -> Option<(Vec<(&str, &str)>, &str)> {
    let b = s.as_bytes();
    let mut labels = Vec::new();
    let mut i = 1;
    loop {
        while i < b.len() && (b[i] == b',' || b[i].is_ascii_whitespace()) {
            i += 1;
        }
        if *b.get(i)? == b'}' {
            return Some((labels, &s[i + 1..]));
        }
        let k_start = i;
        while i < b.len() && b[i] != b'=' {
            i += 1;
        }
        let key = s.get(k_start..i)?.trim();
        i += 1;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if *b.get(i)? != b'"' {
            return None;
        }
        i += 1;
        let v_start = i;
        while i < b.len() && b[i] != b'"' {
            i += if b[i] == b'\\' { 2 } else { 1 };
        }
        let value = s.get(v_start..i)?;
        if i >= b.len() {
            return None;
        }
        i += 1;
        labels.push((key, value));
    }
}

/// Scraper settings (from the collector's config).
#[derive(Clone, Copy, Debug)]
pub struct ScrapeConfig {
    /// Zero disables scraping.
    pub interval: Duration,
    pub timeout: Duration,
    pub max_bytes: usize,
    /// Failing this long after having answered: the engine is down (not routed to).
    pub down_after: Duration,
}

/// Fetches `url` with every bound applied: status, size (reading stops at `max_bytes`) and
/// time.
///
/// # Errors
/// Any [`ScrapeError`] but the parse ones.
pub async fn fetch(
    client: &reqwest::Client,
    url: &str,
    max_bytes: usize,
    timeout: Duration,
) -> Result<Vec<u8>, ScrapeError> {
    let http = |e: reqwest::Error| {
        if e.is_timeout() {
            ScrapeError::Timeout
        } else {
            // `{:#}`-like detail: reqwest hides the cause (refused, reset) in its source.
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg = format!("{msg}: {s}");
                src = s.source();
            }
            ScrapeError::Http(msg)
        }
    };
    let read = async {
        let mut resp = client.get(url).send().await.map_err(http)?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status(resp.status().as_u16()));
        }
        if resp.content_length().is_some_and(|n| n > max_bytes as u64) {
            return Err(ScrapeError::TooLarge(max_bytes));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(http)? {
            if body.len() + chunk.len() > max_bytes {
                return Err(ScrapeError::TooLarge(max_bytes));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

/// Fetches and parses one engine's page.
///
/// # Errors
/// See [`fetch`] and [`parse`].
pub async fn scrape(
    client: &reqwest::Client,
    address: &str,
    cfg: &ScrapeConfig,
) -> Result<Page, ScrapeError> {
    let body = fetch(
        client,
        &format!("http://{address}/metrics"),
        cfg.max_bytes,
        cfg.timeout,
    )
    .await?;
    let text = std::str::from_utf8(&body)
        .map_err(|e| ScrapeError::Malformed(format!("not UTF-8: {e}")))?;
    parse_page(text)
}

/// One engine to scrape: its serving address and the workers (dp ranks) behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub address: String,
    pub workers: Vec<(WorkerId, u32)>,
}

impl Target {
    /// The `(worker, rank)`s still registered at this address: one unregistered (and its
    /// slot perhaps reused) while a scrape ran must not get this engine's figures.
    pub fn still_registered<'a>(
        &'a self,
        hub: &'a crate::hub::Hub,
    ) -> impl Iterator<Item = (WorkerId, u32)> + 'a {
        self.workers.iter().copied().filter(move |&(worker, rank)| {
            hub.worker(worker)
                .is_some_and(|w| w.address() == self.address && w.dp_rank() == rank)
        })
    }
}

/// The engines of the worker table, one per serving address.
pub fn targets<'a>(workers: impl Iterator<Item = &'a crate::hub::WorkerInfo>) -> Vec<Target> {
    let mut by_addr: BTreeMap<&str, Vec<(WorkerId, u32)>> = BTreeMap::new();
    for w in workers.filter(|w| !w.address().is_empty()) {
        by_addr
            .entry(w.address())
            .or_default()
            .push((w.id, w.dp_rank()));
    }
    by_addr
        .into_iter()
        .map(|(address, workers)| Target {
            address: address.to_owned(),
            workers,
        })
        .collect()
}

struct Backoff {
    failures: u32,
    next: Instant,
    /// The first failure of this run of failures.
    since: Instant,
}

/// Scrapes every engine every `interval` until aborted; returns at once when scraping is off.
pub async fn run(state: AppState, cfg: ScrapeConfig) {
    if cfg.interval.is_zero() {
        return;
    }
    let client = match reqwest::Client::builder()
        .connect_timeout(cfg.timeout)
        .pool_max_idle_per_host(1)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "engine scraper not started: no HTTP client");
            return;
        }
    };
    let mut backoff: HashMap<String, Backoff> = HashMap::new();
    // Engines that answered at least once: only those can be taken as down, so an engine
    // without a metrics endpoint is never dropped for it.
    let mut answered: HashSet<String> = HashSet::new();
    // Engines marked down: their workers are told when they answer again.
    let mut down: HashSet<String> = HashSet::new();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let targets = targets(state.read().workers());
        let now = Instant::now();
        backoff.retain(|a, _| targets.iter().any(|t| &t.address == a));
        answered.retain(|a| targets.iter().any(|t| &t.address == a));
        down.retain(|a| targets.iter().any(|t| &t.address == a));
        let due: Vec<Target> = targets
            .into_iter()
            .filter(|t| backoff.get(&t.address).is_none_or(|b| b.next <= now))
            .collect();
        let client = &client;
        let mut results = stream::iter(due)
            .map(|t| async move {
                let r = scrape(client, &t.address, &cfg).await;
                (t, r, Instant::now())
            })
            .buffer_unordered(CONCURRENCY);
        while let Some((t, result, at)) = results.next().await {
            match result {
                Ok(page) => {
                    backoff.remove(&t.address);
                    answered.insert(t.address.clone());
                    state.metrics.engine_scrapes.inc();
                    if down.remove(&t.address) {
                        tracing::info!(address = %t.address, "engine metrics answer again; routed to again");
                        mark_down(&state, &t, false);
                    }
                    let mut resize = Vec::new();
                    {
                        // Lock order: fleet, then hub.
                        let mut fleet = state.fleet();
                        let hub = state.read();
                        for (worker, rank) in t.still_registered(&hub) {
                            if let Some(f) = page.load.get(&rank) {
                                fleet.set_engine(worker, EngineSample { load: *f, at });
                            }
                            let Some(r) = page.reuse.get(&rank) else {
                                continue;
                            };
                            fleet.truth_mut().note_engine(worker, r, at);
                            if let Some(blocks) = r.cache_blocks {
                                let blocks = usize::try_from(blocks).unwrap_or(usize::MAX);
                                if hub.index.needs_capacity(worker, blocks) {
                                    resize.push((worker, blocks));
                                }
                            }
                        }
                    }
                    if !resize.is_empty() {
                        size_index(&state, &t, &resize);
                    }
                }
                Err(e) => {
                    state
                        .metrics
                        .engine_scrape_failures
                        .get_or_create(&ReasonLabels { reason: e.reason() })
                        .inc();
                    let b = backoff.entry(t.address.clone()).or_insert(Backoff {
                        failures: 0,
                        next: at,
                        since: at,
                    });
                    if answered.contains(&t.address)
                        && at.duration_since(b.since) >= cfg.down_after
                        && down.insert(t.address.clone())
                    {
                        tracing::warn!(address = %t.address, error = %e, failing_secs = at.duration_since(b.since).as_secs_f64(), "engine metrics failing after having answered: taken as down, not routed to");
                        mark_down(&state, &t, true);
                    }
                    b.failures = b.failures.saturating_add(1);
                    let pause = cfg
                        .interval
                        .saturating_mul(1 << b.failures.min(16))
                        .min(MAX_BACKOFF);
                    b.next = at + pause;
                    if b.failures == 1 {
                        tracing::warn!(address = %t.address, error = %e, "engine metrics scrape failed; backing off");
                    } else {
                        tracing::debug!(address = %t.address, error = %e, failures = b.failures, "engine metrics scrape failed");
                    }
                }
            }
        }
    }
}

/// Sizes the index for the cache sizes an engine's page gave (rare: once per engine, and
/// again only if its cache changes size), so that the write lock is taken only then.
fn size_index(state: &AppState, t: &Target, sizes: &[(WorkerId, usize)]) {
    let mut hub = state.write();
    for &(worker, blocks) in sizes {
        if hub.index.set_capacity(worker, blocks) {
            tracing::info!(address = %t.address, worker = worker.0, blocks, "index sized for the engine's KV cache");
        }
    }
}

/// Marks the workers of `t` (those still registered at its address) down or up again.
fn mark_down(state: &AppState, t: &Target, is_down: bool) {
    let mut hub = state.write();
    let workers: Vec<(WorkerId, u32)> = t.still_registered(&hub).collect();
    for (worker, _) in workers {
        hub.set_metrics_down(worker, is_down);
    }
    drop(hub);
    state.notify();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_page_per_engine_index() {
        let page = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.99\n\
            vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            vllm:other{engine=\"zz\"} oops\n";
        let r = parse(page).unwrap();
        assert_eq!(
            r[&0],
            RankFigures {
                waiting: 7,
                running: 3,
                kv_permille: 250
            }
        );
        assert_eq!(r[&1].kv_permille, 500);
    }

    #[test]
    fn sglang_page_without_rank_is_rank_zero() {
        let page = "sglang:num_queue_reqs{model_name=\"a,b\\\"c\"} 4\nsglang:num_running_reqs{model_name=\"m\"} 2 1700000000\nsglang:token_usage 0.1\n";
        let r = parse(page).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[&0].waiting, 4);
        assert_eq!(r[&0].running, 2);
    }

    #[test]
    fn prefix_cache_figures_per_rank() {
        let page = "vllm:num_requests_waiting{engine=\"0\"} 0\nvllm:num_requests_running{engine=\"0\"} 1\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1.2e10\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 300.0\n\
            vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
            vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"False\",engine=\"0\",num_gpu_blocks=\"38912\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"2\",num_gpu_blocks=\"None\"} 1.0\n\
            sglang:cache_hit_rate{dp_rank=\"1\"} 0.25\n";
        let p = parse_page(page).unwrap();
        let r0 = p.reuse[&0];
        assert_eq!(
            r0.queries_tokens,
            Some(1.2e10),
            "counters go past the gauge cap"
        );
        assert_eq!(r0.hits_tokens, Some(300.0));
        assert_eq!(r0.block_size, Some(16));
        assert_eq!(r0.prefix_caching, Some(false));
        assert_eq!(r0.cache_blocks, Some(38_912));
        assert_eq!(p.reuse[&2].cache_blocks, None, "not profiled yet");
        assert_eq!(p.reuse[&1].hit_rate, Some(0.25));
        // Rank 1 has no queue figures: reuse only, no load sample.
        assert_eq!(p.load.len(), 1);
        assert!(matches!(
            parse_page("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nsglang:cache_hit_rate 1.5\n"),
            Err(ScrapeError::Malformed(_))
        ));
    }

    #[test]
    fn bad_pages_are_errors() {
        for page in [
            "vllm:num_requests_waiting{engine=\"0\" 1\n",
            "vllm:num_requests_waiting{engine=\"x\"} 1\n",
            "vllm:num_requests_waiting 1e12\n",
            "vllm:num_requests_waiting -1\n",
            "vllm:num_requests_waiting NaN\n",
            "vllm:num_requests_waiting\n",
        ] {
            assert!(
                matches!(parse(page), Err(ScrapeError::Malformed(_))),
                "{page}"
            );
        }
        assert_eq!(parse("garbage\n\0\u{1}"), Err(ScrapeError::NoMetrics));
        assert_eq!(
            parse("vllm:num_requests_waiting 1\n"),
            Err(ScrapeError::NoMetrics)
        );
    }
}
