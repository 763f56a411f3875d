//! The routing decision in one place: matches, instances and load in, a ranked choice and its
//! booking out. No I/O of its own and no clock: shared data is read through the
//! [`Store`](crate::mirror::Store) trait (host calls in the filter, a map natively), and the
//! caller hands over the collector's `/query` answer in remote mode.
//!
//! | module | concern |
//! |---|---|
//! | `load` | the decision's units: [`Counts`], [`InstanceLoad`], [`EngineLoad`], [`Replica`] and its [`Share`], [`fleet_view`] |
//! | `picture` | the load of one decision read once from shared data ([`Picture`]) |
//! | `matches` | where matches come from, in one form: [`answer_on_roster`], [`remote_contenders`], [`hold`] |
//! | `roster` | live workers grouped by instance ([`Roster`]) and local contenders |
//! | `policy` | the knobs ([`Policy`], [`Cold`]) and their configuration ([`PolicyConfig`]) |
//! | `decide` | contenders → [`Decision`] ([`decide`]) |
//! | `book` | the booking of a routed request and its releases ([`Books`]) |
//!
//! [`route`] is the entry every caller takes (the filter's token, text and remote paths, the
//! bench's in-process kvroute, the JS package): candidates + picture + policy → a [`Choice`].
//!
//! One policy for both modes:
//!
//! 1. **Fold dp ranks.** Each instance competes once, with its best dp rank: the rank with
//!    the most [`credit`](crate::select::credit), the first one offered on a tie ([`Contender::offer`]).
//! 2. **Eligibility.** Only instances serving the request's `(tenant, model)` compete
//!    ([`Instance::serves`]); the others are kept in the slice so indices stay stable.
//! 3. **Cost and pick.** [`select::pick`](crate::select::pick) ranks the eligible ones by cost (cached blocks
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
//!   `max_waiting` or more, or KV usage of `max_kv_permille` or more, competes only with a cache
//!   hit for this request while an unsaturated eligible instance exists. Without a hit it
//!   would only add to a queue the engine already cannot drain.
//! - **Hot-spot guard** ([`Policy::max_hit_queue_tokens`]): a hit buys at most that much queue.
//!   A contender whose queued prefill exceeds the least queued one's by more loses its cache
//!   credit and competes as if cold, so one popular prefix cannot bury its holder.
//!
//! - **Temperature** ([`Policy::temperature`], off by default): the winner is drawn among the
//!   contenders with odds that fall with their cost's distance from the cheapest, so gateway
//!   replicas deciding on the same slightly stale load do not all pick the same engine.
//! - **Replica affinity** ([`Policy::replica_tie_band`], [`Replica`], [`preferred`]): with
//!   `n` gateway replicas, each breaks near-ties in favour of its own [`Share`] of the
//!   instances: a run of the shared instance order as wide as its part of the gateways'
//!   requests in flight (half each when idle or evenly split; 80 % of the fleet for a replica
//!   carrying 80 % of the traffic). A replica learns of the others' bookings only through the
//!   collector, one or two sync periods late; on an idle or evenly loaded fleet every replica
//!   would see the same exact ties, and affinity makes them pick different engines, while a
//!   share sized by traffic keeps a busy replica from piling its requests onto a fixed half.
//!   Engines tied on a hit stay a random pick. It is only a tie-breaker: the winner's cost is
//!   never more than the band above the cheapest contender's (two blocks by default: two
//!   in-flight requests or 32 queued tokens), so no replica count or share can send a
//!   request to an engine with more than that much work ahead while another is free.
//!
//! The load a contender carries comes from [`fleet_view`] when the caller knows the fleet's
//! totals: what every gateway reported, minus this gateway's own last report (already in the
//! totals), plus its own current count (fresher than the report).

mod book;
mod decide;
pub mod load;
mod matches;
mod peers;
mod picture;
mod policy;
mod roster;

pub use book::{BookError, Booked, Books};
pub use decide::{costs, decide, preferred, rank_by, Contender, Decision, Query, RankRule};
pub use load::{fleet_view, Counts, EngineLoad, InstanceLoad, Replica, Share};
pub use matches::{
    answer_on_roster, hold, remember, remote_contenders, speculative, SpecRead,
    SPECULATIVE_ENTRIES, SPECULATIVE_SHARDS,
};
pub use peers::{own_holds, take_peer_holds, PeerHold, Taken};
pub use picture::{Picture, PictureConfig};
pub use policy::{
    Cold, Policy, PolicyConfig, PolicyError, MAX_REPLICA_TIE_BAND, MAX_TEMPERATURE,
    REPLICA_TIE_BAND,
};
pub use roster::{Instance, Roster, Slot};

use crate::api::QueryResponse;
use crate::lookup::WorkerMatch;
use crate::mirror::LoadId;
use crate::select::Random;

