//! The routing decision: matches, instances and load in, a ranked choice out. Pure: no I/O,
//! no clock; the caller reads shared data (local mode) or the collector's `/query` answer
//! (remote mode) and hands over what it found.
//!
//! One policy for both modes:
//!
//! 1. **Fold dp ranks.** Each instance competes once, with its best dp rank: the rank with
//!    the most [`credit`](select::credit), the first one offered on a tie ([`Contender::offer`]).
//! 2. **Eligibility.** Only instances serving the request's `(tenant, model)` compete
//!    ([`Instance::serves`]); the others are kept in the slice so indices stay stable.
//! 3. **Cost and pick.** [`select::pick`] ranks the eligible ones by cost (cached blocks
//!    shrink the prefill work, in-flight load adds to it) and breaks exact ties with the
//!    caller's seeded random source; no match anywhere means no decision.
//!
//! Remote mode differs in one named place, [`RankRule`]: the collector reports matched
//! tokens per rank without tiers, so its rank is the one with the most tokens (the lowest on
//! a tie), and the instance's tiers come from its totals. Folding ranks by credit after
//! converting tokens to blocks would pick another rank when two ranks fall into the same
//! block count, so the rule is kept as it was.
//!
//! On top of the cost, [`Policy`] adds these rules:
//!
//! - **Cold requests are decided** ([`Cold::Decide`], the default): when no eligible instance
//!   holds a block of the query, the one with the least work ahead wins by the same cost
//!   (queued prefill + this request's prefill + the per-request term), so the load books see
//!   every request. [`Cold::Defer`] keeps the old behaviour: no decision, the gateway's own
//!   balancing picks.
//! - **Saturation** ([`Policy::saturated`]): an instance whose engine reports a waiting queue of
//!   `max_waiting` or more, or KV usage of `max_kv_usage` or more, competes only with a cache
//!   hit for this request while an unsaturated eligible instance exists. Without a hit it
//!   would only add to a queue the engine already cannot drain.
//! - **Hot-spot guard** ([`Policy::max_hit_queue_tokens`]): a hit buys at most that much queue.
//!   A contender whose queued prefill exceeds the least queued one's by more loses its cache
//!   credit and competes as if cold, so one popular prefix cannot bury its holder.
//!
//! - **Temperature** ([`Policy::temperature`], off by default): the winner is drawn among the
//!   contenders with odds that fall with their cost's distance from the cheapest, so gateway
//!   replicas deciding on the same slightly stale load do not all pick the same engine.
//! - **Replica affinity** ([`Policy::replica_tie_band`], [`Replica`]): with `n` gateway
//!   replicas, replica `i` breaks near-ties in favour of its own share (the `k`-th eligible
//!   instance in the shared instance order is replica `k mod n`'s). A replica learns of the
//!   others' bookings only through the collector, one or two sync periods late; on an idle or
//!   evenly loaded fleet every replica would see the same exact ties, and affinity makes them
//!   pick different engines. Engines tied on a hit stay a random pick. It is only a
//!   tie-breaker: the winner's cost is never more than
//!   the band above the cheapest contender's, so no replica count or share can send a request
//!   to a busier engine while a free one exists (the band is below one in-flight request's
//!   weight by default).
//!
//! The load a contender carries comes from [`fleet_view`] when the caller knows the fleet's
//! totals: what every gateway reported, minus this gateway's own last report (already in the
//! totals), plus its own current count (fresher than the report).

use crate::api::QueryResponse;
use crate::lookup::WorkerMatch;
pub use crate::mirror::{Counts, Replica};
use crate::mirror::{Load, LoadId, Meta};
use crate::select::{self, Candidate, Random, Weights};

/// What to do with a request no eligible instance holds a block of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cold {
    /// Route it to the least loaded eligible instance (and book its load).
    #[default]
    Decide,
    /// Leave it to the gateway's own balancing: no decision.
    Defer,
}

/// The decision's knobs beyond the cost weights (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// The cost weights.
    pub weights: Weights,
    /// Cold requests: decided or deferred.
    pub cold: Cold,
    /// An engine waiting queue this long or longer saturates it.
    pub max_waiting: u32,
    /// Engine KV usage (0.0 to 1.0) at which it is saturated.
    pub max_kv_usage: f32,
    /// Most queued prefill tokens above the least queued contender's that a cache hit may
    /// buy; past it the hit earns no credit. `None`: unbounded.
    pub max_hit_queue_tokens: Option<u64>,
    /// 0: the cheapest contender wins (seeded random among exact ties). Above 0: the winner
    /// is drawn with odds falling with its cost's distance from the cheapest, relative to it
    /// ([`select::sample`]): gateway replicas deciding on the same slightly stale load spread
    /// their picks.
    pub temperature: f64,
    /// Cost, in blocks, within which a contender of this replica's share is preferred to a
    /// cheaper one outside it (see the module docs); 0: no affinity.
    pub replica_tie_band: f64,
    /// Which gateway replica decides, out of how many (the collector's count of live ones).
    pub replica: Replica,
}

