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
//! [`InstanceLoad`] carries more than today's cost reads (decode work, the engine's own
//! waiting count and cache usage) so saturation and hot-spot rules can be added here without
//! changing the callers' shape.

use crate::api::QueryResponse;
use crate::lookup::WorkerMatch;
use crate::mirror::{Load, LoadId, Meta};
use crate::select::{self, Candidate, Random, Weights};

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
    /// Decode work of those requests, in tokens (not read by today's cost).
    pub decode_tokens: u64,
    /// The engine's own report (not read by today's cost).
    pub engine: Option<EngineLoad>,
}

impl InstanceLoad {
    /// Adds one load-table entry (one worker slot or one instance).
    pub fn add(&mut self, load: Load) {
        self.requests = self.requests.saturating_add(load.requests);
        self.prefill_tokens += u64::from(load.prefill_tokens);
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
}

/// Ranks the eligible contenders: the cheapest (seeded random among exact ties) and the
/// runner-up. `None` when no eligible contender holds a block of the query.
pub fn decide(
    contenders: &[Contender],
    query: Query,
    weights: &Weights,
    rng: &mut impl Random,
) -> Option<Decision> {
    let mut eligible = Vec::with_capacity(contenders.len());
    let mut cands = Vec::with_capacity(contenders.len());
    for (i, c) in contenders.iter().enumerate() {
        if c.eligible {
            eligible.push(i);
            cands.push(Candidate {
                matched: c.matched,
                dp_rank: c.dp_rank,
                in_flight_requests: c.load.requests,
                in_flight_prefill_tokens: c.load.prefill_tokens,
            });
        }
    }
    let choice = select::pick(&cands, query.blocks, query.block_size, weights, rng)?;
    Some(Decision {
        best: *eligible.get(choice.best)?,
        runner_up: choice.runner_up.and_then(|r| eligible.get(r).copied()),
        dp_rank: choice.dp_rank,
        matched_blocks: choice.matched_blocks,
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
    /// `load`, eligibility from `(tenant, model)`.
    pub fn contenders(
        &self,
        matches: &[WorkerMatch],
        tenant: &str,
        model: &str,
        load: impl Fn(LoadId) -> Load,
        weights: &Weights,
    ) -> Vec<Contender> {
        let mut out: Vec<Contender> = self
            .instances
            .iter()
            .map(|inst| {
                let mut l = InstanceLoad::default();
                for s in &inst.slots {
                    l.add(load(LoadId::slot(s.slot)));
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
    load: impl Fn(LoadId) -> Load,
) -> Vec<(Contender, LoadId)> {
    let bs = u64::from(resp.block_size.max(1));
    let blocks = |t: u64| (t / bs).min(u32::MAX as u64) as u32;
    resp.instances
        .iter()
        .map(|(id, m)| {
            let load_id = LoadId::instance(id);
            let mut l = InstanceLoad::default();
            l.add(load(load_id));
            let mut c = Contender::new(true, l);
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
        decide(cs, Q, &Weights::default(), &mut SplitMix64(1))
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
        assert_eq!(
            pick(&[hit, idle(0)]),
            None,
            "a hit on an ineligible one is no hit"
        );
    }

    #[test]
    fn ties_are_broken_by_the_seeded_source() {
        let cs = [idle(4), idle(4), idle(4), idle(1)];
        let run = |seed| {
            let mut rng = SplitMix64(seed);
            (0..30)
                .map(|_| decide(&cs, Q, &Weights::default(), &mut rng).unwrap().best)
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
        let load = |id: LoadId| Load {
            requests: u32::from(id == LoadId::slot(0) || id == LoadId::slot(2)),
            prefill_tokens: 16,
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
        let d = decide(&cs, Q, &Weights::default(), &mut SplitMix64(1)).unwrap();
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
        let cs = remote_contenders(&resp, |_| Load::default());
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
            &Weights::default(),
            &mut SplitMix64(1),
        )
        .unwrap();
        assert_eq!((d.best, d.matched_blocks), (1, 2));
    }
}
