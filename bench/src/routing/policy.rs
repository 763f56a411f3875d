//! The in-process routing policies of the bench: round-robin, least-request, kvroute (the
//! real collector's `/query` answer + the shipped decision, [`router::route`]), the oracle (the same
//! decision on every engine's exact cache contents), longest-prefix-only (the collector's
//! answer, deepest match wins whatever the queue, as vllm-router's `kv_aware` does), and
//! [`Alternate`], which spreads requests over gateway replicas (the shipped path).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kvroute::api::QueryResponse;
use kvroute::event::WorkerId;
use kvroute::lookup::WorkerMatch;
use kvroute::mirror::{self, Keys, LoadDelta, LoadId, MemStore, Meta, WorkerSlot};
use kvroute::router::{
    self, rank_by, Booked, Books, Field, Picture, PictureConfig, Policy, Query, RankRule, Roster,
    Verdict,
};
use kvroute::select::{self, Candidate, SplitMix64};
use serde_json::json;

use kvroute_sim::engine::Engine;
use kvroute_sim::replay::{BoxFuture, Decision, Route, RouteRequest};

/// One engine as the routers see it.
#[derive(Clone, Debug)]
pub struct Slot {
    pub url: String,
    /// The engine's instance id (as registered with the collector).
    pub instance_id: String,
}

/// Load the router itself has in flight per engine (what a gateway can count), kept in the
/// core's load table as the filter keeps it: requests, booked prefill released at the first
/// token, and the prefill backlog drained at a rate learned from requests that found their
/// engine idle.
#[derive(Debug)]
struct Load {
    table: Mutex<Vec<u8>>,
    capacity: u32,
    start: Instant,
}

/// Longer than any benchmark run: the in-process books never leak.
const LOAD_TTL_MS: u64 = 24 * 3600 * 1000;

impl Load {
    fn new(n: usize) -> Load {
        Load {
            table: Mutex::new(Vec::new()),
            capacity: n.max(1) as u32,
            start: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn get(&self, slot: usize) -> mirror::Load {
        let t = self.table.lock().expect("load table");
        mirror::load_get(&t, LoadId::slot(slot as u32), self.now_ms(), LOAD_TTL_MS)
    }

    /// Applies `delta` to `slot`; returns the time and the load just before.
    fn change(&self, slot: usize, delta: LoadDelta) -> (u64, mirror::Load) {
        let mut t = self.table.lock().expect("load table");
        let (id, now) = (LoadId::slot(slot as u32), self.now_ms());
        let before = mirror::load_get(&t, id, now, LOAD_TTL_MS);
        mirror::load_add(&mut t, self.capacity, id, delta, now, LOAD_TTL_MS);
        (now, before)
    }

    /// Books a request; returns when, and whether the engine's prefill was idle.
    fn add(&self, slot: usize, uncached: usize) -> (u64, bool) {
        let (now, before) = self.change(
            slot,
            LoadDelta {
                requests: 1,
                prefill_tokens: uncached as i64,
                ..LoadDelta::default()
            },
        );
        (now, before.backlog == 0)
    }

    fn done(&self, slot: usize) {
        self.change(
            slot,
            LoadDelta {
                requests: -1,
                ..LoadDelta::default()
            },
        );
    }
}

/// Round-robin over the engines.
#[derive(Debug)]
pub struct RoundRobin {
    slots: Vec<Slot>,
    next: AtomicUsize,
}

impl RoundRobin {
    pub fn new(slots: Vec<Slot>) -> RoundRobin {
        RoundRobin {
            slots,
            next: AtomicUsize::new(0),
        }
    }
}

impl Route for RoundRobin {
    fn route<'a>(&'a self, _req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let d = Decision {
            url: self.slots[slot].url.clone(),
            dp_rank: None,
            slot,
            uncached_tokens: 0,
            ..Decision::default()
        };
        Box::pin(async move { d })
    }
}

/// Fewest requests in flight; random among ties.
#[derive(Debug)]
pub struct LeastRequest {
    slots: Vec<Slot>,
    load: Load,
    rng: Mutex<SplitMix64>,
}

impl LeastRequest {
    pub fn new(slots: Vec<Slot>, seed: u64) -> LeastRequest {
        let n = slots.len();
        LeastRequest {
            slots,
            load: Load::new(n),
            rng: Mutex::new(SplitMix64(seed)),
        }
    }
}

impl Route for LeastRequest {
    fn route<'a>(&'a self, _req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        let loads: Vec<u32> = (0..self.slots.len())
            .map(|i| self.load.get(i).requests)
            .collect();
        let min = loads.iter().copied().min().unwrap_or(0);
        let ties: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] == min).collect();
        let r = select::Random::next_u64(&mut *self.rng.lock().expect("rng"));
        let slot = ties[(r % ties.len() as u64) as usize];
        self.load.add(slot, 0);
        let d = Decision {
            url: self.slots[slot].url.clone(),
            dp_rank: None,
            slot,
            uncached_tokens: 0,
            ..Decision::default()
        };
        Box::pin(async move { d })
    }
    fn on_done(&self, d: &Decision) {
        self.load.done(d.slot);
    }
}