/// Default [`Policy::replica_tie_band`]: half a block of cost. Below the default weight of one
/// in-flight request (a block), so an engine with one more request than another never wins
/// by affinity; wide enough to catch the exact and float-rounding ties of an idle fleet.
/// What breaks it: a band of a block or more lets affinity send a cold prompt to an engine
/// with a request in flight while another is free — with an uneven traffic split between two
/// gateways (80/20), the busier gateway's share then queues while the other share idles.
pub const REPLICA_TIE_BAND: f64 = 0.5;

impl Default for Policy {
    fn default() -> Self {
        Policy {
            weights: Weights::default(),
            cold: Cold::Decide,
            max_waiting: 8,
            max_kv_usage: 0.98,
            // Unbounded: the cost already charges queued prefill. Measured with `make
            // bench-routing` on the shipped path (2,000 trace requests, 4 engines): a 4,096-token
            // bound cut the hit rate from 4.1 % to 2.4 % and raised TTFT p50 from 539 to 583 ms,
            // and in the hot-prefix burst gave p90 1.52 s against 1.07 s unbounded.
            max_hit_queue_tokens: None,
            temperature: 0.0,
            replica_tie_band: REPLICA_TIE_BAND,
            replica: Replica::default(),
        }
    }
}

impl Policy {
    /// Whether the engine's own report says it is saturated (no report: not saturated).
    pub fn saturated(&self, load: &InstanceLoad) -> bool {
        load.engine
            .is_some_and(|e| e.waiting >= self.max_waiting || e.kv_usage >= self.max_kv_usage)
    }
}

/// The load to decide on, from the fleet's `total`, this gateway's `reported` share of it and
/// its `current` books: `total − reported + current`, never below `current` (a total older
/// than our own report must not hide load we know of). When the collector leaves this
/// gateway's report out of `total` (feed `gateway=`), `reported` is zero: `others + current`.
pub fn fleet_view(total: Counts, reported: Counts, current: Counts) -> Counts {
    let f = |t: u64, r: u64, c: u64| t.saturating_sub(r).saturating_add(c).max(c);
    Counts {
        requests: f(total.requests, reported.requests, current.requests),
        prefill_tokens: f(
            total.prefill_tokens,
            reported.prefill_tokens,
            current.prefill_tokens,
        ),
        decode_tokens: f(
            total.decode_tokens,
            reported.decode_tokens,
            current.decode_tokens,
        ),
    }
}

/// What an engine reports about itself, when the caller has it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Share of the engine's KV cache in use, 0.0 to 1.0.
    pub kv_usage: f32,
}

/// The load one instance carries, summed over its dp ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InstanceLoad {
    /// Requests routed to it and not finished.
    pub requests: u32,
    /// Uncached prompt tokens of those requests: prefill work queued.
    pub prefill_tokens: u64,
    /// Decode work of those requests, in tokens (reported to the fleet; not in the cost).
    pub decode_tokens: u64,
    /// The engine's own report, when fresh: read by the saturation rule.
    pub engine: Option<EngineLoad>,
}

impl InstanceLoad {
    /// Adds one load-table entry (one worker slot or one instance): its prefill backlog is
    /// the work queued.
    pub fn add(&mut self, load: Load) {
        self.requests = self.requests.saturating_add(load.requests);
        self.prefill_tokens += u64::from(load.backlog);
        self.decode_tokens += u64::from(load.decode_tokens);
    }

    /// Adds one worker's counts.
    pub fn add_counts(&mut self, c: Counts) {
        self.requests = self
            .requests
            .saturating_add(c.requests.min(u64::from(u32::MAX)) as u32);
        self.prefill_tokens = self.prefill_tokens.saturating_add(c.prefill_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(c.decode_tokens);
    }

    /// Adds another worker's load (a dp rank of the same instance).
    pub fn merge(&mut self, o: InstanceLoad) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(o.decode_tokens);
        if let Some(e) = o.engine {
            self.add_engine(e);
        }
    }

    /// One load-table entry as an instance load.
    pub fn of(load: Load) -> InstanceLoad {
        let mut l = InstanceLoad::default();
        l.add(load);
        l
    }

    /// Folds in one worker's engine report: the busiest rank speaks for the instance.
    pub fn add_engine(&mut self, e: EngineLoad) {
        let cur = self.engine.unwrap_or_default();
        self.engine = Some(EngineLoad {
            waiting: cur.waiting.max(e.waiting),
            kv_usage: cur.kv_usage.max(e.kv_usage),
        });
    }
}

/// The size of the request being routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    /// Full blocks of the prompt.
    pub blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
}

/// One instance competing for a request: its best rank's match and its load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Contender {
    /// Whether it serves the request's model; an ineligible contender never wins.
    pub eligible: bool,
    /// Leading query blocks held by the chosen rank, per cumulative tier class.
    pub matched: [u32; 3],
    /// The dp rank holding that match.
    pub dp_rank: u32,
    /// In-flight load.
    pub load: InstanceLoad,
    /// Credit of `matched`; below zero until a rank is offered.
    credit: f64,
}

impl Contender {
    /// A contender with no match yet.
    pub fn new(eligible: bool, load: InstanceLoad) -> Contender {
        Contender {
            eligible,
            matched: [0; 3],
            dp_rank: 0,
            load,
            credit: -1.0,
        }
    }

