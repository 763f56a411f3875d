//! `POST /v1/explain`: why a request would go where it goes. The body is a `/query` body
//! (token ids, a prompt or chat messages, the model, tenant, LoRA and salt as the filter reads
//! them) with optional `policy` knobs (`kvroute::router::PolicyConfig`, the filter's defaults
//! when absent) and an optional `gateway` (the id a filter reports its load under: the
//! decision then takes that gateway's replica place, as its feed tells it). The answer lays
//! out the scope and block size used, the prompt's block hashes, the gateways' reports the load
//! sums (with their ages), every instance registered for the request's model with its matched
//! tokens per tier, the fleet's load on it and its engine's last sample (with its age), whether
//! it is saturated and whether it competes, its cost and the terms of it, the winner, the
//! runner-up and the instances tied with the winner.
//!
//! The decision is the local-mode filter's, not an approximation of it: the same roster (live
//! workers grouped by instance, in worker-slot order, so the replica shares match), each
//! worker's match per tier folded into its instance's best rank by `Roster::contenders`, and
//! `kvroute::router::decide` over the load the collector holds (the sum of the gateways'
//! reports, engine samples that are not stale).
//!
//! What it cannot show: one gateway's own books since its last report (up to a sync period)
//! and the speculative holders of its recent decisions. With those equal (one request at a
//! time, speculative entries off or expired) the filter's choice is the winner or one of
//! `tied`, at the costs listed here (`filter/tests/explain.rs` checks it on random fleets).
//! A remote-mode gateway differs by design: it decides on its own books alone (the fleet's
//! per-worker totals do not name its per-instance entries) and folds ranks by matched tokens
//! (`RankRule::MostTokens`); this is the local mode's decision, the default one.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute::event::WorkerId;
use kvroute::hash;
use kvroute::mirror::{LoadId, Meta};
use kvroute::router::{
    self, Contender, Counts, InstanceLoad, PolicyConfig, Query, Replica, Roster,
};
use kvroute::scope::{BlockKey, ModelKey};
use kvroute::select::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fleet::{EngineReading, GatewayId, WorkerLoad};
use crate::hub::{Hub, HubError};
use crate::reply::{json, ApiError};
use crate::shared::AppState;
use crate::text::StringOrNumber;

/// The request: a `/query` body plus the policy to explain under.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainRequest {
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default)]
    pub tenant_id: Option<StringOrNumber>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub policy: PolicyConfig,
    /// The gateway whose decision to explain (its `load.gateway_id`): its replica place among
    /// the live gateways breaks near-ties as in its feed. Absent: a gateway deciding alone.
    #[serde(default)]
    pub gateway: Option<String>,
}

/// The answer.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Explanation {
    /// The tenant and model the index was read under (aliases resolved).
    pub tenant: String,
    pub model: String,
    pub block_size: u32,
    pub query_tokens: u64,
    pub query_blocks: u32,
    /// The prompt's chained block hashes, the index's keys (`/query_by_hash`'s `seq_hashes`).
    #[serde(default)]
    pub seq_hashes: Vec<u64>,
    /// The live gateways whose last reports the load below sums, and how old each report is.
    #[serde(default)]
    pub reports: Vec<ReportAge>,
    /// `route` (a winner), `deferred` (cold, and the policy leaves it to the gateway) or
    /// `no_match` (no instance serves the model).
    pub verdict: String,
    pub winner: Option<Pick>,
    pub runner_up: Option<Pick>,
    /// The other instances the decision draws from with the winner (its random source is the
    /// gateway's own seed, so a gateway may pick any of them): those at the winner's cost
    /// (with replicas, those of the same share preference), every competing one when the
    /// policy has a temperature.
    #[serde(default)]
    pub tied: Vec<String>,
    /// The replica place decided under, `index/count` (`0/1` without a `gateway`).
    #[serde(default)]
    pub replica: String,
    /// Every instance serving the model, the winner first, then by cost.
    pub instances: Vec<InstanceExplained>,
    /// The alarms raised now that bear on this request: those about its engines
    /// (`hash_mismatch`, `engine_silent`), its model name (`no_model`) and the gateways
    /// (`text_approximate`, `gateway_mismatch`, `gateway_stale`), each with its likely causes.
    #[serde(default)]
    pub likely_causes: Vec<AlarmExplained>,
}

/// A gateway's last load report and its age.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct ReportAge {
    pub gateway: String,
    pub age_ms: u64,
}

