//! The routing decision, shared by the filter and the simulator's benchmark.
//!
//! # Cost
//!
//! As in Dynamo's KV router, cached blocks do not earn a bonus: they shrink the prefill work a
//! request would add to an instance, and the instance with the least work ahead wins.
//!
//! ```text
//! credit   = gpu·w_gpu + (cpu − gpu)·w_cpu + (disk − cpu)·w_disk      (blocks; tiers cumulative)
//! prefill  = in_flight_prefill_tokens / block_size + query_blocks − credit
//! cost     = overlap_weight · prefill + request_weight · in_flight_requests
//! ```
//!
//! Lower is better. Exact ties are broken at random with the caller's random source, so equal
//! instances share the load. When no instance holds a single block of the query there is
//! nothing to route on: [`pick`] returns `None` and the gateway's own balancing decides.
//!
//! Default weights: tiers GPU 1.0, CPU 0.75, DISK 0.25 (a hit in a slower tier still has to be
//! loaded); overlap 1.0 (Dynamo's `overlap_score_weight`); 1 block per in-flight request, a
//! small nudge that spreads requests whose prefill tokens are equal.

/// The weights of the cost function.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Credit per matched block in each tier class: GPU, CPU, DISK.
    pub tiers: [f64; 3],
    /// Weight of the prefill work in the cost (Dynamo's `overlap_score_weight`).
    pub overlap: f64,
    /// Blocks of cost per request in flight.
    pub request: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            tiers: [1.0, 0.75, 0.25],
            overlap: 1.0,
            request: 1.0,
        }
    }
}

/// One instance the caller could route to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Leading query blocks held, per cumulative tier class (GPU ≤ CPU ≤ DISK), for the
    /// instance's best dp rank (see [`fold_ranks`]).
    pub matched: [u32; 3],
    /// The dp rank holding that match.
    pub dp_rank: u32,
    /// Requests in flight.
    pub in_flight_requests: u32,
    /// Uncached prompt tokens of the requests in flight: prefill work already queued.
    pub in_flight_prefill_tokens: u64,
}

/// The decision: indices into the candidate slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// Index of the cheapest candidate.
    pub best: usize,
    /// Index of the next cheapest, if any.
    pub runner_up: Option<usize>,
    /// The dp rank of `best` that holds its match.
    pub dp_rank: u32,
    /// Matched blocks of `best` (longest over tiers).
    pub matched_blocks: u32,
}

/// A source of randomness for tie-breaks; the core has none of its own.
pub trait Random {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64;
}

/// SplitMix64: a tiny, well-distributed generator for callers without one.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl Random for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Overlap credit of a match, in blocks.
pub fn credit(matched: [u32; 3], weights: &Weights) -> f64 {
    let [gpu, cpu, disk] = matched.map(f64::from);
    gpu * weights.tiers[0]
        + (cpu - gpu).max(0.0) * weights.tiers[1]
        + (disk - cpu).max(0.0) * weights.tiers[2]
}

/// The cost of sending the request to `c` (lower is better).
pub fn cost(c: &Candidate, query_blocks: u32, block_size: u32, weights: &Weights) -> f64 {
    let queued = c.in_flight_prefill_tokens as f64 / block_size.max(1) as f64;
    let prefill = queued + (f64::from(query_blocks) - credit(c.matched, weights)).max(0.0);
    weights.overlap * prefill + weights.request * f64::from(c.in_flight_requests)
}

/// Folds an instance's dp ranks into one match: the rank with the most credit.
pub fn fold_ranks(
    ranks: impl IntoIterator<Item = (u32, [u32; 3])>,
    weights: &Weights,
) -> ([u32; 3], u32) {
    let mut best = ([0; 3], 0);
    let mut best_credit = -1.0;
    for (rank, matched) in ranks {
        let c = credit(matched, weights);
        if c > best_credit {
            best = (matched, rank);
            best_credit = c;
        }
    }
    best
}

/// Ranks the candidates by cost: the cheapest (random among exact ties) and the runner-up.
/// `None` when the slice is empty or no candidate holds any block of the query.
pub fn pick(
    candidates: &[Candidate],
    query_blocks: u32,
    block_size: u32,
    weights: &Weights,
    rng: &mut impl Random,
) -> Option<Choice> {
    if candidates.iter().all(|c| c.matched[2] == 0) {
        return None;
    }
    let (best, runner_up) = rank(
        candidates
            .iter()
            .enumerate()
            .map(|(i, c)| (i, cost(c, query_blocks, block_size, weights))),
        rng,
    )?;
    Some(Choice {
        best,
        runner_up,
        dp_rank: candidates[best].dp_rank,
        matched_blocks: candidates[best].matched[2],
    })
}