    /// Offers one dp rank's match: kept when it earns more credit than the ranks offered
    /// before (so on a tie the first offered stays).
    pub fn offer(&mut self, dp_rank: u32, matched: [u32; 3], weights: &Weights) {
        let credit = select::credit(matched, weights);
        if credit > self.credit {
            self.credit = credit;
            self.matched = matched;
            self.dp_rank = dp_rank;
        }
    }
}

/// How a remote answer's rank is chosen (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankRule {
    /// The rank with the most credit (local mode, where ranks have tiers).
    MostCredit,
    /// The rank with the most matched tokens, the lowest rank on a tie (remote mode).
    MostTokens,
}

/// The decision: indices into the contender slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The instance to route to.
    pub best: usize,
    /// The next best, for the gateway's fallback.
    pub runner_up: Option<usize>,
    /// The rank of `best` holding its match.
    pub dp_rank: u32,
    /// Matched blocks of `best`, longest over tiers.
    pub matched_blocks: u32,
    /// Prefill tokens queued on `best` as decided on (0: its prefill was idle).
    pub queued_prefill_tokens: u64,
}

/// Ranks the eligible contenders under `policy`: the cheapest (seeded random among exact
/// ties) and the runner-up. `None` when no contender is eligible, or when none holds a block
/// of the query and `policy.cold` is [`Cold::Defer`].
pub fn decide(
    contenders: &[Contender],
    query: Query,
    policy: &Policy,
    rng: &mut impl Random,
) -> Option<Decision> {
    let eligible = || contenders.iter().enumerate().filter(|(_, c)| c.eligible);
    let hit = |c: &Contender| c.matched[2] > 0;
    if policy.cold == Cold::Defer && !eligible().any(|(_, c)| hit(c)) {
        return None;
    }
    // Saturated instances without a hit sit out while someone else can take the request.
    let any_free = eligible().any(|(_, c)| !policy.saturated(&c.load));
    let competes = |c: &Contender| !(any_free && policy.saturated(&c.load) && !hit(c));
    let least_queue = eligible()
        .filter(|(_, c)| competes(c))
        .map(|(_, c)| c.load.prefill_tokens)
        .min()?;
    let cost = |c: &Contender| {
        let over_guard = policy
            .max_hit_queue_tokens
            .is_some_and(|m| c.load.prefill_tokens - least_queue > m);
        let cand = Candidate {
            matched: if over_guard { [0; 3] } else { c.matched },
            dp_rank: c.dp_rank,
            in_flight_requests: c.load.requests,
            in_flight_prefill_tokens: c.load.prefill_tokens,
        };
        select::cost(&cand, query.blocks, query.block_size, &policy.weights)
    };
    // (whether this replica's share prefers it, contender index i, cost). Affinity splits
    // only instances holding nothing of the prompt: engines tied on a hit stay a random pick,
    // so a prefix cached on two engines is not pinned to one gateway's share.
    let scored = || {
        eligible()
            .enumerate()
            .filter(|(_, (_, c))| competes(c))
            .map(|(k, (i, c))| (policy.replica.owns(k) && !hit(c), i, cost(c)))
    };
    let (best, runner_up) = if policy.replica.count > 1 && policy.temperature <= 0.0 {
        select::rank_preferring(
            scored().map(|(home, i, c)| (i, c, home)),
            policy.replica_tie_band,
            rng,
        )?
    } else {
        // Alone every contender is in the share, so there is no band to look through; at
        // temperature 0 `sample` is `rank`.
        select::sample(scored().map(|(_, i, c)| (i, c)), policy.temperature, rng)?
    };
    let c = contenders.get(best)?;
    Some(Decision {
        best,
        runner_up,
        dp_rank: c.dp_rank,
        matched_blocks: c.matched[2],
        queued_prefill_tokens: c.load.prefill_tokens,
    })
}

/// One worker slot of an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The mirror's worker slot.
    pub slot: u32,
    /// The dp rank of that worker.
    pub dp_rank: u32,
}

/// An instance (one `instance_id`) of the mirror and its live worker slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instance {
    /// The engine's instance id.
    pub id: String,
    /// Where to send its requests (`host:port`).
    pub address: String,
    /// Its live workers, in slot order.
    pub slots: Vec<Slot>,
    /// `(tenant, model)` its workers are registered for.
    pub models: Vec<(String, String)>,
}

impl Instance {
    /// Whether a request of `(tenant, model)` may go here: an engine serves the models it was
    /// registered with (a worker registered without one is a candidate for any).
    pub fn serves(&self, tenant: &str, model: &str) -> bool {
        self.models
            .iter()
            .any(|(t, m)| m.is_empty() || (t == tenant && m == model))
    }

    /// Whether it has more than one dp rank (the rank header is then set).
    pub fn is_multi_rank(&self) -> bool {
        self.slots.len() > 1
    }

    /// The slot of `dp_rank`, or the first slot when no worker has that rank.
    pub fn slot_of_rank(&self, dp_rank: u32) -> Option<u32> {
        self.slots
            .iter()
            .find(|s| s.dp_rank == dp_rank)
            .or(self.slots.first())
            .map(|s| s.slot)
    }
}

