//! Fleet-wide load: the gateways' in-flight reports and the engines' own queue figures, summed
//! per worker.
//!
//! Each gateway replica's filter books only the requests it sent itself, so N replicas each
//! see 1/N of the load and all pick the same warm engine. Every gateway posts its *absolute*
//! in-flight counts per worker (`POST /v1/load`); the collector keeps the last report of each
//! gateway and sums them. Absolute values make a lost report harmless: the next one replaces
//! it. A gateway that stops reporting is dropped after a timeout, so a dead replica's books do
//! not linger. The engines' `/metrics` (see `scrape.rs`) add what the engines themselves
//! count, which heals the gateways' drift.
//!
//! Reports also carry each gateway's recent routing decisions (`held`: a worker taken to hold
//! a prompt's first blocks, see `kvroute::router::own_holds`). The collector keeps them for
//! their time-to-live and hands each to every *other* live gateway once, on its next feed
//! page ([`Fleet::holds_for`]), so a sibling prompt reaching another gateway follows the
//! first before the engine's KV events arrive.
//!
//! Pure state, no I/O and no lock: the caller holds it behind a mutex and passes the clock in,
//! which keeps it testable and lets the feed call [`Fleet::totals`] directly.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use kvroute::event::WorkerId;
use kvroute::router::EngineLoad;
use serde::{Deserialize, Serialize};

use crate::truth::{Truth, TruthConfig};

/// Longest gateway id, bytes.
pub const MAX_GATEWAY_ID_BYTES: usize = 128;
/// Most in-flight requests one gateway may report for one worker; more is a bug, not load.
pub const MAX_REQUESTS: i64 = 1_000_000;
/// Most in-flight tokens (prefill or decode) one gateway may report for one worker.
pub const MAX_TOKENS: i64 = 1_000_000_000;
/// Most `held` entries in one report (a gateway's new decisions since its last report, a few
/// stored depths each).
pub const MAX_HELD_PER_REPORT: usize = 1024;
/// Longest time-to-live a `held` entry may ask for, ms.
pub const MAX_HELD_TTL_MS: u32 = 60_000;
/// Most `held` entries kept for the other gateways; past it the oldest go first.
pub const MAX_HELD: usize = 16_384;

/// A gateway replica's id, as it names itself in its reports.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GatewayId(String);