/// The cheapest of `(index, cost)` pairs and the runner-up. Exact ties are broken with
/// reservoir sampling, so each tied index wins with equal odds and the one not kept is the
/// runner-up. `None` for no pairs.
pub fn rank(
    costs: impl IntoIterator<Item = (usize, f64)>,
    rng: &mut impl Random,
) -> Option<(usize, Option<usize>)> {
    let mut best: Option<(usize, f64)> = None;
    let mut second: Option<(usize, f64)> = None;
    let mut ties = 0u64;
    for (i, cost) in costs {
        match best {
            Some((_, b)) if cost > b => {
                if second.is_none_or(|(_, s)| cost < s) {
                    second = Some((i, cost));
                }
            }
            Some((b_idx, b)) if cost == b => {
                ties += 1;
                if rng.next_u64().is_multiple_of(ties + 1) {
                    best = Some((i, cost));
                    second = Some((b_idx, b));
                } else if second.is_none_or(|(_, s)| cost <= s) {
                    second = Some((i, cost));
                }
            }
            Some((b_idx, b)) => {
                second = Some((b_idx, b));
                best = Some((i, cost));
                ties = 0;
            }
            None => best = Some((i, cost)),
        }
    }
    best.map(|(b, _)| (b, second.map(|(i, _)| i)))
}

/// Like [`rank`], but contenders marked preferred win near-ties: among the candidates costing
/// at most `band` more than the cheapest of all, the preferred ones compete if there are any
/// (all of them otherwise), and the cheapest of those wins (random among its exact ties). The
/// runner-up is the cheapest of the others. The winner's cost never exceeds the cheapest's by
/// more than `band`, whatever is preferred. `band` ≤ 0 or not finite: [`rank`].
pub fn rank_preferring<I>(
    costs: I,
    band: f64,
    rng: &mut impl Random,
) -> Option<(usize, Option<usize>)>
where
    I: Iterator<Item = (usize, f64, bool)> + Clone,
{
    let all = costs.clone().map(|(i, c, _)| (i, c));
    if !(band.is_finite() && band > 0.0) {
        return rank(all, rng);
    }
    let min = all.clone().map(|(_, c)| c).fold(f64::INFINITY, f64::min);
    let near = costs.filter(|&(_, c, _)| c <= min + band);
    let any_preferred = near.clone().any(|(_, _, p)| p);
    let (best, _) = rank(
        near.filter(|&(_, _, p)| p == any_preferred)
            .map(|(i, c, _)| (i, c)),
        rng,
    )?;
    let mut second: Option<(usize, f64)> = None;
    for (i, c) in all.filter(|&(i, _)| i != best) {
        if second.is_none_or(|(_, s)| c < s) {
            second = Some((i, c));
        }
    }
    Some((best, second.map(|(i, _)| i)))
}