/// How the KV-aware router chooses among engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The shipped decision (`router::route`): cache credit against queued prefill.
    Cost,
    /// The deepest match wins, ties by fewest requests in flight; no match anywhere → fewest
    /// requests in flight. Load never outweighs a longer match.
    LongestPrefix,
}

/// Where the KV-aware router learns what each engine caches.
#[derive(Debug)]
pub enum MatchSource {
    /// The real kvroute collector, asked `POST /query` per request (the filter's remote mode).
    Collector {
        client: reqwest::Client,
        url: String,
        model: String,
    },
    /// Every engine's cache, read exactly (in-process).
    Oracle { engines: Vec<Engine> },
}

/// The shipped decision in process: the roster of the bench's engines, the router's books in
/// a [`MemStore`] (the filter keeps the same table in Envoy's shared data), and
/// [`router::route`] — the entry the filter calls — over them.
#[derive(Debug)]
struct InProc {
    store: MemStore,
    keys: Keys,
    roster: Roster,
}

/// Picture and books of the in-process router: the filter's defaults.
const PICTURE: PictureConfig = PictureConfig {
    fresh_ms: LOAD_TTL_MS,
    load_ttl_ms: LOAD_TTL_MS,
    fleet_counts: false,
};

impl InProc {
    fn new(slots: &[Slot]) -> InProc {
        let meta = Meta {
            workers: slots
                .iter()
                .map(|s| {
                    Some(WorkerSlot {
                        live: true,
                        dp_rank: 0,
                        instance_id: s.instance_id.clone(),
                        address: s.url.clone(),
                        tenant: String::new(),
                        model: String::new(),
                    })
                })
                .collect(),
            ..Meta::default()
        };
        InProc {
            store: MemStore::new(),
            keys: Keys::new("bench"),
            roster: Roster::from_meta(&meta),
        }
    }

    fn books(&self) -> Books<'_, MemStore> {
        Books {
            store: &self.store,
            keys: &self.keys,
            capacity: self.roster.instances.len().max(1) as u32,
            ttl_ms: LOAD_TTL_MS,
            prefill_rate: None,
        }
    }

    fn picture(&self, now: u64) -> Picture {
        Picture::read(&self.store, &self.keys, PICTURE, now)
    }
}

/// KV-aware routing: per-engine prefix matches (from `source`) and the router's own in-flight
/// load. [`Choice::Cost`] is the shipped policy through [`router::route`] (cold requests,
/// saturation, the hot-spot guard and all); [`Choice::LongestPrefix`] the deepest match.
#[derive(Debug)]
pub struct KvAware {
    slots: Vec<Slot>,
    source: MatchSource,
    block_size: u32,
    policy: Policy,
    choice: Choice,
    inproc: Mutex<InProc>,
    start: Instant,
    rng: Mutex<SplitMix64>,
    /// Query failures (the request then falls back).
    pub query_errors: AtomicU64,
}

impl KvAware {
    pub fn new(slots: Vec<Slot>, source: MatchSource, block_size: u32, seed: u64) -> KvAware {
        KvAware {
            inproc: Mutex::new(InProc::new(&slots)),
            slots,
            source,
            block_size,
            policy: Policy::default(),
            choice: Choice::Cost,
            start: Instant::now(),
            rng: Mutex::new(SplitMix64(seed)),
            query_errors: AtomicU64::new(0),
        }
    }