impl GatewayId {
    /// Validates an id: 1..=[`MAX_GATEWAY_ID_BYTES`] bytes.
    ///
    /// # Errors
    /// [`LoadError::GatewayId`] when empty or too long.
    pub fn new(id: &str) -> Result<GatewayId, LoadError> {
        if id.is_empty() || id.len() > MAX_GATEWAY_ID_BYTES {
            return Err(LoadError::GatewayId(id.len()));
        }
        Ok(GatewayId(id.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// In-flight load on one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadCounts {
    pub requests: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

impl LoadCounts {
    fn add(&mut self, o: &LoadCounts) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(o.decode_tokens);
    }
}

/// `POST /v1/load` body. Counts are signed so that a negative one is named as such rather than
/// lost in a generic type error.
#[derive(Clone, Debug, Deserialize)]
pub struct LoadReport {
    pub gateway: String,
    pub epoch: u64,
    pub workers: Vec<WorkerReport>,
    /// Optional: requests this gateway found no engine registered for since it started, by
    /// the request's model name; cumulative. Feeds the `no_model` alarm only.
    #[serde(default)]
    pub no_model: std::collections::BTreeMap<String, u64>,
    /// Optional: the filter's version (`gateway_mismatch`).
    #[serde(default)]
    pub version: Option<String>,
    /// Optional: the filter's hashing contract, [`kvroute::hash::contract`]
    /// (`gateway_mismatch`).
    #[serde(default)]
    pub contract: Option<String>,
    /// Optional: how old the gateway's feed is, ms (`gateway_stale`).
    #[serde(default)]
    pub feed_lag_ms: Option<u64>,
    /// Optional: the filter's text counters, cumulative (`text_approximate`).
    #[serde(default)]
    pub text: Option<crate::alarm::TextCounts>,
    /// Optional: the gateway's routing decisions since its last report, passed on to the
    /// other gateways (feed op `Held`).
    #[serde(default)]
    pub held: Vec<HeldReport>,
    /// Set on a report another collector relayed: the feed epoch its counters were counted in
    /// (that collector's). Never read from a request body.
    #[serde(skip)]
    pub relayed_epoch: Option<u64>,
}

/// One worker's entry of a [`LoadReport`]; a missing count is 0.
#[derive(Clone, Debug, Deserialize)]
pub struct WorkerReport {
    pub worker: u32,
    #[serde(default)]
    pub requests: i64,
    #[serde(default)]
    pub prefill_tokens: i64,
    #[serde(default)]
    pub decode_tokens: i64,
    /// Optional, cumulative since the gateway started: the tokens it predicted as cached for
    /// the requests it routed to this worker (the truth check, [`crate::truth`]).
    #[serde(default)]
    pub predicted_cached_tokens: Option<u64>,
    /// Optional, cumulative: the prompt tokens of those requests.
    #[serde(default)]
    pub routed_prompt_tokens: Option<u64>,
}

/// One entry of a report's `held`: the gateway sent a request whose prompt's first `blocks`
/// blocks end in `key` to `worker`, and counts it as holding them for `ttl_ms` more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldReport {
    pub worker: u32,
    /// The gateway's speculative table shard (passed through, not interpreted).
    pub shard: u32,
    pub key: u64,
    pub blocks: u32,
    pub ttl_ms: u32,
}

/// Why a report was refused. Nothing changes when one is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("gateway id must be 1 to {MAX_GATEWAY_ID_BYTES} bytes, got {0}")]
    GatewayId(usize),
    #[error("report is for feed epoch {got}, the collector's is {current}: resync the feed")]
    Epoch { got: u64, current: u64 },
    #[error("{entries} worker entries, more than the {workers} workers known")]
    TooManyEntries { entries: usize, workers: usize },
    #[error("worker {0} is not in the worker table of this epoch")]
    UnknownWorker(u32),
    #[error("worker {0} appears twice")]
    DuplicateWorker(u32),
    #[error("worker {worker}: {field} is negative ({value})")]
    Negative {
        worker: u32,
        field: &'static str,
        value: i64,
    },
    #[error("worker {worker}: {field} = {value} is over the cap of {cap}")]
    Absurd {
        worker: u32,
        field: &'static str,
        value: i64,
        cap: i64,
    },
    #[error("{max} gateways already report; a new one is refused until one stops")]
    TooManyGateways { max: usize },
    #[error(
        "worker {worker}: predicted_cached_tokens {predicted} over routed_prompt_tokens {routed}"
    )]
    PredictedOverRouted {
        worker: u32,
        predicted: u64,
        routed: u64,
    },
    #[error("{0} held entries, more than the {MAX_HELD_PER_REPORT} a report may carry")]
    TooManyHeld(usize),
    #[error("held entry {index}: {what}")]
    Held { index: usize, what: &'static str },
}

impl LoadError {
    /// The `reason` label of the refusal counter.
    pub fn reason(&self) -> &'static str {
        match self {
            LoadError::GatewayId(_) => "gateway_id",
            LoadError::Epoch { .. } => "epoch",
            LoadError::TooManyEntries { .. } => "too_many_entries",
            LoadError::UnknownWorker(_) => "unknown_worker",
            LoadError::DuplicateWorker(_) => "duplicate_worker",
            LoadError::Negative { .. } => "negative",
            LoadError::Absurd { .. } => "absurd",
            LoadError::TooManyGateways { .. } => "too_many_gateways",
            LoadError::PredictedOverRouted { .. } => "predicted_over_routed",
            LoadError::TooManyHeld(_) => "too_many_held",
            LoadError::Held { .. } => "held",
        }
    }
}

