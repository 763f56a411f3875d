//! The workloads of the scenarios beyond the trace as recorded: the trace with long outputs
//! (`decode-heavy`), the arrival rate that keeps a fleet at a given prefill utilisation
//! (`scale`), and a shared-system-prompt workload after llm-d's capacity test
//! (`shared-prefix`).

use kvroute_sim::trace::TraceRecord;

/// Tokens per trace block (Mooncake's `hash_ids` are 512-token blocks).
const TRACE_BLOCK: usize = 512;
/// Block ids of the shared-prefix workload start here, far above the trace's and the burst's.
const SHARED_ID_BASE: u64 = 1 << 41;
/// Longest output a stretched request gets, tokens (prompt + output stay within the engines'
/// `max_model_len` of 131,072).
const MAX_OUTPUT_TOKENS: usize = 16_384;

/// The engines' per-request costs the workloads are shaped against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineRates {
    /// Prefill throughput, tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// Simulated seconds per output token.
    pub decode_s_per_token: f64,
}

/// The records' total decode time over their total (uncached) prefill time, on `r`.
pub fn decode_over_prefill(records: &[TraceRecord], r: EngineRates) -> f64 {
    let prefill: f64 = records
        .iter()
        .map(|x| x.input_length as f64 / r.prefill_tokens_per_s.max(1.0))
        .sum();
    let decode: f64 = records
        .iter()
        .map(|x| x.output_length as f64 * r.decode_s_per_token)
        .sum();
    if prefill > 0.0 {
        decode / prefill
    } else {
        0.0
    }
}

/// The records with every `output_length` stretched by one factor, so that their total decode
/// time is `ratio` times their total prefill time (each output at least 1 token, at most
/// [`MAX_OUTPUT_TOKENS`]); returns them and the factor. Prompts and arrivals are unchanged,
/// so the prefill load and the prefix reuse are the trace's: only requests stay on their
/// engine (holding their blocks and a request slot) for longer.
pub fn decode_heavy(
    records: &[TraceRecord],
    r: EngineRates,
    ratio: f64,
) -> (Vec<TraceRecord>, f64) {
    let now = decode_over_prefill(records, r);
    let factor = if now > 0.0 { ratio / now } else { 1.0 };
    let out = records
        .iter()
        .map(|x| TraceRecord {
            output_length: ((x.output_length as f64 * factor).round() as usize)
                .clamp(1, MAX_OUTPUT_TOKENS),
            ..x.clone()
        })
        .collect();
    (out, factor)
}

/// The arrival-rate multiplier (`--rate-scale`) at which `records` ask `target` of a fleet's
/// prefill capacity (`capacity_tokens_per_s`, all engines together), counting every prompt
/// token as computed: the trace's hits are a few percent, so the measured utilisation lands a
/// little below `target`.
pub fn rate_for_utilization(
    records: &[TraceRecord],
    capacity_tokens_per_s: f64,
    target: f64,
) -> f64 {
    let (Some(first), Some(last)) = (records.first(), records.last()) else {
        return 1.0;
    };
    let span_s = last.timestamp.saturating_sub(first.timestamp) as f64 / 1000.0;
    let tokens: f64 = records.iter().map(|x| x.input_length as f64).sum();
    if span_s <= 0.0 || tokens <= 0.0 {
        return 1.0;
    }
    target * capacity_tokens_per_s * span_s / tokens
}

/// The shape of the shared-prefix workload (llm-d's capacity test, scaled down): `groups`
/// system prompts, `users` per group each with a question of their own, requests drawing a
/// (group, user) uniformly at random, Poisson arrivals whose rate steps up stage by stage.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefixShape {
    pub groups: usize,
    pub users_per_group: usize,
    /// System prompt per group, tokens (rounded up to whole 512-token blocks).
    pub system_tokens: usize,
    /// Each user's question, tokens (rounded up likewise).
    pub question_tokens: usize,
    pub output_tokens: usize,
    /// Requests in all; each stage gets an equal share.
    pub requests: usize,
    /// Mean arrival rate of each stage, requests per simulated second, in order.
    pub stage_rates: Vec<f64>,
    pub seed: u64,
}