    /// The same router deciding by `choice`.
    pub fn with_choice(mut self, choice: Choice) -> KvAware {
        self.choice = choice;
        self
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Matched blocks per worker slot (= engine), and the dp rank holding them per engine.
    async fn matches(&self, tokens: &[u32], roster: &Roster) -> (Vec<WorkerMatch>, Vec<u32>) {
        let bs = self.block_size.max(1) as u64;
        match &self.source {
            MatchSource::Oracle { engines } => engines
                .iter()
                .enumerate()
                .map(|(slot, e)| {
                    let per_rank = e.cached_prefix_tokens(tokens);
                    let (blocks, rank) = select::fold_ranks(
                        per_rank
                            .iter()
                            .enumerate()
                            .map(|(r, &t)| (r as u32, [(t as u64 / bs) as u32; 3])),
                        &self.policy.weights,
                    );
                    let m = WorkerMatch {
                        worker: WorkerId(slot as u32),
                        blocks,
                    };
                    (m, rank)
                })
                .unzip(),
            MatchSource::Collector { client, url, model } => {
                let resp = client
                    .post(format!("{url}/query"))
                    .json(&json!({"token_ids": tokens, "model_name": model}))
                    .send()
                    .await;
                let parsed = match resp {
                    Ok(r) if r.status().is_success() => r.json::<QueryResponse>().await.ok(),
                    _ => None,
                };
                let Some(answer) = parsed else {
                    self.query_errors.fetch_add(1, Ordering::Relaxed);
                    return (Vec::new(), vec![0; self.slots.len()]);
                };
                // The rank that holds the match, per engine, as the filter's remote mode reads it.
                let ranks = self
                    .slots
                    .iter()
                    .map(|s| {
                        answer.instances.get(&s.instance_id).map_or(0, |m| {
                            rank_by(
                                RankRule::MostTokens,
                                m.dp.iter()
                                    .filter_map(|(r, t)| r.parse::<u32>().ok().map(|r| (r, *t))),
                            )
                        })
                    })
                    .collect();
                (
                    router::answer_on_roster(&answer, roster).unwrap_or_default(),
                    ranks,
                )
            }
        }
    }
}

impl Route for KvAware {
    fn route<'a>(&'a self, req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        Box::pin(async move {
            let roster = self.inproc.lock().expect("router").roster.clone();
            let (matches, ranks) = self.matches(req.tokens, &roster).await;
            let query = Query {
                blocks: (req.tokens.len() / self.block_size.max(1) as usize) as u32,
                block_size: self.block_size.max(1),
            };
            let inproc = self.inproc.lock().expect("router");
            let now = self.now_ms();
            let picture = inproc.picture(now);
            let (slot, matched_blocks, idle) = if self.choice == Choice::LongestPrefix {
                let candidates: Vec<Candidate> = (0..self.slots.len())
                    .map(|i| {
                        let l = picture.load(LoadId::slot(i as u32));
                        Candidate {
                            matched: matches
                                .iter()
                                .find(|m| m.worker.0 as usize == i)
                                .map_or([0; 3], |m| m.blocks),
                            dp_rank: 0,
                            in_flight_requests: l.requests,
                            in_flight_prefill_tokens: l.prefill_tokens,
                        }
                    })
                    .collect();
                let slot = longest_prefix(&candidates, &mut self.rng.lock().expect("rng"));
                let c = &candidates[slot];
                (slot, c.matched[2], c.in_flight_prefill_tokens == 0)
            } else {
                let field = Field::Roster {
                    roster: &roster,
                    matches: &matches,
                    tenant: "",
                    model: "",
                };
                let mut rng = self.rng.lock().expect("rng");
                match router::route(field, query, &picture, &self.policy, &mut *rng).verdict {
                    Verdict::Route { decision, target } => (
                        target.slot().unwrap_or(0) as usize,
                        decision.matched_blocks,
                        decision.queued_prefill_tokens == 0,
                    ),
                    // Every engine serves the bench's model: never reached; the first engine.
                    Verdict::Deferred | Verdict::NoMatch => (0, 0, false),
                }
            };
            let matched_tokens = matched_blocks as usize * self.block_size as usize;
            let uncached = req.tokens.len().saturating_sub(matched_tokens);
            let prefill = uncached.min(u32::MAX as usize) as u32;
            let booked = inproc
                .books()
                .book(picture, LoadId::slot(slot as u32), prefill, 0, idle);
            drop(inproc);
            Decision {
                url: self.slots[slot].url.clone(),
                dp_rank: Some(ranks.get(slot).copied().unwrap_or(0)),
                slot,
                uncached_tokens: uncached,
                booked_at_ms: booked.map_or(now, |b| b.at_ms),
                idle,
            }
        })
    }
    fn on_first_token(&self, d: &Decision) {
        let mut b = booked(d, true);
        let inproc = self.inproc.lock().expect("router");
        let _ = inproc.books().release_prefill(&mut b, self.now_ms());
    }
    fn on_done(&self, d: &Decision) {
        let inproc = self.inproc.lock().expect("router");
        let _ = inproc.books().release(booked(d, false), self.now_ms());
    }
}

