//! The truth check (issue 21): the tokens kvroute predicted as cached for the requests it sent
//! to an engine, against the tokens the engine says it reused, over a sliding window.
//!
//! Inputs, all cumulative counters turned into deltas here:
//! - each gateway's `POST /v1/load` report carries, per worker, `predicted_cached_tokens` (the
//!   matched tokens of every request it routed there) and `routed_prompt_tokens` (their prompt
//!   tokens);
//! - each engine's `/metrics`: vLLM's `vllm:prefix_cache_hits_total` and
//!   `vllm:prefix_cache_queries_total` (tokens), or, where that is all there is, SGLang's
//!   `sglang:cache_hit_rate` gauge.
//!
//! The engine's reuse attributable to kvroute's traffic is its hit rate over the window
//! times the prompt tokens kvroute routed to it: when kvroute sends all of an engine's traffic
//! that is the engine's hit count; when others send some too, it is the share of kvroute's.
//! The ratio predicted / engine should sit near 1; far from it, kvroute's hashes do not
//! describe what the engine caches (`hash_mismatch`).
//!
//! Pure state, no I/O and no lock: it lives inside [`crate::fleet::Fleet`] behind its mutex,
//! and the clock is passed in.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvroute::event::WorkerId;

/// Buckets one window is cut into: the window slides by `window / BUCKETS`.
const BUCKETS: u32 = 6;
/// Most (gateway, worker) pairs whose last counters are kept; over it new pairs are ignored
/// (64 gateways × 4096 workers would be the product of both bounds; this is far above any
/// real fleet and bounds a hostile one).
const MAX_PAIRS: usize = 65_536;
/// Most workers tracked (the worker table holds 4096 slots).
const MAX_WORKERS: usize = 4096;
/// A single delta above this is a counter gone wrong, not traffic: it is dropped.
const MAX_DELTA_TOKENS: u64 = 1 << 40;

/// Truth-check settings (`--truth-window-secs`, `--hash-mismatch-factor`,
/// `--hash-mismatch-min-tokens`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TruthConfig {
    /// The sliding window the sums cover. Default 60 s.
    pub window: Duration,
    /// `hash_mismatch` when predicted and engine reuse differ by more than this factor either
    /// way. Default 2.0.
    pub factor: f64,
    /// ... and the larger of the two is at least this many tokens within the window, so an
    /// idle engine or a trickle never alarms. Default 4096.
    pub min_tokens: u64,
}

impl Default for TruthConfig {
    fn default() -> Self {
        TruthConfig {
            window: Duration::from_secs(60),
            factor: 2.0,
            min_tokens: 4096,
        }
    }
}

/// What an engine's `/metrics` page says of its prefix cache (one dp rank).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineReuse {
    /// `vllm:prefix_cache_hits_total`: cached tokens, cumulative.
    pub hits_tokens: Option<f64>,
    /// `vllm:prefix_cache_queries_total`: queried tokens, cumulative.
    pub queries_tokens: Option<f64>,
    /// `sglang:cache_hit_rate`: 0..=1.
    pub hit_rate: Option<f64>,
    /// `vllm:cache_config_info{block_size}`.
    pub block_size: Option<u32>,
    /// `vllm:cache_config_info{enable_prefix_caching}`.
    pub prefix_caching: Option<bool>,
}

impl EngineReuse {
    /// Whether the page said anything the truth check can use.
    pub fn is_empty(&self) -> bool {
        *self == EngineReuse::default()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    predicted: u64,
    routed: u64,
    hits: u64,
    queries: u64,
    rate_sum: f64,
    rate_n: u32,
}

#[derive(Debug, Default)]
struct WorkerTruth {
    /// Oldest first, at most `BUCKETS + 1`, each `(start, sums)`.
    buckets: VecDeque<(Instant, Bucket)>,
    /// The engine's last cumulative `(hits, queries)`.
    last_engine: Option<(f64, f64)>,
    block_size: Option<u32>,
    prefix_caching: Option<bool>,
    /// Every routed prompt token reported since the collector started (the first report of
    /// each gateway a baseline); `None` until a gateway reports any.
    routed_total: Option<u64>,
}

impl WorkerTruth {
    fn bucket(&mut self, now: Instant, width: Duration) -> &mut Bucket {
        let fresh = self
            .buckets
            .back()
            .is_none_or(|(start, _)| now.saturating_duration_since(*start) >= width);
        if fresh {
            self.buckets.push_back((now, Bucket::default()));
            while self.buckets.len() > BUCKETS as usize + 1 {
                self.buckets.pop_front();
            }
        }
        // Just pushed when empty.
        &mut self.buckets.back_mut().expect("a bucket").1
    }
}

/// One worker's window sums and what they say.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub worker: WorkerId,
    /// Tokens kvroute predicted as cached for the requests it sent there.
    pub predicted_tokens: u64,
    /// Prompt tokens of those requests.
    pub routed_tokens: u64,
    /// The engine's hit rate over the window (`None`: it exports no reuse figure).
    pub engine_rate: Option<f64>,
    /// The engine's reuse on kvroute's requests: `engine_rate × routed_tokens`.
    pub engine_tokens: Option<u64>,
    /// The engine's block size, from `vllm:cache_config_info`.
    pub engine_block_size: Option<u32>,
    /// The engine's prefix caching switch, from `vllm:cache_config_info`.
    pub prefix_caching: Option<bool>,
}

