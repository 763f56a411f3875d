//! Contenders in, a ranked choice out: dp ranks folded per instance, eligibility, saturation,
//! the hot-spot guard, cost, and the replica tie band (the rules are listed in [`super`]).

use super::load::InstanceLoad;
use super::policy::{Cold, Policy};
use crate::select::{self, Candidate, Random, Weights};

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
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// `best`'s cost, in blocks of prefill work (the hot-spot guard applied), for explaining
    /// the decision.
    pub cost: f64,
    /// The runner-up's cost, the margin the winner won by.
    pub runner_up_cost: Option<f64>,
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
    let scoring = Scoring::new(contenders, policy)?;
    let competes = |c: &Contender| scoring.competes(c);
    let cost = |c: &Contender| scoring.cost(c, query);
    let (best, runner_up) = if policy.replica.count > 1 && policy.temperature <= 0.0 {
        let scored = contenders
            .iter()
            .zip(preferred(contenders, policy))
            .enumerate()
            .filter(|(_, (c, _))| competes(c))
            .map(|(i, (c, home))| (i, cost(c), home));
        select::rank_preferring(scored, policy.replica_tie_band, rng)?
    } else {
        // Alone every contender is in the share, so there is no band to look through (and
        // no share to work out); at temperature 0 `sample` is `rank`.
        let scored = eligible()
            .filter(|(_, c)| competes(c))
            .map(|(i, c)| (i, cost(c)));
        select::sample(scored, policy.temperature, rng)?
    };
    let c = contenders.get(best)?;
    Some(Decision {
        best,
        runner_up,
        dp_rank: c.dp_rank,
        matched_blocks: c.matched[2],
        queued_prefill_tokens: c.load.prefill_tokens,
        cost: cost(c),
        runner_up_cost: runner_up.and_then(|i| contenders.get(i)).map(cost),
    })
}

/// Which contenders this gateway replica prefers among those near-tied on cost (within
/// [`Policy::replica_tie_band`]), in contender order. Replicas learn of each other's bookings
/// one or two sync periods late, so on the same picture they would all pick the same engine;
/// each prefers instead the instances of its [`Share`](super::load::Share), a run of the
/// fleet as wide as its part of the gateways' requests in flight. Fixed shares of `1/n` each
/// would pile the traffic of a replica that sends most of it (an 80/20 split of the
/// clients) onto its half of the fleet. Instances holding part of the prompt are never
/// preferred: engines tied on a hit stay a random pick, so a prefix cached on two engines is
/// not pinned to one replica's share. Ineligible contenders are not preferred (they never
/// compete).
pub fn preferred<'a>(
    contenders: &'a [Contender],
    policy: &'a Policy,
) -> impl Iterator<Item = bool> + Clone + 'a {
    let eligible = contenders.iter().filter(|c| c.eligible);
    let (own, others) = eligible.clone().fold((0u64, 0u64), |(own, others), c| {
        let o = c.load.others_requests.min(c.load.requests);
        (own + u64::from(c.load.requests - o), others + u64::from(o))
    });
    let share = policy.replica.share(own, others, eligible.count());
    contenders.iter().scan(0usize, move |k, c| {
        if !c.eligible {
            return Some(false);
        }
        *k += 1;
        Some(share.owns(*k - 1) && c.matched[2] == 0)
    })
}

/// What [`decide`] charges each contender, in contender order: `None` for one that does not
/// compete (not eligible, or saturated without a hit while an unsaturated one is eligible),
/// else its cost with the hot-spot guard applied. For explaining a decision.
pub fn costs(contenders: &[Contender], query: Query, policy: &Policy) -> Vec<Option<f64>> {
    let scoring = Scoring::new(contenders, policy);
    contenders
        .iter()
        .map(|c| {
            let s = scoring.as_ref()?;
            s.competes(c).then(|| s.cost(c, query))
        })
        .collect()
}

/// The rules that decide who competes and at what cost, computed once per decision.
struct Scoring<'p> {
    policy: &'p Policy,
    /// Whether some eligible contender is not saturated.
    any_free: bool,
    /// The least queued prefill among the competing: the hot-spot guard's reference.
    least_queue: u64,
}

