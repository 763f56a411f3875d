//! The in-process routing policies of the bench: round-robin, least-request, kvroute (the
//! real collector's `/query` answer + the core's `select::pick`), the oracle (the same
//! decision on every engine's exact cache contents), longest-prefix-only (the collector's
//! answer, deepest match wins whatever the queue, as vllm-router's `kv_aware` does), and
//! [`Alternate`], which spreads requests over gateway replicas (the shipped path).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kvroute::mirror::{self, LoadDelta, LoadId, RateNote};
use kvroute::select::{self, Candidate, SplitMix64, Weights};
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

    fn first_token(&self, d: &Decision) {
        let sample = d.idle.then(|| {
            mirror::rate_sample(
                d.uncached_tokens.min(u32::MAX as usize) as u32,
                self.now_ms().saturating_sub(d.booked_at_ms),
            )
        });
        self.change(
            d.slot,
            LoadDelta {
                prefill_tokens: -(d.uncached_tokens as i64),
                rate: sample.flatten().map_or(RateNote::Keep, RateNote::Sample),
                ..LoadDelta::default()
            },
        );
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
    /// The core's cost (`select::pick`): cache credit against queued prefill.
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

/// KV-aware routing: per-engine prefix matches (from `source`) and the router's own in-flight
/// load, decided by the core's `select::pick`. When no engine holds a block of the prompt,
/// `pick` declines and the request goes to the engine with the least queued prefill work (the
/// same cost with no credit), as a least-loaded fallback balancer would.
#[derive(Debug)]
pub struct KvAware {
    slots: Vec<Slot>,
    source: MatchSource,
    block_size: u32,
    weights: Weights,
    choice: Choice,
    load: Load,
    rng: Mutex<SplitMix64>,
    /// Query failures (the request then falls back).
    pub query_errors: AtomicU64,
}

impl KvAware {
    pub fn new(slots: Vec<Slot>, source: MatchSource, block_size: u32, seed: u64) -> KvAware {
        let n = slots.len();
        KvAware {
            slots,
            source,
            block_size,
            weights: Weights::default(),
            choice: Choice::Cost,
            load: Load::new(n),
            rng: Mutex::new(SplitMix64(seed)),
            query_errors: AtomicU64::new(0),
        }
    }

    /// The same router deciding by `choice`.
    pub fn with_choice(mut self, choice: Choice) -> KvAware {
        self.choice = choice;
        self
    }

    /// Matched blocks `[gpu, cpu, disk]` and dp rank per slot.
    async fn matches(&self, tokens: &[u32]) -> Vec<([u32; 3], u32)> {
        let bs = self.block_size.max(1) as u64;
        match &self.source {
            MatchSource::Oracle { engines } => engines
                .iter()
                .map(|e| {
                    let per_rank = e.cached_prefix_tokens(tokens);
                    select::fold_ranks(
                        per_rank
                            .iter()
                            .enumerate()
                            .map(|(r, &t)| (r as u32, [(t as u64 / bs) as u32; 3])),
                        &self.weights,
                    )
                })
                .collect(),
            MatchSource::Collector { client, url, model } => {
                let mut out = vec![([0u32; 3], 0u32); self.slots.len()];
                let resp = client
                    .post(format!("{url}/query"))
                    .json(&json!({"token_ids": tokens, "model_name": model}))
                    .send()
                    .await;
                let parsed = match resp {
                    Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
                    _ => None,
                };
                let Some(v) = parsed else {
                    self.query_errors.fetch_add(1, Ordering::Relaxed);
                    return out;
                };
                let Some(instances) = v.get("instances").and_then(|i| i.as_object()) else {
                    return out;
                };
                for (i, slot) in self.slots.iter().enumerate() {
                    let Some(m) = instances.get(&slot.instance_id) else {
                        continue;
                    };
                    let tok = |k: &str| m.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                    let (gpu, cpu, disk) = (
                        tok("gpu"),
                        tok("cpu").max(tok("gpu")),
                        tok("disk").max(tok("longest_matched")),
                    );
                    let ranks: Vec<(u32, [u32; 3])> = m
                        .get("dp")
                        .and_then(|d| d.as_object())
                        .map(|d| {
                            d.iter()
                                .filter_map(|(r, t)| {
                                    Some((r.parse().ok()?, [(t.as_u64()? / bs) as u32; 3]))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let rank = if ranks.len() > 1 {
                        select::fold_ranks(ranks, &self.weights).1
                    } else {
                        ranks.first().map_or(0, |r| r.0)
                    };
                    out[i] = (
                        [(gpu / bs) as u32, (cpu / bs) as u32, (disk / bs) as u32],
                        rank,
                    );
                }
                out
            }
        }
    }
}

impl Route for KvAware {
    fn route<'a>(&'a self, req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        Box::pin(async move {
            let matches = self.matches(req.tokens).await;
            let query_blocks = (req.tokens.len() / self.block_size.max(1) as usize) as u32;
            let candidates: Vec<Candidate> = matches
                .iter()
                .enumerate()
                .map(|(i, (m, rank))| {
                    let l = self.load.get(i);
                    Candidate {
                        matched: *m,
                        dp_rank: *rank,
                        in_flight_requests: l.requests,
                        in_flight_prefill_tokens: l.backlog.into(),
                    }
                })
                .collect();
            let (slot, rank) = if self.choice == Choice::LongestPrefix {
                let mut rng = self.rng.lock().expect("rng");
                let slot = longest_prefix(&candidates, &mut rng);
                (slot, Some(matches[slot].1))
            } else {
                let mut rng = self.rng.lock().expect("rng");
                match select::pick(
                    &candidates,
                    query_blocks,
                    self.block_size,
                    &self.weights,
                    &mut *rng,
                ) {
                    Some(c) => (c.best, Some(c.dp_rank)),
                    None => {
                        let unmatched: Vec<Candidate> = candidates
                            .iter()
                            .map(|c| Candidate {
                                matched: [0; 3],
                                ..*c
                            })
                            .collect();
                        (
                            least_cost(
                                &unmatched,
                                query_blocks,
                                self.block_size,
                                &self.weights,
                                &mut rng,
                            ),
                            None,
                        )
                    }
                }
            };
            let matched_tokens = matches[slot].0[2] as usize * self.block_size as usize;
            let uncached = req.tokens.len().saturating_sub(matched_tokens);
            let (booked_at_ms, idle) = self.load.add(slot, uncached);
            Decision {
                url: self.slots[slot].url.clone(),
                dp_rank: rank,
                slot,
                uncached_tokens: uncached,
                booked_at_ms,
                idle,
            }
        })
    }
    fn on_first_token(&self, d: &Decision) {
        self.load.first_token(d);
    }
    fn on_done(&self, d: &Decision) {
        self.load.done(d.slot);
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

/// The cheapest candidate by `select::cost`, random among exact ties.
fn least_cost(
    c: &[Candidate],
    query_blocks: u32,
    block_size: u32,
    w: &Weights,
    rng: &mut SplitMix64,
) -> usize {
    let costs: Vec<f64> = c
        .iter()
        .map(|c| select::cost(c, query_blocks, block_size, w))
        .collect();
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..c.len()).filter(|&i| costs[i] == min).collect();
    ties[(select::Random::next_u64(rng) % ties.len() as u64) as usize]
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
    fn least_cost_prefers_less_queued_prefill() {
        let c = [
            Candidate {
                in_flight_prefill_tokens: 1000,
                ..Candidate::default()
            },
            Candidate {
                in_flight_prefill_tokens: 10,
                ..Candidate::default()
            },
        ];
        assert_eq!(
            least_cost(&c, 4, 16, &Weights::default(), &mut SplitMix64(1)),
            1
        );
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