/// The mirror's live workers grouped by instance: built once per meta change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roster {
    /// Every instance with a live worker, in order of first slot.
    pub instances: Vec<Instance>,
    /// Slot → (index into `instances`, dp rank).
    slot_instance: Vec<Option<(u32, u32)>>,
}

impl Roster {
    /// Groups the live workers of `meta` by instance id.
    pub fn from_meta(meta: &Meta) -> Roster {
        let mut r = Roster {
            instances: Vec::new(),
            slot_instance: vec![None; meta.workers.len()],
        };
        for (slot, w) in meta.workers.iter().enumerate() {
            let Some(w) = w.as_ref().filter(|w| w.live) else {
                continue;
            };
            let idx = match r.instances.iter().position(|i| i.id == w.instance_id) {
                Some(i) => i,
                None => {
                    r.instances.push(Instance {
                        id: w.instance_id.clone(),
                        address: w.address.clone(),
                        ..Instance::default()
                    });
                    r.instances.len() - 1
                }
            };
            if let Some(inst) = r.instances.get_mut(idx) {
                inst.slots.push(Slot {
                    slot: slot as u32,
                    dp_rank: w.dp_rank,
                });
                if !inst
                    .models
                    .iter()
                    .any(|(t, m)| *t == w.tenant && *m == w.model)
                {
                    inst.models.push((w.tenant.clone(), w.model.clone()));
                }
            }
            if let Some(s) = r.slot_instance.get_mut(slot) {
                *s = Some((idx as u32, w.dp_rank));
            }
        }
        r
    }

    /// The instance index and dp rank of worker slot `slot`.
    pub fn instance_of(&self, slot: u32) -> Option<(usize, u32)> {
        self.slot_instance
            .get(slot as usize)
            .copied()
            .flatten()
            .map(|(i, r)| (i as usize, r))
    }

    /// Local mode's contenders, one per instance: `matches` (per worker slot, from the
    /// walk) folded into each instance's best rank, the load of its slots summed from
    /// `load` (per worker slot), eligibility from `(tenant, model)`.
    pub fn contenders(
        &self,
        matches: &[WorkerMatch],
        tenant: &str,
        model: &str,
        load: impl Fn(LoadId) -> InstanceLoad,
        weights: &Weights,
    ) -> Vec<Contender> {
        let mut out: Vec<Contender> = self
            .instances
            .iter()
            .map(|inst| {
                let mut l = InstanceLoad::default();
                for s in &inst.slots {
                    l.merge(load(LoadId::slot(s.slot)));
                }
                Contender::new(inst.serves(tenant, model), l)
            })
            .collect();
        for m in matches {
            if let Some((i, rank)) = self.instance_of(m.worker.0) {
                if let Some(c) = out.get_mut(i) {
                    c.offer(rank, m.blocks, weights);
                }
            }
        }
        out
    }
}

/// Remote mode's contenders, one per instance of the collector's answer (in its order), all
/// eligible (the collector answered for the request's model), with their [`LoadId`]s.
pub fn remote_contenders(
    resp: &QueryResponse,
    load: impl Fn(LoadId) -> InstanceLoad,
) -> Vec<(Contender, LoadId)> {
    let bs = u64::from(resp.block_size.max(1));
    let blocks = |t: u64| (t / bs).min(u32::MAX as u64) as u32;
    resp.instances
        .iter()
        .map(|(id, m)| {
            let load_id = LoadId::instance(id);
            let mut c = Contender::new(true, load(load_id));
            c.matched = [
                blocks(m.gpu),
                blocks(m.cpu),
                blocks(m.disk.max(m.longest_matched)),
            ];
            c.dp_rank = rank_by(
                RankRule::MostTokens,
                m.dp.iter()
                    .filter_map(|(r, t)| r.parse::<u32>().ok().map(|r| (r, *t))),
            );
            (c, load_id)
        })
        .collect()
}

