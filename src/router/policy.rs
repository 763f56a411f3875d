//! The decision's knobs beyond the cost weights: what a cold request gets, when an engine is
//! saturated, what a hit may buy, how replicas break near-ties (see [`super`]).

use super::load::{InstanceLoad, Replica};
use crate::select::Weights;

/// What to do with a request no eligible instance holds a block of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
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
    /// Engine KV usage, per mille, at which it is saturated.
    pub max_kv_permille: u16,
    /// Most queued prefill tokens above the least queued contender's that a cache hit may
    /// buy; past it the hit earns no credit. `None`: unbounded.
    pub max_hit_queue_tokens: Option<u64>,
    /// 0: the cheapest contender wins (seeded random among exact ties). Above 0: the winner
    /// is drawn with odds falling with its cost's distance from the cheapest, relative to it
    /// ([`select::sample`](crate::select::sample)): gateway replicas deciding on the same slightly stale load spread
    /// their picks.
    pub temperature: f64,
    /// Cost, in blocks, within which a contender of this replica's share (sized by its part
    /// of the traffic, [`Replica::share`]) is preferred to a cheaper one outside it (see the
    /// module docs); 0: no affinity.
    pub replica_tie_band: f64,
    /// Which gateway replica decides, out of how many (the collector's count of live ones).
    pub replica: Replica,
}

/// Default [`Policy::replica_tie_band`]: two blocks of cost, the cost of two in-flight
/// requests or 32 tokens of queued prefill — nothing a prompt's time to first token feels.
/// Two gateways deciding at the same instant see the same costs; splitting the engines within
/// this much of the cheapest by share is what keeps them off the same one (at half a block,
/// engines apart by one decoding request were no tie, and two gateways over 16 engines queued
/// short prompts behind each other's long ones: scale scenario TTFT p50 240–350 ms against
/// 90–100 ms at two blocks, the uneven 80/20 split 580–650 against 450–530 ms).
/// What breaks it: engines whose few running requests do slow a prefill (a batch of 2–4
/// sequences): there two more requests are a real queue, and a band below one request's
/// weight (`< 1.0`) is right. Past a few blocks it stops being a tie-break and queues work on
/// a share that is busier than the rest.
pub const REPLICA_TIE_BAND: f64 = 2.0;

impl Default for Policy {
    fn default() -> Self {
        Policy {
            weights: Weights::default(),
            cold: Cold::Decide,
            max_waiting: 8,
            max_kv_permille: 980,
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
            .is_some_and(|e| e.waiting >= self.max_waiting || e.kv_permille >= self.max_kv_permille)
    }
}

/// Widest [`Policy::replica_tie_band`] accepted: a wider band is no tie-break but a second
/// policy that can outweigh real load.
pub const MAX_REPLICA_TIE_BAND: f64 = 64.0;

/// Highest [`Policy::temperature`] accepted.
pub const MAX_TEMPERATURE: f64 = 10.0;

/// The policy's knobs as configuration, each optional (absent: [`Policy::default`]'s), and
/// their checks in one place ([`PolicyConfig::validate`]). The JS package reads it as it is
/// (the camelCase spellings are accepted); the filter fills it from its `weights`, `load` and
/// `route` sections. `max_hit_queue_tokens` absent or null: unbounded, the default.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Credit per matched GPU block.
    pub gpu: Option<f64>,
    /// Credit per matched CPU block.
    pub cpu: Option<f64>,
    /// Credit per matched disk block.
    pub disk: Option<f64>,
    /// Weight of prefill blocks in the cost.
    pub overlap: Option<f64>,
    /// Blocks of cost per in-flight request.
    pub request: Option<f64>,
    /// `"decide"` or `"defer"`.
    pub cold: Option<Cold>,
    /// Waiting queue at which an engine is saturated.
    #[serde(alias = "maxWaiting")]
    pub max_waiting: Option<u32>,
    /// KV usage, 0 to 1, at which an engine is saturated.
    #[serde(alias = "maxKvUsage")]
    pub max_kv_usage: Option<f64>,
    /// Hot-spot guard in tokens.
    #[serde(alias = "maxHitQueueTokens")]
    pub max_hit_queue_tokens: Option<u64>,
    /// 0 to [`MAX_TEMPERATURE`].
    pub temperature: Option<f64>,
    /// 0 to [`MAX_REPLICA_TIE_BAND`] blocks of cost.
    #[serde(alias = "replicaTieBand")]
    pub replica_tie_band: Option<f64>,
}

/// A knob out of range: which one (its [`PolicyConfig`] field name) and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{knob}: {reason}")]
pub struct PolicyError {
    /// The field of [`PolicyConfig`].
    pub knob: &'static str,
    /// What it must be.
    pub reason: &'static str,
}