/// What an engine says of itself, from one scrape of its `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineSample {
    /// Its figures, converted once from the engine's gauges.
    pub load: EngineLoad,
    /// When it was scraped.
    pub at: Instant,
}

/// An [`EngineSample`] as of some instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineReading {
    pub sample: EngineSample,
    pub age: Duration,
    /// Older than the staleness limit: the engine stopped answering; do not trust it.
    pub stale: bool,
}

/// Fleet-wide load on one worker: the sum over live gateways, and the engine's last sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerLoad {
    pub worker: WorkerId,
    pub load: LoadCounts,
    pub engine: Option<EngineReading>,
}

/// Limits of the fleet view.
#[derive(Clone, Copy, Debug)]
pub struct FleetConfig {
    /// A gateway silent this long is dropped.
    pub gateway_timeout: Duration,
    /// Most gateways reporting at once.
    pub max_gateways: usize,
    /// An engine sample older than this is stale.
    pub engine_stale: Duration,
    /// The truth check's window and thresholds.
    pub truth: TruthConfig,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            gateway_timeout: Duration::from_secs(5),
            max_gateways: 64,
            engine_stale: Duration::from_secs(2),
            truth: TruthConfig::default(),
        }
    }
}

#[derive(Debug)]
struct GatewayLoad {
    at: Instant,
    loads: Vec<(WorkerId, LoadCounts)>,
    /// The sequence number of the first `held` entry this gateway has not been handed.
    held_from: u64,
}

/// A gateway's decision kept for the others.
#[derive(Clone, Debug)]
struct Held {
    seq: u64,
    from: GatewayId,
    worker: WorkerId,
    shard: u32,
    key: u64,
    blocks: u32,
    expires: Instant,
}

/// A `held` entry as handed to a reader: what is left of its time-to-live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldFor {
    pub worker: WorkerId,
    pub shard: u32,
    pub key: u64,
    pub blocks: u32,
    pub ttl_ms: u32,
}

/// The last report of every live gateway and the last sample of every scraped worker.
#[derive(Debug)]
pub struct Fleet {
    config: FleetConfig,
    gateways: HashMap<GatewayId, GatewayLoad>,
    engines: HashMap<WorkerId, EngineSample>,
    truth: Truth,
    /// Every gateway's recent decisions, in arrival order.
    held: VecDeque<Held>,
    next_held: u64,
}

impl Fleet {
    pub fn new(config: FleetConfig) -> Fleet {
        Fleet {
            config,
            gateways: HashMap::new(),
            engines: HashMap::new(),
            truth: Truth::new(config.truth),
            held: VecDeque::new(),
            next_held: 0,
        }
    }

    /// The truth check's window (predicted vs engine reuse per worker).
    pub fn truth(&self) -> &Truth {
        &self.truth
    }