/// The shared-prefix workload as a trace. Requests of one (group, user) repeat its prompt
/// exactly; requests of one group share its system prompt's blocks.
pub fn shared_prefix(s: &SharedPrefixShape) -> Vec<TraceRecord> {
    let sys_blocks = s.system_tokens.div_ceil(TRACE_BLOCK).max(1);
    let q_blocks = s.question_tokens.div_ceil(TRACE_BLOCK).max(1);
    let users = s.users_per_group.max(1);
    let groups = s.groups.max(1);
    let group_ids = |g: usize| {
        let base = SHARED_ID_BASE + (g * sys_blocks) as u64;
        (base..base + sys_blocks as u64).collect::<Vec<u64>>()
    };
    let q_base = SHARED_ID_BASE + (groups * sys_blocks) as u64;
    let question_ids = |g: usize, u: usize| {
        let base = q_base + ((g * users + u) * q_blocks) as u64;
        (base..base + q_blocks as u64).collect::<Vec<u64>>()
    };
    let mut rng = fastrand::Rng::with_seed(s.seed);
    let stages = s.stage_rates.len().max(1);
    let per_stage = s.requests.div_ceil(stages);
    let mut t_s = 0.0f64;
    let mut out = Vec::with_capacity(s.requests);
    for i in 0..s.requests {
        let rate = s
            .stage_rates
            .get(i / per_stage.max(1))
            .copied()
            .unwrap_or(1.0)
            .max(1e-6);
        // Exponential gaps: a Poisson process at this stage's rate.
        t_s += -(1.0 - rng.f64()).ln() / rate;
        let (g, u) = (rng.usize(..groups), rng.usize(..users));
        out.push(TraceRecord {
            timestamp: (t_s * 1000.0) as u64,
            input_length: (sys_blocks + q_blocks) * TRACE_BLOCK,
            output_length: s.output_tokens.max(1),
            hash_ids: [group_ids(g), question_ids(g, u)].concat(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATES: EngineRates = EngineRates {
        prefill_tokens_per_s: 20_000.0,
        decode_s_per_token: 0.008,
    };

    fn rec(t_ms: u64, input: usize, output: usize) -> TraceRecord {
        TraceRecord {
            timestamp: t_ms,
            input_length: input,
            output_length: output,
            hash_ids: vec![t_ms],
        }
    }

    #[test]
    fn the_decode_heavy_slice_decodes_ratio_times_its_prefill() {
        // 20,000 prompt tokens: 1 s of prefill; 25 output tokens: 0.2 s of decode.
        let records = [rec(0, 8_000, 10), rec(1_000, 12_000, 15)];
        assert!((decode_over_prefill(&records, RATES) - 0.2).abs() < 1e-9);
        let (heavy, factor) = decode_heavy(&records, RATES, 1.0);
        assert!((factor - 5.0).abs() < 1e-9, "{factor}");
        assert_eq!(
            heavy.iter().map(|r| r.output_length).collect::<Vec<_>>(),
            [50, 75]
        );
        assert!((decode_over_prefill(&heavy, RATES) - 1.0).abs() < 1e-9);
        // Prompts and arrivals stay the trace's.
        for (h, r) in heavy.iter().zip(&records) {
            assert_eq!(
                (h.timestamp, h.input_length, &h.hash_ids),
                (r.timestamp, r.input_length, &r.hash_ids)
            );
        }
        let (ten, _) = decode_heavy(&records, RATES, 10.0);
        assert!((decode_over_prefill(&ten, RATES) - 10.0).abs() < 0.01);
    }

    #[test]
    fn the_rate_scale_asks_the_target_share_of_prefill_capacity() {
        // 100 s of trace asking 400,000 tokens: 4,000 tokens/s.
        let records = [rec(0, 200_000, 1), rec(100_000, 200_000, 1)];
        // 16 engines × 20,000 tokens/s at 60 %: 192,000 tokens/s, 48× the trace's rate.
        let s = rate_for_utilization(&records, 16.0 * 20_000.0, 0.6);
        assert!((s - 48.0).abs() < 1e-9, "{s}");
        assert_eq!(rate_for_utilization(&[], 1.0, 0.6), 1.0);
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt_and_rates_step_up() {
        let s = SharedPrefixShape {
            groups: 3,
            users_per_group: 2,
            system_tokens: 2048,
            question_tokens: 512,
            output_tokens: 100,
            requests: 400,
            stage_rates: vec![1.0, 4.0],
            seed: 7,
        };
        let t = shared_prefix(&s);
        assert_eq!(t.len(), 400);
        assert!(t
            .iter()
            .all(|r| r.hash_ids.len() == 5 && r.input_length == 5 * 512));
        let mut systems: Vec<&[u64]> = t.iter().map(|r| &r.hash_ids[..4]).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3, "one system prompt per group");
        let mut prompts: Vec<&Vec<u64>> = t.iter().map(|r| &r.hash_ids).collect();
        prompts.sort();
        prompts.dedup();
        assert_eq!(prompts.len(), 6, "one prompt per user");
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        // The second stage arrives about four times as fast.
        let span = |r: &[TraceRecord]| (r[r.len() - 1].timestamp - r[0].timestamp) as f64;
        let ratio = span(&t[..200]) / span(&t[200..]);
        assert!((2.5..6.0).contains(&ratio), "{ratio}");
        assert_eq!(shared_prefix(&s), t, "seeded");
    }
}
