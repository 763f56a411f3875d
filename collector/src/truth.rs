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
//! Two things keep a correct fleet quiet:
//! - *Counting runs.* A gateway's counters run from its start or its last feed-epoch switch,
//!   and a report names the epoch it counted in. A run that began in this collector's own
//!   epoch (or after the gateway was already seen here under another) is counted whole from
//!   its first report; only a run first met through another collector, begun at an unknown
//!   time, starts as a baseline. Runs are kept apart, so reports of the same gateway relayed
//!   late from its old collector are neither lost nor counted twice.
//! - *Holding.* The two sides of one request land at different moments (the gateway's report
//!   at routing, the engine's counters after its prefill and the next scrape), so a window
//!   holding few requests can disagree for a moment. A disagreement is only a verdict once it
//!   has held for `hold` (longer than that lag); the buckets are narrow (`window / 30`) so
//!   that an edge effect passes within it.
//!
//! Pure state, no I/O and no lock: it lives inside [`crate::fleet::Fleet`] behind its mutex,
//! and the clock is passed in.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvroute::event::WorkerId;

/// Buckets one window is cut into: the window slides by `window / BUCKETS`.
const BUCKETS: u32 = 30;
/// Most (gateway, counting run, worker) entries whose last counters are kept; over it new ones
/// are ignored once runs older than [`RUN_MEMORY`] are forgotten
/// (64 gateways × 4096 workers would be the product of both bounds; this is far above any
/// real fleet and bounds a hostile one).
const MAX_PAIRS: usize = 65_536;
/// Most workers tracked (the worker table holds 4096 slots).
const MAX_WORKERS: usize = 4096;
/// A single delta above this is a counter gone wrong, not traffic: it is dropped.
const MAX_DELTA_TOKENS: u64 = 1 << 40;
/// A gateway's counting run silent this long is forgotten when room is needed.
const RUN_MEMORY: Duration = Duration::from_secs(600);

/// Truth-check settings (`--truth-window-secs`, `--hash-mismatch-factor`,
/// `--hash-mismatch-min-tokens`, `--hash-mismatch-hold-secs`).
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
    /// ... and has so continuously for this long, so the moment between a request's report
    /// and its engine's next scrape never alarms. Default 15 s.
    pub hold: Duration,
}