/// Like [`rank`], but the winner is drawn: each index with odds `exp(−(cost − min) /
/// (temperature × max(min, 1)))`, so contenders within a few `temperature`s of the cheapest
/// (relative to its cost) share the requests and a much cheaper one still wins nearly always.
/// Gateways deciding on the same slightly stale load then spread their picks instead of all
/// choosing the same minimum. The runner-up is the cheapest of the others. `temperature` ≤ 0
/// or not finite: [`rank`].
pub fn sample(
    costs: impl IntoIterator<Item = (usize, f64)>,
    temperature: f64,
    rng: &mut impl Random,
) -> Option<(usize, Option<usize>)> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return rank(costs, rng);
    }
    let costs: Vec<(usize, f64)> = costs.into_iter().collect();
    let min = costs.iter().map(|&(_, c)| c).fold(f64::INFINITY, f64::min);
    if !min.is_finite() {
        return rank(costs, rng);
    }
    let scale = temperature * min.max(1.0);
    let weights: Vec<f64> = costs
        .iter()
        .map(|&(_, c)| (-(c - min) / scale).exp())
        .collect();
    // 53 random bits as a fraction of the total weight.
    let mut left =
        (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * weights.iter().sum::<f64>();
    let mut chosen = costs.len() - 1;
    for (k, w) in weights.iter().enumerate() {
        left -= w;
        if left < 0.0 {
            chosen = k;
            break;
        }
    }
    let (best, _) = costs[chosen];
    let runner_up = costs
        .iter()
        .enumerate()
        .filter(|&(k, _)| k != chosen)
        .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .map(|(_, &(i, _))| i);
    Some((best, runner_up))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_spreads_near_ties_and_keeps_clear_winners() {
        let mut rng = SplitMix64(7);
        let mut wins = [0u32; 3];
        for _ in 0..3000 {
            // 100 and 105 are near (5 % apart); 400 is far.
            let (best, runner_up) =
                sample([(0, 100.0), (1, 105.0), (2, 400.0)], 0.1, &mut rng).unwrap();
            wins[best] += 1;
            let expected_runner_up = if best == 0 { 1 } else { 0 };
            assert_eq!(runner_up, Some(expected_runner_up));
        }
        // Odds 1 : e^-0.5 : e^-30 → about 62 % / 38 % / 0.
        assert!((1700..2000).contains(&wins[0]), "{wins:?}");
        assert!((1000..1300).contains(&wins[1]), "{wins:?}");
        assert_eq!(wins[2], 0, "{wins:?}");
        // No temperature: the plain minimum.
        for _ in 0..100 {
            assert_eq!(
                sample([(0, 100.0), (1, 105.0)], 0.0, &mut rng),
                Some((0, Some(1)))
            );
        }
        assert_eq!(sample(Vec::<(usize, f64)>::new(), 0.1, &mut rng), None);
        assert_eq!(sample([(4, 1.0)], 0.1, &mut rng), Some((4, None)));
    }

    fn cand(matched: u32, requests: u32, prefill: u64) -> Candidate {
        Candidate {
            matched: [matched; 3],
            dp_rank: 0,
            in_flight_requests: requests,
            in_flight_prefill_tokens: prefill,
        }
    }

    #[test]
    fn longest_match_wins_when_idle() {
        let c = [cand(2, 0, 0), cand(10, 0, 0), cand(0, 0, 0)];
        let choice = pick(&c, 16, 16, &Weights::default(), &mut SplitMix64(1)).unwrap();
        assert_eq!(choice.best, 1);
        assert_eq!(choice.runner_up, Some(0));
        assert_eq!(choice.matched_blocks, 10);
    }

    #[test]
    fn a_loaded_best_match_loses_to_an_idle_instance() {
        // 10 cached blocks save 160 tokens; 1,000 tokens of queued prefill cost more.
        let c = [cand(10, 4, 1000), cand(0, 0, 0)];
        let choice = pick(&c, 16, 16, &Weights::default(), &mut SplitMix64(1)).unwrap();
        assert_eq!(choice.best, 1);
        assert_eq!(choice.runner_up, Some(0));
    }

    #[test]
    fn no_match_anywhere_falls_back() {
        assert_eq!(
            pick(
                &[cand(0, 0, 0), cand(0, 3, 10)],
                8,
                16,
                &Weights::default(),
                &mut SplitMix64(1)
            ),
            None
        );
        assert_eq!(
            pick(&[], 8, 16, &Weights::default(), &mut SplitMix64(1)),
            None
        );
    }

    #[test]
    fn exact_ties_are_spread() {
        let c = [cand(4, 0, 0), cand(4, 0, 0), cand(4, 0, 0), cand(1, 0, 0)];
        let mut rng = SplitMix64(7);
        let mut wins = [0u32; 4];
        for _ in 0..3000 {
            let choice = pick(&c, 8, 16, &Weights::default(), &mut rng).unwrap();
            wins[choice.best] += 1;
            assert_ne!(choice.runner_up, Some(choice.best));
            assert!(
                choice.runner_up.is_some_and(|r| r < 3),
                "a tied candidate is the runner-up"
            );
        }
        assert_eq!(wins[3], 0);
        for w in &wins[..3] {
            assert!((800..1200).contains(w), "{wins:?}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_choice() {
        let c = [cand(4, 0, 0), cand(4, 0, 0)];
        let a: Vec<usize> = (0..20)
            .scan(SplitMix64(3), |r, _| {
                pick(&c, 8, 16, &Weights::default(), r).map(|x| x.best)
            })
            .collect();
        let b: Vec<usize> = (0..20)
            .scan(SplitMix64(3), |r, _| {
                pick(&c, 8, 16, &Weights::default(), r).map(|x| x.best)
            })
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn slower_tiers_earn_less_credit() {
        let gpu = Candidate {
            matched: [8, 8, 8],
            ..Candidate::default()
        };
        let disk = Candidate {
            matched: [0, 0, 8],
            ..Candidate::default()
        };
        let choice = pick(&[disk, gpu], 8, 16, &Weights::default(), &mut SplitMix64(1)).unwrap();
        assert_eq!(choice.best, 1);
        assert_eq!(credit([2, 4, 8], &Weights::default()), 2.0 + 1.5 + 1.0);
    }

    #[test]
    fn ranks_fold_to_the_best_one() {
        let (matched, rank) = fold_ranks(
            [(0, [1, 1, 1]), (1, [0, 0, 6]), (2, [3, 3, 3])],
            &Weights::default(),
        );
        assert_eq!((matched, rank), ([3, 3, 3], 2));
    }
}