impl Reading {
    /// predicted / engine (`None` without an engine figure or with nothing reused).
    pub fn ratio(&self) -> Option<f64> {
        let e = self.engine_tokens?;
        (e > 0).then(|| self.predicted_tokens as f64 / e as f64)
    }

    /// Over the volume floor and off by more than `factor`: `Some(true)` when kvroute
    /// predicts more than the engine reuses, `Some(false)` when less.
    pub fn mismatch(&self, cfg: &TruthConfig) -> Option<bool> {
        let e = self.engine_tokens?;
        let p = self.predicted_tokens;
        if p.max(e) < cfg.min_tokens {
            return None;
        }
        let f = cfg.factor.max(1.0);
        if p as f64 > f * e as f64 {
            Some(true)
        } else if e as f64 > f * p as f64 {
            Some(false)
        } else {
            None
        }
    }
}

/// The truth check's memory.
#[derive(Debug, Default)]
pub struct Truth {
    config: TruthConfig,
    workers: HashMap<WorkerId, WorkerTruth>,
    /// By (gateway, worker): its last cumulative `(predicted, routed)`.
    last_report: HashMap<(String, WorkerId), (u64, u64)>,
}

/// The step from `last` to `now` of a cumulative counter; a counter that went back restarted
/// (a gateway or engine restart) and its whole value is the step.
fn step(last: Option<u64>, now: u64) -> u64 {
    let d = match last {
        Some(l) if now >= l => now - l,
        _ => now,
    };
    if d > MAX_DELTA_TOKENS {
        0
    } else {
        d
    }
}

impl Truth {
    pub fn new(config: TruthConfig) -> Truth {
        Truth {
            config,
            ..Truth::default()
        }
    }

    pub fn config(&self) -> &TruthConfig {
        &self.config
    }

    fn width(&self) -> Duration {
        (self.config.window / BUCKETS).max(Duration::from_millis(1))
    }

    fn worker(&mut self, w: WorkerId) -> Option<&mut WorkerTruth> {
        if !self.workers.contains_key(&w) && self.workers.len() >= MAX_WORKERS {
            return None;
        }
        Some(self.workers.entry(w).or_default())
    }

    /// Takes one gateway's cumulative `(worker, predicted, routed)` counts, reported at `now`.
    /// The first report of a pair only sets its baseline: what a gateway counted before the
    /// collector knew it is not in any window.
    pub fn note_report(&mut self, gateway: &str, counts: &[(WorkerId, u64, u64)], now: Instant) {
        let width = self.width();
        for &(w, predicted, routed) in counts {
            let key = (gateway.to_owned(), w);
            let last = self.last_report.get(&key).copied();
            if last.is_none() && self.last_report.len() >= MAX_PAIRS {
                continue;
            }
            self.last_report.insert(key, (predicted, routed));
            if let Some(t) = self.worker(w) {
                t.routed_total.get_or_insert(0);
            }
            let Some(last) = last else { continue };
            let (dp, dr) = (step(Some(last.0), predicted), step(Some(last.1), routed));
            if dp == 0 && dr == 0 {
                continue;
            }
            if let Some(t) = self.worker(w) {
                t.routed_total = Some(t.routed_total.unwrap_or(0).saturating_add(dr));
                let b = t.bucket(now, width);
                b.predicted = b.predicted.saturating_add(dp);
                b.routed = b.routed.saturating_add(dr);
            }
        }
    }

    /// Takes one engine sample of a worker's reuse figures, scraped at `now`.
    pub fn note_engine(&mut self, w: WorkerId, reuse: &EngineReuse, now: Instant) {
        if reuse.is_empty() {
            return;
        }
        let width = self.width();
        let Some(t) = self.worker(w) else { return };
        t.block_size = reuse.block_size.or(t.block_size);
        t.prefix_caching = reuse.prefix_caching.or(t.prefix_caching);
        if let (Some(h), Some(q)) = (reuse.hits_tokens, reuse.queries_tokens) {
            let last = t.last_engine.replace((h, q));
            if let Some((lh, lq)) = last {
                let dh = step(Some(lh as u64), h as u64);
                let dq = step(Some(lq as u64), q as u64);
                if dh > 0 || dq > 0 {
                    let b = t.bucket(now, width);
                    b.hits = b.hits.saturating_add(dh);
                    b.queries = b.queries.saturating_add(dq);
                }
            }
        } else if let Some(r) = reuse.hit_rate {
            let b = t.bucket(now, width);
            b.rate_sum += r.clamp(0.0, 1.0);
            b.rate_n += 1;
        }
    }

    /// Every worker's routed prompt tokens since the collector started, for the workers some
    /// gateway reports them for.
    pub fn routed_totals(&self) -> HashMap<WorkerId, u64> {
        self.workers
            .iter()
            .filter_map(|(w, t)| Some((*w, t.routed_total?)))
            .collect()
    }

