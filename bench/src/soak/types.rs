//! The soak's flags, constants and the counters its tasks share.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use serde::Serialize;

/// Flags of `kvroute-bench soak`.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakArgs {
    /// Length of the run.
    #[arg(long, default_value_t = 30.0)]
    pub(super) minutes: f64,
    /// Simulated engines publishing valid events.
    #[arg(long, default_value_t = 64)]
    pub(super) engines: usize,
    /// The collector binary [default: $CARGO_TARGET_DIR/native/kvroute-collector].
    #[arg(long)]
    pub(super) collector: Option<PathBuf>,
    /// Where soak.json and soak.md go.
    #[arg(long, default_value = "bench-out/soak")]
    pub(super) out: PathBuf,
    /// Blocks one engine's cache holds; past it the engine evicts its oldest.
    #[arg(long, default_value_t = 8192)]
    pub(super) engine_blocks: usize,
    /// Mean interval between one engine's batches, milliseconds.
    #[arg(long, default_value_t = 250)]
    pub(super) batch_ms: u64,
    /// `/query` requests per second (one client).
    #[arg(long, default_value_t = 50)]
    pub(super) query_rate: u64,
    /// The collector's `--max-zmq-message-bytes`.
    #[arg(long, default_value_t = 1 << 20)]
    pub(super) max_zmq_message_bytes: usize,
    /// Mean seconds between hostile peers.
    #[arg(long, default_value_t = 6.0)]
    pub(super) hostile_every: f64,
    /// Seed of the workload's randomness.
    #[arg(long, default_value_t = 11)]
    pub(super) seed: u64,
}

pub(super) const MODEL: &str = "soak-model";
pub(super) const BS: usize = 16;
/// System prompts the fleet's prompts start with, so queries find shared prefixes.
pub(super) const PREFIXES: u32 = 64;

/// One second's sample.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Sample {
    pub(super) t: f64,
    pub(super) rss_kib: u64,
    pub(super) health: u16,
    pub(super) query: u16,
}

/// What the clients saw, counted as they go.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) batches: AtomicU64,
    pub(super) stores: AtomicU64,
    pub(super) removals: AtomicU64,
    pub(super) clears: AtomicU64,
    pub(super) queries_ok: AtomicU64,
    pub(super) queries_failed: AtomicU64,
    pub(super) queries_matched: AtomicU64,
    pub(super) feed_pages: AtomicU64,
    pub(super) feed_failed: AtomicU64,
    pub(super) feed_resets: AtomicU64,
    pub(super) query_us: Mutex<Vec<u32>>,
    pub(super) hostile: Mutex<Vec<(f64, &'static str, String)>>,
}

pub(super) const KINDS: [&str; 7] = [
    "zmq_header_2^62",
    "zmq_oversized_frame",
    "alias_flood",
    "dp_rank_flood",
    "half_sent_headers",
    "slow_bodies",
    "bad_load_reports",
];
