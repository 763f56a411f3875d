//! The decision's knobs beyond the cost weights: what a cold request gets, when an engine is
//! saturated, what a hit may buy, how replicas break near-ties (see [`super`]).

use super::load::{InstanceLoad, Replica};
use crate::select::Weights;

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