impl Default for TruthConfig {
    fn default() -> Self {
        TruthConfig {
            window: Duration::from_secs(60),
            factor: 2.0,
            min_tokens: 4096,
            hold: Duration::from_secs(15),
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
    /// `vllm:cache_config_info{num_gpu_blocks}`: the cache's size, which sizes the index.
    pub cache_blocks: Option<u64>,
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
    /// The window's verdict as of the last update and since when it has held.
    verdict: Option<(bool, Instant)>,
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
    /// How long [`Reading::mismatch`]'s verdict has held (zero without one).
    pub held: Duration,
}

impl Reading {
    /// predicted / engine (`None` without an engine figure or with nothing reused).
    pub fn ratio(&self) -> Option<f64> {
        let e = self.engine_tokens?;
        (e > 0).then(|| self.predicted_tokens as f64 / e as f64)
    }

    /// Over the volume floor, off by more than `factor`, and so for at least `hold`:
    /// `Some(true)` when kvroute predicts more than the engine reuses, `Some(false)` when less.
    pub fn mismatch(&self, cfg: &TruthConfig) -> Option<bool> {
        self.disagrees(cfg).filter(|_| self.held >= cfg.hold)
    }

    /// [`Reading::mismatch`] at this instant, however long it has held.
    pub fn disagrees(&self, cfg: &TruthConfig) -> Option<bool> {
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

/// Where a report's counters were counted: the feed epoch the gateway counted in, and whether
/// that is this collector's own (the report came straight from the gateway) or another
/// collector's (relayed over the bus).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    pub epoch: u64,
    pub own: bool,
}

/// One counting run's last cumulative counters.
#[derive(Clone, Copy, Debug)]
struct Last {
    predicted: u64,
    routed: u64,
    at: Instant,
}

/// The truth check's memory.
#[derive(Debug, Default)]
pub struct Truth {
    config: TruthConfig,
    workers: HashMap<WorkerId, WorkerTruth>,
    /// By (gateway, counting run, worker): its last cumulative counters.
    last_report: HashMap<(String, Source, WorkerId), Last>,
    /// By gateway: the counting runs seen (a gateway met again under a new one restarted
    /// its counters while this collector watched).
    runs: HashMap<String, Vec<(Source, Instant)>>,
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

    /// Takes one gateway's cumulative `(worker, predicted, routed)` counts, counted in
    /// `source` and reported at `now`. A new counting run is counted whole when it began while
    /// this collector watched (its own epoch, or the gateway already seen under another run);
    /// otherwise its first report is a baseline.
    pub fn note_report(
        &mut self,
        gateway: &str,
        source: Source,
        counts: &[(WorkerId, u64, u64)],
        now: Instant,
    ) {
        let width = self.width();
        let whole = self.note_run(gateway, source, now);
        for &(w, predicted, routed) in counts {
            let key = (gateway.to_owned(), source, w);
            let last = self.last_report.get(&key).copied();
            if last.is_none() && self.last_report.len() >= MAX_PAIRS {
                self.last_report
                    .retain(|_, l| now.saturating_duration_since(l.at) < RUN_MEMORY);
                if self.last_report.len() >= MAX_PAIRS {
                    continue;
                }
            }
            self.last_report.insert(
                key,
                Last {
                    predicted,
                    routed,
                    at: now,
                },
            );
            if let Some(t) = self.worker(w) {
                t.routed_total.get_or_insert(0);
            }
            let (dp, dr) = match last {
                Some(l) => (
                    step(Some(l.predicted), predicted),
                    step(Some(l.routed), routed),
                ),
                None if whole => (step(None, predicted), step(None, routed)),
                None => continue,
            };
            if dp == 0 && dr == 0 {
                continue;
            }
            if let Some(t) = self.worker(w) {
                t.routed_total = Some(t.routed_total.unwrap_or(0).saturating_add(dr));
                let b = t.bucket(now, width);
                b.predicted = b.predicted.saturating_add(dp);
                b.routed = b.routed.saturating_add(dr);
            }
            self.judge(w, now);
        }
    }

    /// Records `gateway`'s counting run `source`; whether a run new to this collector began
    /// while it watched.
    fn note_run(&mut self, gateway: &str, source: Source, now: Instant) -> bool {
        if !self.runs.contains_key(gateway) && self.runs.len() >= MAX_PAIRS {
            self.runs.retain(|_, r| {
                r.iter()
                    .any(|(_, at)| now.saturating_duration_since(*at) < RUN_MEMORY)
            });
        }
        if !self.runs.contains_key(gateway) && self.runs.len() >= MAX_PAIRS {
            return source.own;
        }
        let runs = self.runs.entry(gateway.to_owned()).or_default();
        if let Some(r) = runs.iter_mut().find(|(s, _)| *s == source) {
            r.1 = now;
            return true;
        }
        let whole = source.own || !runs.is_empty();
        runs.retain(|(_, at)| now.saturating_duration_since(*at) < RUN_MEMORY);
        // A gateway switches collectors now and then; a handful of runs is plenty.
        if runs.len() >= 8 {
            runs.remove(0);
        }
        runs.push((source, now));
        whole
    }

    /// Updates `w`'s held verdict from its window at `now`.
    fn judge(&mut self, w: WorkerId, now: Instant) {
        let config = self.config;
        let Some(t) = self.workers.get_mut(&w) else {
            return;
        };
        let verdict = reading(w, t, &config, now).disagrees(&config);
        t.verdict = match (verdict, t.verdict) {
            (Some(v), Some((held, since))) if v == held => Some((held, since)),
            (Some(v), _) => Some((v, now)),
            (None, _) => None,
        };
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
        // Every scrape, traffic or not: a verdict also ends when its window empties.
        self.judge(w, now);
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
        self.last_report.retain(|(_, _, w), _| !ids.contains(w));
    }

    /// Every tracked worker's window sums at `now`, by worker id.
    pub fn readings(&self, now: Instant) -> Vec<Reading> {
        let mut out: Vec<Reading> = self
            .workers
            .iter()
            .map(|(w, t)| reading(*w, t, &self.config, now))
            .collect();
        out.sort_by_key(|r| r.worker);
        out
    }
}

/// `t`'s sums over the window before `now`.
fn reading(worker: WorkerId, t: &WorkerTruth, config: &TruthConfig, now: Instant) -> Reading {
    let window = config.window;
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
    let mut r = Reading {
        worker,
        predicted_tokens: s.predicted,
        routed_tokens: s.routed,
        engine_rate,
        engine_tokens: engine_rate.map(|r| (r * s.routed as f64).round() as u64),
        engine_block_size: t.block_size,
        prefix_caching: t.prefix_caching,
        held: Duration::ZERO,
    };
    // The held verdict counts only while the window still says the same.
    if let Some((dir, since)) = t.verdict {
        if r.disagrees(config) == Some(dir) {
            r.held = now.saturating_duration_since(since);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: Source = Source {
        epoch: 7,
        own: true,
    };

    fn vllm(hits: f64, queries: f64) -> EngineReuse {
        EngineReuse {
            hits_tokens: Some(hits),
            queries_tokens: Some(queries),
            ..EngineReuse::default()
        }
    }

    fn no_hold() -> TruthConfig {
        TruthConfig {
            hold: Duration::ZERO,
            ..TruthConfig::default()
        }
    }

    #[test]
    fn predicted_and_engine_reuse_agree_when_kvroute_sends_all_traffic() {
        let mut t = Truth::new(no_hold());
        let t0 = Instant::now();
        let w = WorkerId(1);
        // Counted in this collector's epoch: the first report counts whole.
        t.note_report("gw", OWN, &[(w, 100, 1000)], t0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        let t1 = t0 + Duration::from_secs(5);
        t.note_report("gw", OWN, &[(w, 100 + 6000, 1000 + 10_000)], t1);
        t.note_engine(w, &vllm(6100.0, 11_000.0), t1);
        let r = t.readings(t1)[0];
        assert_eq!(r.predicted_tokens, 6100);
        assert_eq!(r.engine_tokens, Some(6100));
        assert_eq!(r.ratio(), Some(1.0));
        assert_eq!(r.mismatch(t.config()), None);
    }

    #[test]
    fn a_run_first_met_through_another_collector_starts_as_a_baseline() {
        let mut t = Truth::new(no_hold());
        let t0 = Instant::now();
        let w = WorkerId(1);
        let relayed = Source {
            epoch: 3,
            own: false,
        };
        t.note_report("gw", relayed, &[(w, 50_000, 90_000)], t0);
        t.note_report("gw", relayed, &[(w, 50_600, 91_000)], t0);
        let r = t.readings(t0)[0];
        assert_eq!((r.predicted_tokens, r.routed_tokens), (600, 1000));
        // The gateway moves to this collector: its counters restarted, counted whole.
        t.note_report("gw", OWN, &[(w, 300, 500)], t0);
        // A report of the old run relayed late is a step of that run, not a restart.
        t.note_report("gw", relayed, &[(w, 50_700, 91_200)], t0);
        let r = t.readings(t0)[0];
        assert_eq!((r.predicted_tokens, r.routed_tokens), (1000, 1700));
        // A further run met through another collector after that began while we watched.
        let other = Source {
            epoch: 9,
            own: false,
        };
        t.note_report("gw", other, &[(w, 10, 20)], t0);
        let r = t.readings(t0)[0];
        assert_eq!((r.predicted_tokens, r.routed_tokens), (1010, 1720));
    }

    /// Two gateways, one engine: one request's report lands before the engine's scrape shows
    /// its reuse. The window disagrees for that moment only, which never reaches `hold`.
    #[test]
    fn the_lag_between_report_and_scrape_never_holds() {
        let cfg = TruthConfig {
            min_tokens: 1000,
            ..TruthConfig::default()
        };
        let mut t = Truth::new(cfg);
        let t0 = Instant::now();
        let w = WorkerId(4);
        let (mut p, mut r, mut hits, mut queries) = ([0u64; 2], [0u64; 2], 0.0, 0.0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        let (mut raised, mut flickers) = (0, 0);
        // Every 2 s one gateway routes a 4,000-token prompt, 3,000 of it cached (the first
        // cold); the engine's counters show it 1.5 s later, scraped every 0.5 s.
        let mut pending: Vec<(Instant, f64, f64)> = Vec::new();
        for tick in 0..600u64 {
            let now = t0 + Duration::from_millis(500 * tick);
            if tick % 4 == 0 {
                let g = (tick / 4 % 2) as usize;
                let cached = if tick == 0 { 0 } else { 3000 };
                p[g] += cached;
                r[g] += 4000;
                let gw = ["gw-a", "gw-b"][g];
                t.note_report(gw, OWN, &[(w, p[g], r[g])], now);
                pending.push((now + Duration::from_millis(1500), cached as f64, 4000.0));
            }
            pending.retain(|(at, h, q)| {
                if *at <= now {
                    hits += h;
                    queries += q;
                    false
                } else {
                    true
                }
            });
            t.note_engine(w, &vllm(hits, queries), now);
            let reading = t.readings(now)[0];
            raised += usize::from(reading.mismatch(t.config()).is_some());
            flickers += usize::from(reading.disagrees(t.config()).is_some());
        }
        assert_eq!(raised, 0);
        assert!(flickers > 0, "the lag never showed: the case tests nothing");
        // Without the hold the first moments would have raised it: the check is live.
        let mut quick = Truth::new(TruthConfig {
            hold: Duration::ZERO,
            ..cfg
        });
        quick.note_engine(w, &vllm(0.0, 0.0), t0);
        quick.note_report("gw-a", OWN, &[(w, 0, 4000)], t0);
        quick.note_engine(w, &vllm(0.0, 4000.0), t0);
        quick.note_report("gw-b", OWN, &[(w, 3000, 4000)], t0);
        assert_eq!(quick.readings(t0)[0].mismatch(quick.config()), Some(true));
    }

    #[test]
    fn engine_reusing_what_kvroute_did_not_predict_is_a_mismatch_once_held() {
        let mut t = Truth::new(TruthConfig::default());
        let t0 = Instant::now();
        let w = WorkerId(2);
        t.note_report("gw", OWN, &[(w, 0, 0)], t0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        let mut now = t0;
        for i in 1..=20u64 {
            now = t0 + Duration::from_secs(i);
            t.note_report("gw", OWN, &[(w, 0, 2000 * i)], now);
            t.note_engine(w, &vllm(1500.0 * i as f64, 2000.0 * i as f64), now);
            let r = t.readings(now)[0];
            assert_eq!(r.disagrees(t.config()), (i >= 3).then_some(false), "{i}");
            let held = now.saturating_duration_since(t0 + Duration::from_secs(3));
            assert_eq!(
                r.mismatch(t.config()),
                (i >= 3 && held >= t.config().hold).then_some(false),
                "{i}"
            );
        }
        assert_eq!(t.readings(now)[0].ratio(), Some(0.0));
        // Out of the window, nothing is left to judge.
        let late = now + Duration::from_secs(61);
        t.note_engine(w, &vllm(30_000.0, 40_000.0), late);
        assert_eq!(t.readings(late)[0].mismatch(t.config()), None);
    }

    #[test]
    fn little_volume_never_alarms() {
        let mut t = Truth::new(no_hold());
        let t0 = Instant::now();
        let w = WorkerId(3);
        t.note_report("gw", OWN, &[(w, 0, 0)], t0);
        t.note_engine(w, &vllm(0.0, 0.0), t0);
        t.note_report("gw", OWN, &[(w, 0, 1000)], t0);
        t.note_engine(w, &vllm(900.0, 1000.0), t0);
        assert_eq!(t.readings(t0)[0].mismatch(t.config()), None);
    }

    #[test]
    fn sglang_rate_scales_the_routed_tokens_and_counters_restart() {
        let mut t = Truth::new(no_hold());
        let t0 = Instant::now();
        let w = WorkerId(4);
        let relayed = Source {
            epoch: 1,
            own: false,
        };
        t.note_report("gw", relayed, &[(w, 500, 1000)], t0);
        t.note_report("gw", relayed, &[(w, 4000, 10_000)], t0);
        // The gateway restarted: its counters start again from 0 and count whole.
        t.note_report("gw", relayed, &[(w, 100, 1000)], t0);
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