/// A competing instance's cost in its terms: `overlap × (queued_blocks + uncached_blocks) +
/// request × requests`, where `uncached_blocks` is the query's blocks less `credit_blocks`
/// (its match weighted by tier) and `guarded` says the hot-spot guard took the credit away.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct CostTerms {
    pub credit_blocks: f64,
    pub uncached_blocks: f64,
    pub queued_blocks: f64,
    pub requests: u32,
    pub overlap_weight: f64,
    pub request_weight: f64,
    pub guarded: bool,
}

/// One raised alarm as `/v1/explain` shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct AlarmExplained {
    pub alarm: String,
    pub subject: String,
    pub causes: Vec<String>,
    pub reason: String,
}

/// One end of the decision.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Pick {
    pub instance_id: String,
    pub address: String,
    pub cost: f64,
}

/// One instance as the decision saw it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct InstanceExplained {
    pub instance_id: String,
    pub address: String,
    /// Matched tokens of its best dp rank: in GPU memory, in GPU or CPU, in any tier.
    pub matched_tokens: [u64; 3],
    /// The same in blocks, as the cost counts them.
    pub matched_blocks: [u32; 3],
    /// The dp rank holding that match (the rank header's value for a multi-rank instance).
    #[serde(default)]
    pub dp_rank: u32,
    /// Fleet load: requests in flight, uncached prefill and decode tokens booked.
    pub requests: u32,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// The engine's own last sample, `null` when never scraped.
    pub engine: Option<EngineExplained>,
    /// Its sample is over `max_waiting` or `max_kv_usage`.
    pub saturated: bool,
    /// It competed (eligible, and not sitting out saturated without a hit).
    pub competes: bool,
    /// Its cost in blocks of prefill work ahead (`null`: it did not compete).
    pub cost: Option<f64>,
    /// What the cost is made of (`null`: it did not compete).
    #[serde(default)]
    pub terms: Option<CostTerms>,
}

/// An engine sample and how old it is; stale ones do not count in the decision.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct EngineExplained {
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
    pub age_ms: u64,
    pub stale: bool,
}