impl<'p> Scoring<'p> {
    /// `None` when no contender competes.
    fn new(contenders: &[Contender], policy: &'p Policy) -> Option<Scoring<'p>> {
        let mut s = Scoring {
            policy,
            any_free: contenders
                .iter()
                .any(|c| c.eligible && !policy.saturated(&c.load)),
            least_queue: 0,
        };
        s.least_queue = contenders
            .iter()
            .filter(|c| s.competes(c))
            .map(|c| c.load.prefill_tokens)
            .min()?;
        Some(s)
    }

    /// Saturated instances without a hit sit out while someone else can take the request.
    fn competes(&self, c: &Contender) -> bool {
        let hit = c.matched[2] > 0;
        c.eligible && !(self.any_free && self.policy.saturated(&c.load) && !hit)
    }

    /// The cost of a competing contender.
    fn cost(&self, c: &Contender, query: Query) -> f64 {
        let over_guard = self
            .policy
            .max_hit_queue_tokens
            .is_some_and(|m| c.load.prefill_tokens.saturating_sub(self.least_queue) > m);
        let cand = Candidate {
            matched: if over_guard { [0; 3] } else { c.matched },
            dp_rank: c.dp_rank,
            in_flight_requests: c.load.requests,
            in_flight_prefill_tokens: c.load.prefill_tokens,
        };
        select::cost(&cand, query.blocks, query.block_size, &self.policy.weights)
    }
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
    use crate::router::{EngineLoad, Replica, REPLICA_TIE_BAND};
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

    /// `c` with `n` of its requests booked by other gateways.
    fn others(mut c: Contender, n: u32) -> Contender {
        c.load.others_requests = n;
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
        assert_eq!(
            (d.cost, d.runner_up_cost),
            (6.0, Some(16.0)),
            "the costs explained"
        );
    }

    #[test]
    fn costs_are_what_the_decision_charged_and_none_for_who_sits_out() {
        let mut off = idle(16);
        off.eligible = false;
        let cs = [loaded(10, 4, 1000), idle(0), engine(idle(0), 9, 100), off];
        let d = pick(&cs).unwrap();
        let c = costs(&cs, Q, &Policy::default());
        assert_eq!(c, vec![Some(72.5), Some(16.0), None, None]);
        assert_eq!(Some(d.cost), c[d.best]);
        assert_eq!(d.runner_up_cost, d.runner_up.and_then(|i| c[i]));
        assert_eq!(costs(&[off], Q, &Policy::default()), vec![None]);
    }

    #[test]
    fn a_queue_outweighs_a_hit() {
        // Hit: 6 uncached blocks + 1,000/16 = 62.5 queued + 4 requests = 72.5; miss: 16.
        let d = pick(&[loaded(10, 4, 1000), idle(0)]).unwrap();
        assert_eq!(d.best, 1);
        assert_eq!((d.cost, d.runner_up_cost), (16.0, Some(72.5)));
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

    fn with_policy(cs: &[Contender], p: &Policy) -> Option<Decision> {
        decide(cs, Q, p, &mut SplitMix64(1))
    }

    fn engine(mut c: Contender, waiting: u32, kv_permille: u16) -> Contender {
        c.load.engine = Some(EngineLoad {
            waiting,
            kv_permille,
            ..EngineLoad::default()
        });
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
        assert_eq!(chosen, [vec![0, 1], vec![3, 4]], "eligible 0, 1 | 2, 3");
        // Alone (or affinity off), every idle instance is a candidate.
        let alone: Vec<usize> = (0..40)
            .map(|s| decide(&cs, Q, &of(0, 1), &mut SplitMix64(s)).unwrap().best)
            .collect();
        assert!([0, 1, 3, 4].iter().all(|i| alone.contains(i)), "{alone:?}");
        // Own share busier by three requests (three blocks of cost, above the band): the
        // other share's free engine wins, from either replica.
        let busy = [loaded(0, 3, 0), loaded(0, 0, 0)];
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
        let three = [loaded(0, 0, 4), loaded(0, 0, 0), others(loaded(0, 3, 0), 3)];
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
    fn a_replica_prefers_a_share_as_wide_as_its_part_of_the_traffic() {
        let of = |index| Policy {
            replica: Replica { index, count: 2 },
            ..Policy::default()
        };
        let picks = |cs: &[Contender], p: &Policy| {
            let mut seen: Vec<usize> = (0..60)
                .map(|s| decide(cs, Q, p, &mut SplitMix64(s)).unwrap().best)
                .collect();
            seen.sort();
            seen.dedup();
            seen
        };
        // Four idle engines and a fifth busy with eight requests, out of the band. When the
        // eight are this replica's (it carries all the traffic: 9/10 of the fleet, smoothed),
        // every idle engine takes its requests, not just its half of the fleet.
        let mut cs = [idle(0), idle(0), idle(0), idle(0), loaded(0, 8, 0)];
        assert_eq!(picks(&cs, &of(0)), [0, 1, 2, 3]);
        // When they are the other replica's, this one is the quiet one: a tenth of the fleet,
        // its first engine, while the other keeps to the rest.
        cs[4] = others(loaded(0, 8, 0), 8);
        assert_eq!(picks(&cs, &of(0)), [0]);
        // Shared evenly (four each): half the fleet each, as on an idle fleet.
        cs[4] = others(loaded(0, 8, 0), 4);
        assert_eq!(picks(&cs, &of(0)), [0, 1]);
        assert_eq!(picks(&cs, &of(1)), [2, 3]);
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
        let cs = [engine(idle(0), 8, 100), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 1);
        // KV usage at the limit saturates too; just below does not.
        let cs = [engine(idle(0), 0, 980), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 1);
        let cs = [engine(idle(0), 7, 970), loaded(0, 3, 640)];
        assert_eq!(pick(&cs).unwrap().best, 0);
        // Everyone saturated: the cost decides among them.
        let cs = [engine(idle(0), 9, 100), engine(loaded(0, 3, 640), 9, 100)];
        assert_eq!(pick(&cs).unwrap().best, 0);
        // A saturated engine holding a hit still competes.
        let cs = [engine(idle(12), 9, 100), loaded(0, 0, 0)];
        assert!(p.saturated(&cs[0].load));
        assert_eq!(pick(&cs).unwrap().best, 0);
        // The saturated one is not the runner-up either.
        let cs = [
            engine(idle(0), 8, 100),
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
                0u32..6,
            )
                .prop_map(|(m, requests, prefill, eligible, waiting, kv, theirs)| {
                    // Part of the requests booked by other gateways: the tie-break's key.
                    let mut c = others(loaded(m, requests, prefill), theirs.min(requests));
                    c.eligible = eligible;
                    engine(c, waiting, (kv * 10) as u16)
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
                // With the default weights a request costs one block: when the prefill and
                // the match are the same, never busier by more requests than the band.
                for c in cs.iter().filter(|c| competes(c)) {
                    let w = &cs[d.best];
                    if c.matched == w.matched && c.load.prefill_tokens == w.load.prefill_tokens {
                        prop_assert!(f64::from(w.load.requests) <= f64::from(c.load.requests) + band);
                    }
                }
            }
        }
    }
}