/// Who competes for a request.
#[derive(Clone, Copy, Debug)]
pub enum Field<'a> {
    /// Every instance of the local roster serving `(tenant, model)`, with the matches per
    /// worker slot (the index walk, speculative holders, the text table, or the collector's
    /// answer mapped onto slots by [`answer_on_roster`]); booked per worker slot.
    Roster {
        /// The mirror's live workers by instance.
        roster: &'a Roster,
        /// Matched blocks per worker slot.
        matches: &'a [WorkerMatch],
        /// The request's tenant.
        tenant: &'a str,
        /// Its model, as the index names it (aliases resolved).
        model: &'a str,
    },
    /// The instances of the collector's `/query` answer (remote mode), all eligible; booked
    /// per instance.
    Answer(&'a QueryResponse),
}

/// Where a decided request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The instance's id.
    pub instance: String,
    /// Its address (`host:port`): the destination header's value.
    pub address: String,
    /// The runner-up's address, the gateway's fallback.
    pub runner_up: Option<String>,
    /// The rank header's value, for an instance with several dp ranks.
    pub dp_rank: Option<u32>,
    /// The load entry the request is booked on.
    pub load_id: LoadId,
}

/// What became of a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Send it to `target`.
    Route {
        /// The ranking's result.
        decision: Decision,
        /// Where to.
        target: Target,
    },
    /// Some instance could take it but the policy leaves it to the gateway's own balancing
    /// ([`Cold::Defer`]).
    Deferred,
    /// No instance serves the request.
    NoMatch,
}

/// A decision with what it was made on, for callers that explain it.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// One per instance (roster or answer order), with its match and load.
    pub contenders: Vec<Contender>,
    /// The outcome.
    pub verdict: Verdict,
    /// The policy applied (the base one with this gateway's replica place).
    pub policy: Policy,
}

/// The decision of one request: contenders from `field` with their load from `picture`,
/// ranked under `base` (with the replica place the picture knows), ties broken by `rng`.
pub fn route(
    field: Field<'_>,
    query: Query,
    picture: &Picture,
    base: &Policy,
    rng: &mut impl Random,
) -> Choice {
    let policy = picture.policy(base);
    let contenders: Vec<Contender> = match field {
        Field::Roster {
            roster,
            matches,
            tenant,
            model,
        } => roster.contenders(
            matches,
            tenant,
            model,
            |id| picture.load(id),
            &policy.weights,
        ),
        Field::Answer(resp) => remote_contenders(resp, |id| picture.load(id))
            .into_iter()
            .map(|(c, _)| c)
            .collect(),
    };
    let verdict = match decide(&contenders, query, &policy, rng) {
        Some(d) => match target(field, &d) {
            Some(target) => Verdict::Route {
                decision: d,
                target,
            },
            None => Verdict::NoMatch,
        },
        None if contenders.iter().any(|c| c.eligible) => Verdict::Deferred,
        None => Verdict::NoMatch,
    };
    Choice {
        contenders,
        verdict,
        policy,
    }
}

/// Where decision `d` over `field`'s contenders (in the same order) sends the request.
fn target(field: Field<'_>, d: &Decision) -> Option<Target> {
    // (instance id, address, several dp ranks, load entry) of the `i`-th contender.
    let place = |i: usize| -> Option<(&str, &str, bool, LoadId)> {
        match field {
            Field::Roster { roster, .. } => {
                let inst = roster.instances.get(i)?;
                let slot = inst.slot_of_rank(if i == d.best { d.dp_rank } else { 0 })?;
                Some((
                    &inst.id,
                    &inst.address,
                    inst.is_multi_rank(),
                    LoadId::slot(slot),
                ))
            }
            Field::Answer(resp) => {
                let (id, m) = resp.instances.iter().nth(i)?;
                Some((id, &m.address, m.dp.len() > 1, LoadId::instance(id)))
            }
        }
    };
    let (id, address, multi, load_id) = place(d.best)?;
    Some(Target {
        instance: id.to_owned(),
        address: address.to_owned(),
        runner_up: d
            .runner_up
            .and_then(place)
            .map(|p| p.1)
            .filter(|r| !r.is_empty() && *r != address)
            .map(str::to_owned),
        dp_rank: multi.then_some(d.dp_rank),
        load_id,
    })
}

/// A routed request's decision in short, as the filter's debug header carries it: who won at
/// what cost (blocks of prefill work ahead, the hot-spot guard applied) and the runner-up's.
pub fn summary(decision: &Decision, target: &Target) -> String {
    let mut s = format!("winner={}; cost={:.2}", target.instance, decision.cost);
    if let (Some(r), Some(c)) = (&target.runner_up, decision.runner_up_cost) {
        s.push_str(&format!("; runner_up={r}; runner_up_cost={c:.2}"));
    }
    s
}

impl Target {
    /// The worker slot it is booked on (`None` for an instance of a remote answer).
    pub fn slot(&self) -> Option<u32> {
        self.load_id.as_slot()
    }
}

#[cfg(test)]
mod tests;