/// The booking of `d` as the router made it; `prefill_open`: its prefill is still booked.
fn booked(d: &Decision, prefill_open: bool) -> Booked {
    Booked {
        id: LoadId::slot(d.slot as u32),
        prefill: d.uncached_tokens.min(u32::MAX as usize) as u32,
        decode: 0,
        prefill_open,
        at_ms: d.booked_at_ms,
        measures_rate: d.idle,
    }
}

/// The deepest match (any tier), then the fewest requests in flight, then random.
fn longest_prefix(c: &[Candidate], rng: &mut SplitMix64) -> usize {
    let key = |c: &Candidate| (c.matched[2], std::cmp::Reverse(c.in_flight_requests));
    let best = c.iter().map(key).max().unwrap_or((0, std::cmp::Reverse(0)));
    let ties: Vec<usize> = (0..c.len()).filter(|&i| key(&c[i]) == best).collect();
    ties[(select::Random::next_u64(rng) % ties.len().max(1) as u64) as usize]
}

/// Spreads requests over gateway replicas in turn (requests alternate between them); the
/// gateways decide the engine.
#[derive(Debug)]
pub struct Alternate {
    urls: Vec<String>,
    next: AtomicUsize,
}

impl Alternate {
    pub fn new(urls: Vec<String>) -> Alternate {
        Alternate {
            urls,
            next: AtomicUsize::new(0),
        }
    }
}

impl Route for Alternate {
    fn route<'a>(&'a self, _req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.urls.len().max(1);
        let d = Decision {
            url: self.urls.get(i).cloned().unwrap_or_default(),
            dp_rank: None,
            slot: i,
            uncached_tokens: 0,
            ..Decision::default()
        };
        Box::pin(async move { d })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(n: usize) -> Vec<Slot> {
        (0..n)
            .map(|i| Slot {
                url: format!("http://e{i}"),
                instance_id: format!("e{i}"),
            })
            .collect()
    }

    #[test]
    fn longest_prefix_ignores_load_and_breaks_ties_by_requests() {
        let c = [
            Candidate {
                matched: [2, 2, 2],
                in_flight_requests: 0,
                ..Candidate::default()
            },
            Candidate {
                matched: [8, 8, 8],
                in_flight_requests: 50,
                in_flight_prefill_tokens: 1 << 20,
                ..Candidate::default()
            },
            Candidate {
                matched: [8, 8, 8],
                in_flight_requests: 60,
                ..Candidate::default()
            },
        ];
        assert_eq!(longest_prefix(&c, &mut SplitMix64(1)), 1);
        let cold = [
            Candidate {
                in_flight_requests: 3,
                ..Candidate::default()
            },
            Candidate {
                in_flight_requests: 1,
                ..Candidate::default()
            },
        ];
        assert_eq!(longest_prefix(&cold, &mut SplitMix64(1)), 1);
    }

    #[tokio::test]
    async fn alternate_takes_the_gateways_in_turn() {
        let a = Alternate::new(vec!["http://g0".into(), "http://g1".into()]);
        let mut urls = Vec::new();
        for i in 0..4 {
            urls.push(
                a.route(RouteRequest {
                    index: i,
                    tokens: &[],
                })
                .await
                .url,
            );
        }
        assert_eq!(urls, ["http://g0", "http://g1", "http://g0", "http://g1"]);
    }

    #[tokio::test]
    async fn least_request_balances_in_flight_requests() {
        let lr = LeastRequest::new(slots(3), 1);
        let mut ds = Vec::new();
        for i in 0..6 {
            ds.push(
                lr.route(RouteRequest {
                    index: i,
                    tokens: &[],
                })
                .await,
            );
        }
        let mut per = [0; 3];
        for d in &ds {
            per[d.slot] += 1;
        }
        assert_eq!(per, [2, 2, 2]);
        lr.on_done(&ds[0]);
        let next = lr
            .route(RouteRequest {
                index: 6,
                tokens: &[],
            })
            .await;
        assert_eq!(next.slot, ds[0].slot);
    }
}