    pub fn truth_mut(&mut self) -> &mut Truth {
        &mut self.truth
    }

    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// Validates a gateway's report and, when all of it is sound, replaces that gateway's
    /// previous one. `epoch` is the collector's feed epoch, `is_worker` says whether a worker id
    /// is in the current worker table, `workers` is that table's size.
    ///
    /// # Errors
    /// Any [`LoadError`]; the fleet is then unchanged (apart from expiring silent gateways).
    pub fn report(
        &mut self,
        report: &LoadReport,
        epoch: u64,
        is_worker: impl Fn(WorkerId) -> bool,
        workers: usize,
        now: Instant,
    ) -> Result<(), LoadError> {
        self.expire(now);
        let id = GatewayId::new(&report.gateway)?;
        if report.epoch != epoch {
            return Err(LoadError::Epoch {
                got: report.epoch,
                current: epoch,
            });
        }
        if report.workers.len() > workers {
            return Err(LoadError::TooManyEntries {
                entries: report.workers.len(),
                workers,
            });
        }
        let mut seen = HashSet::with_capacity(report.workers.len());
        let mut loads = Vec::with_capacity(report.workers.len());
        let mut truth = Vec::new();
        for w in &report.workers {
            if !is_worker(WorkerId(w.worker)) {
                return Err(LoadError::UnknownWorker(w.worker));
            }
            if !seen.insert(w.worker) {
                return Err(LoadError::DuplicateWorker(w.worker));
            }
            let count = |field: &'static str, value: i64, cap: i64| {
                if value < 0 {
                    Err(LoadError::Negative {
                        worker: w.worker,
                        field,
                        value,
                    })
                } else if value > cap {
                    Err(LoadError::Absurd {
                        worker: w.worker,
                        field,
                        value,
                        cap,
                    })
                } else {
                    Ok(value as u64)
                }
            };
            let counts = LoadCounts {
                requests: count("requests", w.requests, MAX_REQUESTS)?,
                prefill_tokens: count("prefill_tokens", w.prefill_tokens, MAX_TOKENS)?,
                decode_tokens: count("decode_tokens", w.decode_tokens, MAX_TOKENS)?,
            };
            loads.push((WorkerId(w.worker), counts));
            if let (Some(p), Some(r)) = (w.predicted_cached_tokens, w.routed_prompt_tokens) {
                if p > r {
                    return Err(LoadError::PredictedOverRouted {
                        worker: w.worker,
                        predicted: p,
                        routed: r,
                    });
                }
                truth.push((WorkerId(w.worker), p, r));
            }
        }
        if report.held.len() > MAX_HELD_PER_REPORT {
            return Err(LoadError::TooManyHeld(report.held.len()));
        }
        for (index, h) in report.held.iter().enumerate() {
            let what = if h.blocks == 0 {
                "blocks is 0"
            } else if h.ttl_ms > MAX_HELD_TTL_MS {
                "ttl_ms over 60000"
            } else {
                continue;
            };
            return Err(LoadError::Held { index, what });
        }
        let held_from = match self.gateways.get(&id) {
            Some(g) => g.held_from,
            None if self.gateways.len() >= self.config.max_gateways => {
                return Err(LoadError::TooManyGateways {
                    max: self.config.max_gateways,
                })
            }
            // A new gateway is handed what is still live.
            None => 0,
        };
        let source = match report.relayed_epoch {
            Some(epoch) => crate::truth::Source { epoch, own: false },
            None => crate::truth::Source { epoch, own: true },
        };
        self.truth.note_report(id.as_str(), source, &truth, now);
        // A decision for a worker gone since is dropped, not refused: it raced the
        // unregistration, and the report's load must not be lost for it.
        for h in report.held.iter().filter(|h| is_worker(WorkerId(h.worker))) {
            self.held.push_back(Held {
                seq: self.next_held,
                from: id.clone(),
                worker: WorkerId(h.worker),
                shard: h.shard,
                key: h.key,
                blocks: h.blocks,
                expires: now + Duration::from_millis(h.ttl_ms.into()),
            });
            self.next_held += 1;
        }
        while self.held.len() > MAX_HELD {
            self.held.pop_front();
        }
        self.gateways.insert(
            id,
            GatewayLoad {
                at: now,
                loads,
                held_from,
            },
        );
        Ok(())
    }

    /// The other gateways' decisions `reader` has not been handed yet and that are still
    /// live, each once: the next call hands only newer ones. Nothing for a reader that has
    /// not reported (the collector keeps no place for it).
    pub fn holds_for(&mut self, reader: &GatewayId, now: Instant) -> Vec<HeldFor> {
        // Entries expire in about arrival order (one time-to-live per gateway).
        while self.held.front().is_some_and(|h| h.expires <= now) {
            self.held.pop_front();
        }
        let next = self.next_held;
        let Some(g) = self.gateways.get_mut(reader) else {
            return Vec::new();
        };
        let from = std::mem::replace(&mut g.held_from, next);
        let start = self.held.partition_point(|h| h.seq < from);
        self.held
            .range(start..)
            .filter(|h| h.from != *reader && h.expires > now)
            .map(|h| HeldFor {
                worker: h.worker,
                shard: h.shard,
                key: h.key,
                blocks: h.blocks,
                ttl_ms: h
                    .expires
                    .saturating_duration_since(now)
                    .as_millis()
                    .min(u32::MAX.into()) as u32,
            })
            .collect()
    }

    /// Drops the gateways silent for longer than the timeout; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.gateways.len();
        let timeout = self.config.gateway_timeout;
        self.gateways
            .retain(|_, g| now.saturating_duration_since(g.at) <= timeout);
        before - self.gateways.len()
    }

    /// Gateways whose report is live at `now`.
    pub fn gateways(&self, now: Instant) -> usize {
        self.gateways.values().filter(|g| self.live(g, now)).count()
    }

    /// Every gateway whose report is live at `now`, with the age of that report, by id.
    pub fn gateway_ages(&self, now: Instant) -> Vec<(GatewayId, Duration)> {
        let mut out: Vec<(GatewayId, Duration)> = self
            .gateways
            .iter()
            .filter(|(_, g)| self.live(g, now))
            .map(|(id, g)| (id.clone(), now.saturating_duration_since(g.at)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `reader`'s place among the live gateways and itself, ids in byte order:
    /// `(index, count)`.
    pub fn replica_of(&self, reader: &GatewayId, now: Instant) -> (usize, usize) {
        let mut ids: Vec<&GatewayId> = self
            .gateways
            .iter()
            .filter(|(id, g)| *id != reader && self.live(g, now))
            .map(|(id, _)| id)
            .collect();
        ids.push(reader);
        ids.sort();
        let index = ids.iter().position(|id| *id == reader).unwrap_or(0);
        (index, ids.len())
    }

    fn live(&self, g: &GatewayLoad, now: Instant) -> bool {
        now.saturating_duration_since(g.at) <= self.config.gateway_timeout
    }

    /// Forgets unregistered workers: their entries in every report and their engine sample.
    pub fn forget_workers(&mut self, ids: &[WorkerId]) {
        if ids.is_empty() {
            return;
        }
        for g in self.gateways.values_mut() {
            g.loads.retain(|(w, _)| !ids.contains(w));
        }
        for id in ids {
            self.engines.remove(id);
        }
        self.held.retain(|h| !ids.contains(&h.worker));
        self.truth.forget_workers(ids);
    }

    /// Records an engine sample for a worker.
    pub fn set_engine(&mut self, worker: WorkerId, sample: EngineSample) {
        self.engines.insert(worker, sample);
    }

    /// A worker's engine sample as of `now`.
    pub fn engine(&self, worker: WorkerId, now: Instant) -> Option<EngineReading> {
        self.engines.get(&worker).map(|s| {
            let age = now.saturating_duration_since(s.at);
            EngineReading {
                sample: *s,
                age,
                stale: age > self.config.engine_stale,
            }
        })
    }

    /// Fleet-wide load per worker at `now`, by worker id: every worker some live gateway
    /// reported or the scraper sampled. Gateways past the timeout count for nothing even before
    /// [`Fleet::expire`] removes them, so this needs only `&self`.
    pub fn totals(&self, now: Instant) -> Vec<WorkerLoad> {
        self.totals_for(now, None)
    }

    /// [`Fleet::totals`] as one gateway should read them: without its own report. A gateway
    /// adds its live books to what the others reported; subtracting its own last report from
    /// a sum that may hold an older one would show load it has already released (or hide
    /// load it has just taken) until the next page.
    pub fn totals_for(&self, now: Instant, reader: Option<&GatewayId>) -> Vec<WorkerLoad> {
        let mut sums: BTreeMap<WorkerId, LoadCounts> = BTreeMap::new();
        for (id, g) in self.gateways.iter().filter(|(_, g)| self.live(g, now)) {
            let own = Some(id) == reader;
            for (w, c) in &g.loads {
                let sum = sums.entry(*w).or_default();
                // The reader's workers are listed (at the others' load) but not its counts.
                if !own {
                    sum.add(c);
                }
            }
        }
        for w in self.engines.keys() {
            sums.entry(*w).or_default();
        }
        sums.into_iter()
            .map(|(worker, load)| WorkerLoad {
                worker,
                load,
                engine: self.engine(worker, now),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_gets_the_totals_of_the_other_gateways() {
        let mut f = Fleet::new(FleetConfig::default());
        let t = Instant::now();
        f.report(&report("a", 1, &[(1, 2, 100, 10)]), 1, known, 4, t)
            .unwrap();
        f.report(
            &report("b", 1, &[(1, 3, 300, 30), (2, 1, 50, 5)]),
            1,
            known,
            4,
            t,
        )
        .unwrap();
        let load = |v: &[WorkerLoad], w: u32| {
            v.iter()
                .find(|l| l.worker == WorkerId(w))
                .map(|l| (l.load.requests, l.load.prefill_tokens))
        };
        let all = f.totals(t);
        assert_eq!(load(&all, 1), Some((5, 400)));
        let for_a = f.totals_for(t, Some(&GatewayId::new("a").unwrap()));
        assert_eq!(load(&for_a, 1), Some((3, 300)));
        assert_eq!(load(&for_a, 2), Some((1, 50)));
        let for_b = f.totals_for(t, Some(&GatewayId::new("b").unwrap()));
        assert_eq!(load(&for_b, 1), Some((2, 100)));
        // A worker only the reader loads is still listed, at zero.
        assert_eq!(load(&for_b, 2), Some((0, 0)));
        // An unknown reader reads everything.
        assert_eq!(f.totals_for(t, Some(&GatewayId::new("c").unwrap())), all);
    }

    fn report(gw: &str, epoch: u64, entries: &[(u32, i64, i64, i64)]) -> LoadReport {
        LoadReport {
            gateway: gw.into(),
            epoch,
            workers: entries
                .iter()
                .map(
                    |&(worker, requests, prefill_tokens, decode_tokens)| WorkerReport {
                        worker,
                        requests,
                        prefill_tokens,
                        decode_tokens,
                        predicted_cached_tokens: None,
                        routed_prompt_tokens: None,
                    },
                )
                .collect(),
            no_model: Default::default(),
            version: None,
            contract: None,
            feed_lag_ms: None,
            text: None,
            held: Vec::new(),
            relayed_epoch: None,
        }
    }

    fn known(w: WorkerId) -> bool {
        w.0 < 4
    }

    fn held(worker: u32, key: u64, ttl_ms: u32) -> HeldReport {
        HeldReport {
            worker,
            shard: 1,
            key,
            blocks: 2,
            ttl_ms,
        }
    }

    #[test]
    fn each_gateway_is_handed_the_others_decisions_once() {
        let mut f = Fleet::new(FleetConfig::default());
        let t = Instant::now();
        let (a, b, c) = (
            GatewayId::new("a").unwrap(),
            GatewayId::new("b").unwrap(),
            GatewayId::new("c").unwrap(),
        );
        let with = |gw: &str, held: Vec<HeldReport>| LoadReport {
            held,
            ..report(gw, 1, &[])
        };
        f.report(&with("b", vec![]), 1, known, 4, t).unwrap();
        f.report(
            &with("a", vec![held(1, 10, 1000), held(2, 11, 100)]),
            1,
            known,
            4,
            t,
        )
        .unwrap();
        // Never its own; a reader that has not reported gets nothing.
        assert!(f.holds_for(&a, t).is_empty());
        assert!(f.holds_for(&c, t).is_empty());
        let ms = Duration::from_millis;
        let got = f.holds_for(&b, t + ms(50));
        assert_eq!(
            got.iter()
                .map(|h| (h.worker, h.key, h.ttl_ms))
                .collect::<Vec<_>>(),
            [(WorkerId(1), 10, 950), (WorkerId(2), 11, 50)]
        );
        assert!(f.holds_for(&b, t + ms(60)).is_empty(), "handed once");
        f.report(&with("a", vec![held(3, 12, 1000)]), 1, known, 4, t + ms(70))
            .unwrap();
        // b's report keeps its place; an expired entry is not handed.
        f.report(&with("b", vec![]), 1, known, 4, t + ms(80))
            .unwrap();
        let got = f.holds_for(&b, t + ms(200));
        assert_eq!(got.iter().map(|h| h.key).collect::<Vec<_>>(), [12]);
        // A gateway that starts reporting now gets what is still live; an unregistered
        // worker's entries are gone.
        f.forget_workers(&[WorkerId(3)]);
        f.report(&with("c", vec![]), 1, known, 4, t + ms(210))
            .unwrap();
        let got = f.holds_for(&c, t + ms(220));
        assert_eq!(got.iter().map(|h| h.key).collect::<Vec<_>>(), [10]);
    }

    #[test]
    fn bad_held_entries_refuse_the_report() {
        let mut f = Fleet::new(FleetConfig::default());
        let t = Instant::now();
        let with = |held: Vec<HeldReport>| LoadReport {
            held,
            ..report("a", 1, &[(1, 1, 1, 1)])
        };
        let err = |held| f_report(&mut Fleet::new(FleetConfig::default()), with(held), t);
        assert_eq!(
            err(vec![held(1, 1, 10), held(1, 2, 60_001)]).unwrap_err(),
            LoadError::Held {
                index: 1,
                what: "ttl_ms over 60000"
            }
        );
        let zero = HeldReport {
            blocks: 0,
            ..held(1, 1, 10)
        };
        assert_eq!(err(vec![zero]).unwrap_err().reason(), "held");
        let many = vec![held(1, 1, 10); MAX_HELD_PER_REPORT + 1];
        assert_eq!(
            err(many).unwrap_err(),
            LoadError::TooManyHeld(MAX_HELD_PER_REPORT + 1)
        );
        // Nothing of a refused report is kept.
        assert!(f_report(&mut f, with(vec![held(1, 1, 60_001)]), t).is_err());
        assert_eq!(f.gateways(t), 0);
        // A decision for a worker no longer registered is dropped; the report stands.
        f_report(&mut f, with(vec![held(9, 1, 10), held(2, 3, 10)]), t).unwrap();
        f.report(&report("b", 1, &[]), 1, known, 4, t).unwrap();
        let got = f.holds_for(&GatewayId::new("b").unwrap(), t);
        assert_eq!(got.iter().map(|h| h.key).collect::<Vec<_>>(), [3]);
    }

    fn f_report(f: &mut Fleet, r: LoadReport, t: Instant) -> Result<(), LoadError> {
        f.report(&r, 1, known, 4, t)
    }

    #[test]
    fn reports_sum_across_gateways_and_replace_per_gateway() {
        let mut f = Fleet::new(FleetConfig::default());
        let t = Instant::now();
        f.report(&report("a", 7, &[(0, 2, 100, 10)]), 7, known, 4, t)
            .unwrap();
        f.report(
            &report("b", 7, &[(0, 3, 50, 5), (1, 1, 1, 1)]),
            7,
            known,
            4,
            t,
        )
        .unwrap();
        f.report(&report("a", 7, &[(0, 1, 10, 1)]), 7, known, 4, t)
            .unwrap();
        let tot = f.totals(t);
        assert_eq!(tot.len(), 2);
        assert_eq!(
            tot[0].load,
            LoadCounts {
                requests: 4,
                prefill_tokens: 60,
                decode_tokens: 6
            }
        );
        assert_eq!(tot[1].load.requests, 1);
    }

    #[test]
    fn silent_gateways_expire() {
        let mut f = Fleet::new(FleetConfig {
            gateway_timeout: Duration::from_secs(1),
            ..FleetConfig::default()
        });
        let t = Instant::now();
        f.report(&report("a", 1, &[(0, 2, 0, 0)]), 1, known, 4, t)
            .unwrap();
        let later = t + Duration::from_millis(1500);
        assert_eq!(f.gateways(later), 0);
        assert!(f.totals(later).is_empty());
        assert_eq!(f.expire(later), 1);
    }

    #[test]
    fn replicas_are_numbered_by_id_among_the_live_ones() {
        let mut f = Fleet::new(FleetConfig {
            gateway_timeout: Duration::from_secs(1),
            ..FleetConfig::default()
        });
        let t = Instant::now();
        let id = |s: &str| GatewayId::new(s).unwrap();
        assert_eq!(f.replica_of(&id("b"), t), (0, 1), "alone before any report");
        for g in ["c", "a"] {
            f.report(&report(g, 1, &[]), 1, known, 4, t).unwrap();
        }
        assert_eq!(
            f.replica_of(&id("b"), t),
            (1, 3),
            "counted before its first report"
        );
        f.report(&report("b", 1, &[]), 1, known, 4, t).unwrap();
        assert_eq!(f.replica_of(&id("b"), t), (1, 3));
        assert_eq!(f.replica_of(&id("c"), t), (2, 3));
        // b keeps reporting, a and c fall silent.
        let later = t + Duration::from_millis(1500);
        f.report(&report("b", 1, &[]), 1, known, 4, later).unwrap();
        assert_eq!(f.replica_of(&id("b"), later), (0, 1));
    }

    #[test]
    fn bad_reports_change_nothing() {
        let mut f = Fleet::new(FleetConfig {
            max_gateways: 1,
            ..FleetConfig::default()
        });
        let t = Instant::now();
        f.report(&report("a", 1, &[(0, 2, 0, 0)]), 1, known, 4, t)
            .unwrap();
        let cases = [
            (report("", 1, &[]), "gateway_id"),
            (report(&"x".repeat(129), 1, &[]), "gateway_id"),
            (report("a", 2, &[]), "epoch"),
            (report("a", 1, &[(9, 1, 0, 0)]), "unknown_worker"),
            (
                report("a", 1, &[(0, 1, 0, 0), (0, 1, 0, 0)]),
                "duplicate_worker",
            ),
            (report("a", 1, &[(0, -1, 0, 0)]), "negative"),
            (report("a", 1, &[(0, 0, MAX_TOKENS + 1, 0)]), "absurd"),
            (report("a", 1, &[(0, 0, 0, 0); 5]), "too_many_entries"),
            (report("b", 1, &[]), "too_many_gateways"),
        ];
        for (r, reason) in cases {
            let e = f.report(&r, 1, known, 4, t).unwrap_err();
            assert_eq!(e.reason(), reason, "{e}");
            assert_eq!(f.totals(t)[0].load.requests, 2);
        }
    }

    #[test]
    fn engine_samples_go_stale_and_go_away_with_their_worker() {
        let mut f = Fleet::new(FleetConfig::default());
        let t = Instant::now();
        f.set_engine(
            WorkerId(3),
            EngineSample {
                load: EngineLoad {
                    waiting: 5,
                    running: 2,
                    kv_permille: 500,
                },
                at: t,
            },
        );
        assert!(!f.engine(WorkerId(3), t).unwrap().stale);
        assert!(
            f.engine(WorkerId(3), t + Duration::from_secs(3))
                .unwrap()
                .stale
        );
        assert_eq!(f.totals(t)[0].worker, WorkerId(3));
        f.forget_workers(&[WorkerId(3)]);
        assert!(f.totals(t).is_empty());
    }
}