impl PolicyConfig {
    /// The policy these knobs give, the replica share left at one replica (the caller sets it
    /// per decision).
    ///
    /// # Errors
    /// [`PolicyError`] naming the first knob out of range.
    pub fn validate(&self) -> Result<Policy, PolicyError> {
        let d = Policy::default();
        let w = d.weights;
        let weight = |knob: &'static str, v: Option<f64>, default: f64| match v {
            Some(v) if !v.is_finite() || v < 0.0 => Err(PolicyError {
                knob,
                reason: "must be a finite number >= 0",
            }),
            v => Ok(v.unwrap_or(default)),
        };
        let weights = Weights {
            tiers: [
                weight("gpu", self.gpu, w.tiers[0])?,
                weight("cpu", self.cpu, w.tiers[1])?,
                weight("disk", self.disk, w.tiers[2])?,
            ],
            overlap: weight("overlap", self.overlap, w.overlap)?,
            request: weight("request", self.request, w.request)?,
        };
        let in_range = |knob, v: Option<f64>, default: f64, max: f64, reason| match v {
            Some(v) if !(0.0..=max).contains(&v) => Err(PolicyError { knob, reason }),
            v => Ok(v.unwrap_or(default)),
        };
        let kv = in_range(
            "max_kv_usage",
            self.max_kv_usage,
            d.kv_usage_limit(),
            1.0,
            "must be between 0 and 1",
        )?;
        Ok(Policy {
            weights,
            cold: self.cold.unwrap_or(d.cold),
            max_waiting: self.max_waiting.unwrap_or(d.max_waiting),
            max_kv_permille: (kv * 1000.0).round() as u16,
            max_hit_queue_tokens: self.max_hit_queue_tokens.or(d.max_hit_queue_tokens),
            temperature: in_range(
                "temperature",
                self.temperature,
                d.temperature,
                MAX_TEMPERATURE,
                "must be between 0 and 10",
            )?,
            replica_tie_band: in_range(
                "replica_tie_band",
                self.replica_tie_band,
                d.replica_tie_band,
                MAX_REPLICA_TIE_BAND,
                "must be between 0 and 64 blocks of cost (0 turns replica affinity off)",
            )?,
            replica: d.replica,
        })
    }
}

impl Policy {
    /// [`Policy::max_kv_permille`] as a fraction.
    pub fn kv_usage_limit(&self) -> f64 {
        f64::from(self.max_kv_permille) / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_knob_is_the_default_policy() {
        assert_eq!(PolicyConfig::default().validate(), Ok(Policy::default()));
    }

    #[test]
    fn knobs_read_in_both_spellings_and_convert_once() {
        let c: PolicyConfig = serde_json::from_str(
            r#"{"gpu": 2, "cold": "defer", "maxWaiting": 3, "max_kv_usage": 0.5,
                "maxHitQueueTokens": 4096, "temperature": 0.2, "replicaTieBand": 0}"#,
        )
        .unwrap();
        let p = c.validate().unwrap();
        assert_eq!(p.weights.tiers[0], 2.0);
        assert_eq!(p.cold, Cold::Defer);
        assert_eq!((p.max_waiting, p.max_kv_permille), (3, 500));
        assert_eq!(p.max_hit_queue_tokens, Some(4096));
        assert_eq!((p.temperature, p.replica_tie_band), (0.2, 0.0));
        assert!(serde_json::from_str::<PolicyConfig>(r#"{"cold": "later"}"#).is_err());
        assert!(serde_json::from_str::<PolicyConfig>(r#"{"colder": "defer"}"#).is_err());
    }

    #[test]
    fn each_bad_knob_is_named() {
        let bad = |c: PolicyConfig| c.validate().unwrap_err().knob;
        let c = PolicyConfig::default;
        assert_eq!(
            bad(PolicyConfig {
                gpu: Some(-1.0),
                ..c()
            }),
            "gpu"
        );
        assert_eq!(
            bad(PolicyConfig {
                request: Some(f64::NAN),
                ..c()
            }),
            "request"
        );
        assert_eq!(
            bad(PolicyConfig {
                overlap: Some(f64::INFINITY),
                ..c()
            }),
            "overlap"
        );
        assert_eq!(
            bad(PolicyConfig {
                max_kv_usage: Some(1.5),
                ..c()
            }),
            "max_kv_usage"
        );
        assert_eq!(
            bad(PolicyConfig {
                temperature: Some(-1.0),
                ..c()
            }),
            "temperature"
        );
        assert_eq!(
            bad(PolicyConfig {
                temperature: Some(11.0),
                ..c()
            }),
            "temperature"
        );
        assert_eq!(
            bad(PolicyConfig {
                replica_tie_band: Some(65.0),
                ..c()
            }),
            "replica_tie_band"
        );
    }
}