/// The rank `rule` picks from `(dp_rank, matched tokens)` pairs; 0 when there are none.
/// (Under [`RankRule::MostCredit`] tokens count as GPU blocks: more is better, the first
/// one given wins a tie.)
pub fn rank_by(rule: RankRule, ranks: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    match rule {
        RankRule::MostTokens => ranks
            .into_iter()
            .max_by_key(|(r, t)| (*t, std::cmp::Reverse(*r)))
            .map_or(0, |(r, _)| r),
        RankRule::MostCredit => {
            let mut best: Option<(u32, u64)> = None;
            for (r, t) in ranks {
                if best.is_none_or(|(_, b)| t > b) {
                    best = Some((r, t));
                }
            }
            best.map_or(0, |(r, _)| r)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::InstanceMatch;
    use crate::event::WorkerId;
    use crate::mirror::WorkerSlot;
    use crate::select::SplitMix64;

    const Q: Query = Query {
        blocks: 16,
        block_size: 16,
    };

    fn idle(matched: u32) -> Contender {
        let mut c = Contender::new(true, InstanceLoad::default());
        c.offer(0, [matched; 3], &Weights::default());
        c
    }

    fn loaded(matched: u32, requests: u32, prefill_tokens: u64) -> Contender {
        let mut c = idle(matched);
        c.load = InstanceLoad {
            requests,
            prefill_tokens,
            ..InstanceLoad::default()
        };
        c
    }

    fn pick(cs: &[Contender]) -> Option<Decision> {
        decide(cs, Q, &Policy::default(), &mut SplitMix64(1))
    }

    #[test]
    fn a_hit_beats_an_idle_miss() {
        // 10 of 16 blocks cached: cost 6 against 16 for the idle instance.
        let d = pick(&[idle(0), idle(10)]).unwrap();
        assert_eq!((d.best, d.runner_up, d.matched_blocks), (1, Some(0), 10));
    }

    #[test]
    fn a_queue_outweighs_a_hit() {
        // Hit: 6 uncached blocks + 1,000/16 = 62.5 queued + 4 requests = 72.5; miss: 16.
        let d = pick(&[loaded(10, 4, 1000), idle(0)]).unwrap();
        assert_eq!(d.best, 1);
        // A small queue does not: 6 + 32/16 + 1 = 9 < 16.
        let d = pick(&[loaded(10, 1, 32), idle(0)]).unwrap();
        assert_eq!(d.best, 0);
    }

    #[test]
    fn ranks_fold_to_the_one_with_most_credit_first_on_ties() {
        let w = Weights::default();
        let mut c = Contender::new(true, InstanceLoad::default());
        c.offer(0, [1, 1, 1], &w);
        c.offer(1, [0, 0, 6], &w); // 1.5 credit: more than rank 0's 1.0
        c.offer(2, [0, 0, 6], &w); // a tie: rank 1 stays
        assert_eq!((c.dp_rank, c.matched), (1, [0, 0, 6]));
        c.offer(3, [3, 3, 3], &w);
        assert_eq!((c.dp_rank, c.matched), (3, [3, 3, 3]));
    }

    #[test]
    fn slower_tiers_earn_less() {
        let mut disk = Contender::new(true, InstanceLoad::default());
        disk.offer(0, [0, 0, 8], &Weights::default());
        let mut cpu = Contender::new(true, InstanceLoad::default());
        cpu.offer(0, [0, 8, 8], &Weights::default());
        // Costs: disk 16 − 2 = 14, cpu 16 − 6 = 10, gpu 16 − 8 = 8.
        let d = pick(&[disk, cpu, idle(8)]).unwrap();
        assert_eq!((d.best, d.runner_up), (2, Some(1)));
        assert_eq!(pick(&[disk, cpu]).unwrap().best, 1);
    }

    #[test]
    fn only_eligible_instances_compete() {
        let mut other_model = idle(0);
        other_model.eligible = false;
        let d = pick(&[other_model, loaded(4, 2, 0)]).unwrap();
        assert_eq!(
            (d.best, d.runner_up),
            (1, None),
            "the idle one serves another model"
        );
        let mut hit = idle(10);
        hit.eligible = false;
        let d = pick(&[hit, idle(0)]).unwrap();
        assert_eq!(
            (d.best, d.matched_blocks),
            (1, 0),
            "a hit on an ineligible one is no hit: the request is cold"
        );
        let mut none = idle(0);
        none.eligible = false;
        assert_eq!(pick(&[none]), None, "no eligible instance: no decision");
    }

    #[test]
    fn ties_are_broken_by_the_seeded_source() {
        let cs = [idle(4), idle(4), idle(4), idle(1)];
        let run = |seed| {
            let mut rng = SplitMix64(seed);
            (0..30)
                .map(|_| decide(&cs, Q, &Policy::default(), &mut rng).unwrap().best)
                .collect::<Vec<_>>()
        };
        let a = run(9);
        assert_eq!(a, run(9), "the same seed gives the same choices");
        assert!(!a.contains(&3));
        for i in 0..3 {
            assert!(a.contains(&i), "each tied instance wins sometimes: {a:?}");
        }
    }

    fn slot(inst: &str, dp_rank: u32, model: &str) -> Option<WorkerSlot> {
        Some(WorkerSlot {
            live: true,
            dp_rank,
            instance_id: inst.into(),
            address: format!("{inst}:8000"),
            tenant: "default".into(),
            model: model.into(),
        })
    }

    #[test]
    fn the_roster_groups_ranks_and_sums_their_load() {
        let meta = Meta {
            workers: vec![
                slot("a", 0, "m"),
                slot("b", 0, "other"),
                slot("a", 1, "m"),
                None,
                slot("c", 0, ""),
            ],
            ..Meta::default()
        };
        let roster = Roster::from_meta(&meta);
        assert_eq!(roster.instances.len(), 3);
        assert_eq!(roster.instance_of(2), Some((0, 1)));
        assert_eq!(roster.instance_of(3), None);
        assert_eq!(roster.instances[0].slot_of_rank(1), Some(2));
        assert_eq!(roster.instances[0].slot_of_rank(7), Some(0));
        assert!(roster.instances[0].is_multi_rank());
        let matches = [
            WorkerMatch {
                worker: WorkerId(0),
                blocks: [2, 2, 2],
            },
            WorkerMatch {
                worker: WorkerId(2),
                blocks: [5, 5, 5],
            },
        ];
        let load = |id: LoadId| {
            InstanceLoad::of(Load::booked(
                u32::from(id == LoadId::slot(0) || id == LoadId::slot(2)),
                16,
                0,
            ))
        };
        let cs = roster.contenders(&matches, "default", "m", load, &Weights::default());
        assert_eq!((cs[0].dp_rank, cs[0].matched), (1, [5, 5, 5]));
        assert_eq!((cs[0].load.requests, cs[0].load.prefill_tokens), (2, 32));
        assert_eq!(
            cs.iter().map(|c| c.eligible).collect::<Vec<_>>(),
            [true, false, true],
            "b serves another model; c registered without one serves any"
        );
        // a: 11 uncached + 2 queued + 2 requests = 15 < c: 16 + 1 + 0 = 17.
        let d = decide(&cs, Q, &Policy::default(), &mut SplitMix64(1)).unwrap();
        assert_eq!((d.best, d.runner_up, d.dp_rank), (0, Some(2), 1));
    }

    #[test]
    fn remote_answers_keep_their_rank_rule() {
        let m = |tokens: u64, dp: &[(&str, u64)]| InstanceMatch {
            gpu: tokens,
            cpu: tokens,
            disk: tokens,
            longest_matched: tokens,
            dp: dp.iter().map(|(r, t)| (r.to_string(), *t)).collect(),
            ..InstanceMatch::default()
        };
        let resp = QueryResponse {
            block_size: 16,
            query_blocks: 4,
            instances: [
                ("x".to_string(), m(20, &[("0", 17), ("1", 20)])),
                ("y".to_string(), m(40, &[("2", 40), ("1", 40)])),
            ]
            .into_iter()
            .collect(),
        };
        let cs = remote_contenders(&resp, |_| InstanceLoad::default());
        // Rank 1 has more tokens though both ranks hold one full block.
        assert_eq!((cs[0].0.dp_rank, cs[0].0.matched), (1, [1, 1, 1]));
        assert_eq!(cs[1].0.dp_rank, 1, "the lowest rank on a tie");
        assert_eq!(cs[0].1, LoadId::instance("x"));
        assert_ne!(cs[0].1, LoadId::slot(0));
        assert_eq!(rank_by(RankRule::MostCredit, [(0, 17), (1, 17)]), 0);
        let only: Vec<Contender> = cs.iter().map(|c| c.0).collect();
        let d = decide(
            &only,
            Query {
                blocks: 4,
                block_size: 16,
            },
            &Policy::default(),
            &mut SplitMix64(1),
        )
        .unwrap();
        assert_eq!((d.best, d.matched_blocks), (1, 2));
    }

    fn with_policy(cs: &[Contender], p: &Policy) -> Option<Decision> {
        decide(cs, Q, p, &mut SplitMix64(1))
    }

    fn engine(mut c: Contender, waiting: u32, kv_usage: f32) -> Contender {
        c.load.engine = Some(EngineLoad { waiting, kv_usage });
        c
    }

    #[test]
    fn cold_requests_go_to_the_least_work_ahead() {
        // Costs: 16 + 320/16 + 2 = 38; 16 + 64/16 + 3 = 23; 16 + 160/16 + 1 = 27.
        let cs = [loaded(0, 2, 320), loaded(0, 3, 64), loaded(0, 1, 160)];
        let d = pick(&cs).unwrap();
        assert_eq!((d.best, d.runner_up, d.matched_blocks), (1, Some(2), 0));
        let defer = Policy {
            cold: Cold::Defer,
            ..Policy::default()
        };
        assert_eq!(with_policy(&cs, &defer), None, "deferred: no decision");
        // A hit anywhere is not cold: decided under Defer too.
        let mut warm = cs;
        warm[0].offer(0, [16; 3], &Weights::default());
        assert_eq!(with_policy(&warm, &defer).unwrap().best, 0);
    }

    #[test]
    fn each_replica_prefers_its_share_only_among_near_ties() {
        let of = |index, count| Policy {
            replica: Replica { index, count },
            ..Policy::default()
        };
        // Four eligible idle instances and an ineligible one in the middle (not counted).
        let mut cs = [idle(0), idle(0), idle(0), idle(0), idle(0)];
        cs[2].eligible = false;
        let mut chosen = [Vec::new(), Vec::new()];
        for (r, seen) in chosen.iter_mut().enumerate() {
            for seed in 0..40 {
                let d = decide(&cs, Q, &of(r as u32, 2), &mut SplitMix64(seed)).unwrap();
                if !seen.contains(&d.best) {
                    seen.push(d.best);
                }
            }
            seen.sort();
        }
        assert_eq!(chosen, [vec![0, 3], vec![1, 4]], "eligible 0, 2 | 1, 3");
        // Alone (or affinity off), every idle instance is a candidate.
        let alone: Vec<usize> = (0..40)
            .map(|s| decide(&cs, Q, &of(0, 1), &mut SplitMix64(s)).unwrap().best)
            .collect();
        assert!([0, 1, 3, 4].iter().all(|i| alone.contains(i)), "{alone:?}");
        // Own share busier by one request (a block of cost, above the band): the other
        // share's free engine wins, from either replica.
        let busy = [loaded(0, 1, 0), loaded(0, 0, 0)];
        assert_eq!(with_policy(&busy, &of(0, 2)).unwrap().best, 1);
        assert_eq!(with_policy(&busy, &of(1, 2)).unwrap().best, 1);
        // Within the band (a few drained tokens): affinity keeps it home.
        let near = [loaded(0, 0, 4), loaded(0, 0, 0)];
        assert_eq!(with_policy(&near, &of(0, 2)).unwrap().best, 0);
        assert_eq!(with_policy(&near, &of(1, 2)).unwrap().best, 1);
        // A hit in the other share wins over an idle miss at home.
        assert_eq!(
            with_policy(&[idle(0), idle(10)], &of(0, 2)).unwrap().best,
            1
        );
        // Two engines tied on the same hit: a random pick, whichever share they are in.
        let tied: Vec<usize> = (0..40)
            .map(|s| {
                decide(&[idle(8), idle(8)], Q, &of(0, 2), &mut SplitMix64(s))
                    .unwrap()
                    .best
            })
            .collect();
        assert!(tied.contains(&0) && tied.contains(&1), "{tied:?}");
        // The runner-up is the cheapest of the others, in either share.
        let three = [loaded(0, 0, 4), loaded(0, 0, 0), loaded(0, 3, 0)];
        let d = with_policy(&three, &of(0, 2)).unwrap();
        assert_eq!((d.best, d.runner_up), (0, Some(1)));
        // Affinity off: the other share's idle instances compete as equals again.
        let off = Policy {
            replica_tie_band: 0.0,
            ..of(0, 2)
        };
        let both: Vec<usize> = (0..40)
            .map(|s| decide(&cs, Q, &off, &mut SplitMix64(s)).unwrap().best)
            .collect();
        assert!([0, 1, 3, 4].iter().all(|i| both.contains(i)), "{both:?}");
        assert_eq!(Replica::parse("1/2"), Some(Replica { index: 1, count: 2 }));
        assert_eq!(Replica::parse("2/2"), None);
        assert_eq!(Replica::parse("x"), None);
    }

    #[test]
    fn temperature_spreads_near_equal_engines_but_not_past_a_hit() {
        let warm = Policy {
            temperature: 0.1,
            ..Policy::default()
        };
        // Costs 16 + 0 + 1 = 17 and 16 + 1 + 1 = 18: near, so both get requests.
        let near = [loaded(0, 1, 0), loaded(0, 1, 16)];
        let mut rng = SplitMix64(11);
        let picks: Vec<usize> = (0..400)
            .map(|_| decide(&near, Q, &warm, &mut rng).unwrap().best)
            .collect();
        let second = picks.iter().filter(|&&b| b == 1).count();
        assert!(
            (100..200).contains(&second),
            "{second} of 400 to the dearer one"
        );
        // Without temperature the cheaper one always wins.
        assert!((0..50).all(|_| pick(&near).unwrap().best == 0));
        // A full hit (cost ~1) against an idle miss (17): the hit every time.
        let mut hot = idle(0);
        hot.offer(0, [16; 3], &Weights::default());
        let cs = [loaded(0, 0, 0), hot];
        assert!((0..400).all(|_| decide(&cs, Q, &warm, &mut rng).unwrap().best == 1));
    }

    #[test]
    fn a_prompt_shorter_than_a_block_is_decided_by_load() {
        let q = Query {
            blocks: 0,
            block_size: 16,
        };
        let cs = [loaded(0, 1, 0), loaded(0, 0, 0)];
        let d = decide(&cs, q, &Policy::default(), &mut SplitMix64(3)).unwrap();
        assert_eq!(d.best, 1);
    }

    #[test]
    fn saturated_engines_get_no_cold_request() {
        let p = Policy::default();
        // The idle one has a waiting queue of 8: the busier one takes the cold request.
        let cs = [engine(idle(0), 8, 0.1), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 1);
        // KV usage at the limit saturates too; just below does not.
        let cs = [engine(idle(0), 0, 0.98), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 1);
        let cs = [engine(idle(0), 7, 0.97), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 0);
        // Everyone saturated: the cost decides among them.
        let cs = [engine(idle(0), 9, 0.1), engine(loaded(0, 3, 640), 9, 0.1)];
        assert_eq!(pick(&cs).unwrap().best, 0);
        // A saturated engine holding a hit still competes.
        let cs = [engine(idle(12), 9, 0.1), loaded(0, 0, 0)];
        assert!(p.saturated(&cs[0].load));
        assert_eq!(pick(&cs).unwrap().best, 0);
        // The saturated one is not the runner-up either.
        let cs = [
            engine(idle(0), 8, 0.1),
            loaded(0, 3, 640),
            loaded(0, 4, 640),
        ];
        assert_eq!(pick(&cs).unwrap().runner_up, Some(2));
    }

    #[test]
    fn the_hot_spot_guard_caps_what_a_hit_buys() {
        // With the request term off, a full hit behind 15 queued blocks (cost 15) beats an
        // idle miss (cost 16) unless the guard takes the hit's credit away.
        let unguarded = Policy {
            max_hit_queue_tokens: None,
            weights: Weights {
                overlap: 1.0,
                request: 0.0,
                ..Weights::default()
            },
            ..Policy::default()
        };
        let guarded = Policy {
            max_hit_queue_tokens: Some(100),
            ..unguarded
        };
        let hot = loaded(16, 1, 240); // 15 queued blocks + 0 uncached = 15
        let cold = loaded(0, 0, 0); // 0 + 16 = 16
        assert_eq!(with_policy(&[hot, cold], &unguarded).unwrap().best, 0);
        // 240 − 0 > 100: no credit, cost 15 + 16 = 31 > 16.
        let d = with_policy(&[hot, cold], &guarded).unwrap();
        assert_eq!((d.best, d.runner_up), (1, Some(0)));
        // Within the bound the hit keeps its credit.
        let within = Policy {
            max_hit_queue_tokens: Some(240),
            ..unguarded
        };
        assert_eq!(with_policy(&[hot, cold], &within).unwrap().best, 0);
    }

    #[test]
    fn fleet_view_adds_other_gateways_load_to_ours() {
        let c = |requests, prefill_tokens, decode_tokens| Counts {
            requests,
            prefill_tokens,
            decode_tokens,
        };
        // The fleet counts 10 requests, 3 of them ours as last reported; we now have 5.
        assert_eq!(
            fleet_view(c(10, 1000, 500), c(3, 300, 100), c(5, 400, 50)),
            c(12, 1100, 450)
        );
        // A total older than our report (it misses part of it): never below our own.
        assert_eq!(
            fleet_view(c(1, 0, 0), c(3, 300, 0), c(2, 50, 0)),
            c(2, 50, 0)
        );
        // No fleet: our own.
        assert_eq!(
            fleet_view(Counts::default(), Counts::default(), c(4, 4, 4)),
            c(4, 4, 4)
        );
    }

    #[test]
    fn instance_load_sums_counts_and_keeps_the_busiest_engine() {
        let mut l = InstanceLoad::default();
        l.add_counts(Counts {
            requests: 2,
            prefill_tokens: 10,
            decode_tokens: 7,
        });
        l.add(Load {
            backlog: 4,
            ..Load::booked(1, 5, 3)
        });
        l.add_engine(EngineLoad {
            waiting: 3,
            kv_usage: 0.2,
        });
        l.add_engine(EngineLoad {
            waiting: 1,
            kv_usage: 0.9,
        });
        assert_eq!(
            (l.requests, l.prefill_tokens, l.decode_tokens),
            (3, 14, 10),
            "the backlog counts"
        );
        assert_eq!(
            l.engine,
            Some(EngineLoad {
                waiting: 3,
                kv_usage: 0.9
            })
        );
    }

    mod property {
        use super::*;
        use proptest::prelude::*;

        fn contender() -> impl Strategy<Value = Contender> {
            (
                0u32..20,
                0u32..6,
                0u64..4096,
                any::<bool>(),
                0u32..12,
                0u32..100,
            )
                .prop_map(|(m, requests, prefill, eligible, waiting, kv)| {
                    let mut c = loaded(m, requests, prefill);
                    c.eligible = eligible;
                    engine(c, waiting, kv as f32 / 100.0)
                })
        }

        proptest! {
            /// Whatever the replica count and share, the winner costs at most the tie band
            /// more than any other competing contender, and it is eligible.
            #[test]
            fn no_replica_share_outweighs_cost(
                cs in proptest::collection::vec(contender(), 1..10),
                count in 1u32..5,
                index in 0u32..5,
                band in prop_oneof![Just(REPLICA_TIE_BAND), 0.0f64..3.0],
                seed in any::<u64>(),
            ) {
                let replica = Replica { index: index % count, count };
                let p = Policy { replica, replica_tie_band: band, ..Policy::default() };
                let Some(d) = decide(&cs, Q, &p, &mut SplitMix64(seed)) else {
                    prop_assert!(cs.iter().all(|c| !c.eligible));
                    return Ok(());
                };
                prop_assert!(cs[d.best].eligible);
                // Recompute each competing contender's cost as the policy sees it.
                let any_free = cs.iter().any(|c| c.eligible && !p.saturated(&c.load));
                let competes = |c: &Contender| {
                    c.eligible && !(any_free && p.saturated(&c.load) && c.matched[2] == 0)
                };
                let cost = |c: &Contender| {
                    select::cost(
                        &Candidate {
                            matched: c.matched,
                            dp_rank: c.dp_rank,
                            in_flight_requests: c.load.requests,
                            in_flight_prefill_tokens: c.load.prefill_tokens,
                        },
                        Q.blocks,
                        Q.block_size,
                        &p.weights,
                    )
                };
                prop_assert!(competes(&cs[d.best]));
                let best = cost(&cs[d.best]);
                for c in cs.iter().filter(|c| competes(c)) {
                    prop_assert!(best <= cost(c) + band + 1e-9, "{best} vs {}", cost(c));
                }
                // With the default band, never busier by a whole request when the prefill
                // and the match are the same.
                if band == REPLICA_TIE_BAND {
                    for c in cs.iter().filter(|c| competes(c)) {
                        let w = &cs[d.best];
                        if c.matched == w.matched && c.load.prefill_tokens == w.load.prefill_tokens {
                            prop_assert!(w.load.requests <= c.load.requests);
                        }
                    }
                }
            }
        }
    }
}