/// `POST /v1/explain`.
pub async fn explain(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ExplainRequest = json(body)?;
    let base = req
        .policy
        .validate()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("policy.{e}")))?;
    let gateway = req
        .gateway
        .as_deref()
        .map(GatewayId::new)
        .transpose()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("gateway: {e}")))?;
    let tenant = req.tenant_id.map(StringOrNumber::into_string);
    let tokens = match (
        req.token_ids,
        req.prompt.is_some() || req.messages.is_some(),
    ) {
        (Some(ids), false) => ids,
        (None, true) => {
            let input =
                crate::text::text_input(req.prompt, req.messages, req.add_generation_prompt)
                    .map_err(|msg| ApiError::new(StatusCode::BAD_REQUEST, msg))?;
            state
                .tokenizers
                .encode(&req.model_name, input, "explain", &state.metrics)
                .await?
        }
        _ => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "give exactly one of token_ids, prompt, messages",
            ))
        }
    };
    // Before the locks below: the evaluation takes them itself.
    let alarms = crate::health::evaluate_alarms(&state);
    let now = Instant::now();
    // Lock order: fleet, then hub.
    let fleet = state.fleet();
    let totals: BTreeMap<WorkerId, WorkerLoad> = fleet
        .totals(now)
        .into_iter()
        .map(|t| (t.worker, t))
        .collect();
    // The named gateway's feed: the others' load, what its replica tie-break weighs.
    let theirs = gateway
        .as_ref()
        .map(|g| fleet.totals_for(now, Some(g)))
        .unwrap_or_default();
    // The feed's replica header, which a filter heeds only when the page carries fleet load.
    let replica = gateway
        .as_ref()
        .filter(|_| !theirs.is_empty())
        .and_then(|g| {
            let (index, count) = fleet.replica_of(g, now);
            Replica::new(u32::try_from(index).ok()?, u32::try_from(count).ok()?)
        })
        .unwrap_or_default();
    let others: BTreeMap<WorkerId, u64> = theirs
        .into_iter()
        .map(|t| (t.worker, t.load.requests))
        .collect();
    let reports = fleet
        .gateway_ages(now)
        .into_iter()
        .map(|(g, age)| ReportAge {
            gateway: g.as_str().to_owned(),
            age_ms: age.as_millis().min(u64::MAX.into()) as u64,
        })
        .collect();
    drop(fleet);
    let policy = router::Policy { replica, ..base };
    let hub = state.read();
    if tokens.len() > hub.config().max_query_tokens {
        return Err(HubError::TooLarge(format!(
            "token_ids has {} entries, more than the limit of {}",
            tokens.len(),
            hub.config().max_query_tokens
        ))
        .into());
    }
    let (scope, block_size) = hub.scope_for(
        &req.model_name,
        tenant.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    )?;
    let seqs = hash::sequence_hashes(&tokens, block_size as usize, scope.seed())
        .map_err(|e| HubError::BadRequest(e.to_string()))?;
    let id = scope.id();
    let keys: Vec<BlockKey> = seqs.iter().map(|s| id.key(*s)).collect();
    let seq_hashes = seqs.into_iter().map(|s| s.0).collect();
    let matches = hub.index.lookup(&keys);
    let model = scope.model_key();
    let roster = Roster::from_meta(&meta_of(&hub));
    let likely_causes = bearing(&alarms, &hub, &model, &req.model_name);
    drop(hub);
    // Each worker slot's load as the filter's picture reads it: the fleet's counts, and the
    // engine's sample unless stale.
    let load = |id: LoadId| {
        let mut l = InstanceLoad::default();
        if let Some(t) = id.as_slot().and_then(|s| totals.get(&WorkerId(s))) {
            l.add_counts(Counts {
                requests: t.load.requests,
                prefill_tokens: t.load.prefill_tokens,
                decode_tokens: t.load.decode_tokens,
            });
            if let Some(e) = t.engine.filter(|e| !e.stale) {
                l.add_engine(e.sample.load);
            }
        }
        if let Some(&n) = id.as_slot().and_then(|s| others.get(&WorkerId(s))) {
            l.others_requests = n.min(u32::MAX.into()) as u32;
        }
        l
    };
    let contenders: Vec<Contender> =
        roster.contenders(&matches, &model.tenant, &model.model, load, &policy.weights);
    let query = Query {
        blocks: keys.len() as u32,
        block_size,
    };
    // The filter's seed is its own; ties here break by a fixed one (`tied` lists the rest).
    let decision = router::decide(&contenders, query, &policy, &mut SplitMix64(0));
    let costs = router::costs(&contenders, query, &policy);
    // The hot-spot guard's reference, as `decide` takes it: the least queue among the
    // competing.
    let least_queue = contenders
        .iter()
        .zip(&costs)
        .filter(|(_, c)| c.is_some())
        .map(|(c, _)| c.load.prefill_tokens)
        .min()
        .unwrap_or(0);
    let pick = |i: Option<usize>, cost: Option<f64>| -> Option<Pick> {
        let inst = roster.instances.get(i?)?;
        Some(Pick {
            instance_id: inst.id.clone(),
            address: inst.address.clone(),
            cost: cost?,
        })
    };
    let (verdict, winner, runner_up) = match &decision {
        Some(d) => (
            "route",
            pick(Some(d.best), Some(d.cost)),
            pick(d.runner_up, d.runner_up_cost),
        ),
        None if contenders.iter().all(|c| !c.eligible) => ("no_match", None, None),
        None => ("deferred", None, None),
    };
    let tied = decision.map_or_else(Vec::new, |d| {
        tied_with(&contenders, &costs, d.best, &policy)
            .into_iter()
            .filter_map(|i| Some(roster.instances.get(i)?.id.clone()))
            .collect()
    });
    let mut rows: Vec<InstanceExplained> = roster
        .instances
        .iter()
        .zip(&contenders)
        .zip(&costs)
        .filter(|((_, c), _)| c.eligible)
        .map(|((inst, c), cost)| {
            let engine = inst
                .slots
                .iter()
                .filter_map(|s| totals.get(&WorkerId(s.slot))?.engine)
                .reduce(busier);
            InstanceExplained {
                instance_id: inst.id.clone(),
                address: inst.address.clone(),
                matched_tokens: c.matched.map(|b| u64::from(b) * u64::from(block_size)),
                matched_blocks: c.matched,
                dp_rank: c.dp_rank,
                requests: c.load.requests,
                prefill_tokens: c.load.prefill_tokens,
                decode_tokens: c.load.decode_tokens,
                engine: engine.map(|e| EngineExplained {
                    waiting: e.sample.load.waiting,
                    running: e.sample.load.running,
                    kv_usage: e.sample.load.kv_usage(),
                    age_ms: e.age.as_millis().min(u64::MAX.into()) as u64,
                    stale: e.stale,
                }),
                saturated: policy.saturated(&c.load),
                competes: cost.is_some(),
                cost: *cost,
                terms: cost.map(|_| terms(c, query, &policy, least_queue)),
            }
        })
        .collect();
    let won = winner.as_ref().map(|w| w.instance_id.clone());
    rows.sort_by(|a, b| {
        let first = |r: &InstanceExplained| Some(&r.instance_id) != won.as_ref();
        (first(a), a.cost.unwrap_or(f64::INFINITY))
            .partial_cmp(&(first(b), b.cost.unwrap_or(f64::INFINITY)))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    Ok(Json(Explanation {
        tenant: model.tenant,
        model: model.model,
        block_size,
        query_tokens: tokens.len() as u64,
        query_blocks: query.blocks,
        seq_hashes,
        reports,
        verdict: verdict.to_owned(),
        winner,
        runner_up,
        tied,
        replica: format!("{}/{}", policy.replica.index, policy.replica.count),
        instances: rows,
        likely_causes,
    })
    .into_response())
}

/// `c`'s cost taken apart as `router::decide` adds it up (`select::cost`).
fn terms(c: &Contender, query: Query, policy: &router::Policy, least_queue: u64) -> CostTerms {
    let w = &policy.weights;
    let guarded = policy
        .max_hit_queue_tokens
        .is_some_and(|m| c.load.prefill_tokens.saturating_sub(least_queue) > m);
    let credit = if guarded {
        0.0
    } else {
        kvroute::select::credit(c.matched, w)
    };
    CostTerms {
        credit_blocks: credit,
        uncached_blocks: (f64::from(query.blocks) - credit).max(0.0),
        queued_blocks: c.load.prefill_tokens as f64 / f64::from(query.block_size.max(1)),
        requests: c.load.requests,
        overlap_weight: w.overlap,
        request_weight: w.request,
        guarded,
    }
}

/// The mirror's view of the registry, built from the feed's own `Worker` ops (slot = worker
/// id, live = routable) as a filter applies them.
fn meta_of(hub: &Hub) -> Meta {
    let ops: Vec<kvroute::feed::Op> = hub.workers().map(crate::hub::store::worker_op).collect();
    let limits = kvroute::mirror::Limits {
        max_workers: u32::MAX,
        ..kvroute::mirror::Limits::default()
    };
    Meta::from_ops(&ops, &limits)
}

/// The contenders other than `best` that `router::decide` could have drawn in its place
/// under another seed: any competing one at a temperature; else those at `best`'s very cost
/// (`rank` draws among exact ties) and, where replicas prefer their share among near-ties
/// (`select::rank_preferring`), only those preferred as `best` is (`router::preferred`).
fn tied_with(
    contenders: &[Contender],
    costs: &[Option<f64>],
    best: usize,
    policy: &router::Policy,
) -> Vec<usize> {
    let Some(&Some(at)) = costs.get(best) else {
        return Vec::new();
    };
    let spread = policy.temperature.is_finite() && policy.temperature > 0.0;
    let band = policy.replica_tie_band;
    let preferring = !spread && policy.replica.count > 1 && band.is_finite() && band > 0.0;
    let prefs: Vec<bool> = router::preferred(contenders, policy).collect();
    costs
        .iter()
        .enumerate()
        .filter(|&(i, c)| {
            i != best
                && c.is_some_and(|c| {
                    spread || (c == at && (!preferring || prefs[i] == prefs[best]))
                })
        })
        .map(|(i, _)| i)
        .collect()
}

/// The raised alarms about the workers of `model`, the served name `served`, or any gateway.
fn bearing(
    alarms: &[crate::alarm::Alarm],
    hub: &Hub,
    model: &ModelKey,
    served: &str,
) -> Vec<AlarmExplained> {
    use crate::alarm::AlarmKind;
    let engines: Vec<String> = hub
        .workers()
        .filter(|w| &ModelKey::new(w.tenant(), &w.reg.model_name) == model)
        .map(|w| format!("{}/{}", w.reg.instance_id, w.dp_rank()))
        .collect();
    alarms
        .iter()
        .filter(|a| match a.kind {
            AlarmKind::HashMismatch | AlarmKind::EngineSilent => engines.contains(&a.subject),
            AlarmKind::NoModel => a.subject == served,
            _ => true,
        })
        .map(|a| AlarmExplained {
            alarm: a.kind.as_str().to_owned(),
            subject: a.subject.clone(),
            causes: a.causes.iter().map(|c| (*c).to_owned()).collect(),
            reason: a.reason.clone(),
        })
        .collect()
}

/// The busier of two readings of one instance's ranks (fresh before stale).
fn busier(a: EngineReading, b: EngineReading) -> EngineReading {
    let key = |r: &EngineReading| (!r.stale, r.sample.load.waiting, r.sample.load.kv_permille);
    if key(&b) > key(&a) {
        b
    } else {
        a
    }
}
