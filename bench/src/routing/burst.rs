//! Scenario (c), the hot-prefix burst, as a Mooncake-format trace: one request caches a long
//! system prompt on one engine, then many requests sharing it (distinct short tails) arrive
//! together, then cold requests follow. A router that always takes the longest match sends the
//! whole burst to the one holder and queues it there; a router that weighs the queue spreads
//! it once the holder's queue costs more than recomputing the prefix elsewhere.

use kvroute_sim::trace::TraceRecord;

/// Tokens per trace block (Mooncake's `hash_ids` are 512-token blocks).
const TRACE_BLOCK: usize = 512;
/// Block ids of the burst start here, far above the Mooncake trace's, so the two never share.
const ID_BASE: u64 = 1 << 40;

/// Shape of the burst.
#[derive(Clone, Copy, Debug)]
pub struct BurstShape {
    /// Requests sharing the system prompt.
    pub requests: usize,
    /// Length of the shared system prompt, tokens (rounded up to whole 512-token blocks).
    pub shared_tokens: usize,
    /// Distinct tail per request, tokens.
    pub tail_tokens: usize,
    /// Cold requests after the burst.
    pub cold: usize,
    /// Prompt length of a cold request, tokens.
    pub cold_tokens: usize,
    /// Output tokens of every request.
    pub output_tokens: usize,
}

/// The burst's trace, in arrival order (milliseconds of simulated time):
/// - t = 0: one request with the shared prompt (it lands on one engine, whose KV events
///   publish the prefix before the burst);
/// - t = 2 s: `requests` requests over 0.5 s (together, for any engine's prefill);
/// - t = 3 s onwards: `cold` requests with prompts never seen, one every 100 ms.
pub fn trace(s: &BurstShape) -> Vec<TraceRecord> {
    let shared_blocks = s.shared_tokens.div_ceil(TRACE_BLOCK).max(1);
    let shared: Vec<u64> = (0..shared_blocks as u64).map(|b| ID_BASE + b).collect();
    let tail_blocks = s.tail_tokens.div_ceil(TRACE_BLOCK).max(1);
    let mut next_id = ID_BASE + shared_blocks as u64;
    let mut fresh = |n: usize| -> Vec<u64> {
        let ids = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        ids
    };
    let mut out = Vec::with_capacity(1 + s.requests + s.cold);
    let seed_tail = fresh(1);
    out.push(TraceRecord {
        timestamp: 0,
        input_length: shared_blocks * TRACE_BLOCK + 16,
        output_length: s.output_tokens,
        hash_ids: [shared.clone(), seed_tail].concat(),
    });
    let spread_ms = 500u64;
    for i in 0..s.requests {
        let tail = fresh(tail_blocks);
        out.push(TraceRecord {
            timestamp: 2_000 + spread_ms * i as u64 / s.requests.max(1) as u64,
            input_length: shared_blocks * TRACE_BLOCK + s.tail_tokens,
            output_length: s.output_tokens,
            hash_ids: [shared.clone(), tail].concat(),
        });
    }
    let cold_blocks = s.cold_tokens.div_ceil(TRACE_BLOCK).max(1);
    for i in 0..s.cold {
        out.push(TraceRecord {
            timestamp: 3_000 + 100 * i as u64,
            input_length: s.cold_tokens,
            output_length: s.output_tokens,
            hash_ids: fresh(cold_blocks),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_shares_the_prefix_and_cold_requests_share_nothing() {
        let t = trace(&BurstShape {
            requests: 8,
            shared_tokens: 8192,
            tail_tokens: 1024,
            cold: 4,
            cold_tokens: 2048,
            output_tokens: 32,
        });
        assert_eq!(t.len(), 13);
        let shared = &t[0].hash_ids[..16];
        for r in &t[1..9] {
            assert_eq!(&r.hash_ids[..16], shared);
            assert_eq!(r.input_length, 8192 + 1024);
            assert!(r.timestamp >= 2_000 && r.timestamp < 2_500);
        }
        let cold: Vec<u64> = t[9..].iter().flat_map(|r| r.hash_ids.clone()).collect();
        let mut all: Vec<u64> = t[1..9]
            .iter()
            .flat_map(|r| r.hash_ids[16..].to_vec())
            .collect();
        all.extend(&cold);
        assert!(cold.iter().all(|id| !shared.contains(id)));
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "tails and cold prompts are all distinct");
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    }
}