    /// Forgets unregistered workers.
    pub fn forget_workers(&mut self, ids: &[WorkerId]) {
        for id in ids {
            self.workers.remove(id);
        }
        self.last_report.retain(|(_, w), _| !ids.contains(w));
    }

    /// Every tracked worker's window sums at `now`, by worker id.
    pub fn readings(&self, now: Instant) -> Vec<Reading> {
        let window = self.config.window;
        let mut out: Vec<Reading> = self
            .workers
            .iter()
            .map(|(w, t)| {
                let mut s = Bucket::default();
                for (start, b) in &t.buckets {
                    if now.saturating_duration_since(*start) < window {
                        s.predicted += b.predicted;
                        s.routed += b.routed;
                        s.hits += b.hits;
                        s.queries += b.queries;
                        s.rate_sum += b.rate_sum;
                        s.rate_n += b.rate_n;
                    }
                }
                let engine_rate = if s.queries > 0 {
                    Some((s.hits as f64 / s.queries as f64).min(1.0))
                } else if s.rate_n > 0 {
                    Some(s.rate_sum / f64::from(s.rate_n))
                } else {
                    None
                };
                Reading {
                    worker: *w,
                    predicted_tokens: s.predicted,
                    routed_tokens: s.routed,
                    engine_rate,
                    engine_tokens: engine_rate.map(|r| (r * s.routed as f64).round() as u64),
                    engine_block_size: t.block_size,
                    prefix_caching: t.prefix_caching,
                }
            })
            .collect();
        out.sort_by_key(|r| r.worker);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(hits: f64, queries: f64) -> EngineReuse {
        EngineReuse {
            hits_tokens: Some(hits),
            queries_tokens: Some(queries),
            ..EngineReuse::default()
        }
    }

    #[test]
    fn predicted_and_engine_reuse_agree_when_kvroute_sends_all_traffic() {
        let mut t = Truth::new(TruthConfig::default());
        let t0 = Instant::now();
        let w = WorkerId(1);
        t.note_report("gw", &[(w, 100, 1000)], t0);
        t.note_engine(w, &vllm(50.0, 900.0), t0);
        let t1 = t0 + Duration::from_secs(5);
        t.note_report("gw", &[(w, 100 + 6000, 1000 + 10_000)], t1);
        t.note_engine(w, &vllm(50.0 + 6000.0, 900.0 + 10_000.0), t1);
        let r = t.readings(t1)[0];
        assert_eq!(r.predicted_tokens, 6000, "the first report is a baseline");
        assert_eq!(r.engine_tokens, Some(6000));
        assert_eq!(r.ratio(), Some(1.0));
        assert_eq!(r.mismatch(t.config()), None);
    }

    #[test]
    fn engine_reusing_what_kvroute_did_not_predict_is_a_mismatch() {
        let mut t = Truth::new(TruthConfig::default());
        let t0 = Instant::now();
        let w = WorkerId(2);
        t.note_report("gw", &[(w, 0, 0)], t0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        let t1 = t0 + Duration::from_secs(1);
        t.note_report("gw", &[(w, 0, 20_000)], t1);
        t.note_engine(w, &vllm(15_000.0, 20_000.0), t1);
        let r = t.readings(t1)[0];
        assert_eq!(r.ratio(), Some(0.0));
        assert_eq!(r.mismatch(t.config()), Some(false));
        // Out of the window, nothing is left to judge.
        let late = t1 + Duration::from_secs(61);
        assert_eq!(t.readings(late)[0].mismatch(t.config()), None);
    }

    #[test]
    fn little_volume_never_alarms() {
        let mut t = Truth::new(TruthConfig::default());
        let t0 = Instant::now();
        let w = WorkerId(3);
        t.note_report("gw", &[(w, 0, 0)], t0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        t.note_report("gw", &[(w, 0, 1000)], t0);
        t.note_engine(w, &vllm(900.0, 1000.0), t0);
        assert_eq!(t.readings(t0)[0].mismatch(t.config()), None);
    }

    #[test]
    fn sglang_rate_scales_the_routed_tokens_and_counters_restart() {
        let mut t = Truth::new(TruthConfig::default());
        let t0 = Instant::now();
        let w = WorkerId(4);
        t.note_report("gw", &[(w, 500, 1000)], t0);
        t.note_report("gw", &[(w, 4000, 10_000)], t0);
        // The gateway restarted: its counters start again from 0 and count whole.
        t.note_report("gw", &[(w, 100, 1000)], t0);
        for r in [0.3, 0.5] {
            t.note_engine(
                w,
                &EngineReuse {
                    hit_rate: Some(r),
                    ..EngineReuse::default()
                },
                t0,
            );
        }
        let r = t.readings(t0)[0];
        assert_eq!(r.predicted_tokens, 3600);
        assert_eq!(r.routed_tokens, 10_000);
        assert_eq!(r.engine_tokens, Some(4000));
        assert_eq!(r.mismatch(t.config()), None);
        t.forget_workers(&[w]);
        assert!(t.readings(t0).is_empty());
    }
}
