//! `POST /v1/explain`: why a request would go where it goes. The body is a `/query` body
//! (token ids, a prompt or chat messages, the model, tenant, LoRA and salt as the filter reads
//! them) with optional `policy` knobs (`kvroute::router::PolicyConfig`, the filter's defaults
//! when absent). The answer lays out the scope and block size used, every instance registered
//! for the request's model with its matched tokens per tier, the fleet's load on it and its
//! engine's last sample (with its age), whether it is saturated and whether it competes, its
//! cost, and the winner and runner-up — ranked by `kvroute::router::decide`, the code the
//! filter runs, on the load the collector holds (the sum of the gateways' reports).
//!
//! What it cannot show: one gateway's own books since its last report (up to a sync period),
//! the speculative holders of its recent decisions, and its replica share. With those equal
//! its decision is this one.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute::api::{InstanceMatch, QueryResponse};
use kvroute::mirror::LoadId;
use kvroute::router::{self, Contender, InstanceLoad, PolicyConfig, Query};
use kvroute::scope::ModelKey;
use kvroute::select::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fleet::EngineReading;
use crate::hub::Hub;
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
    /// `route` (a winner), `deferred` (cold, and the policy leaves it to the gateway) or
    /// `no_match` (no instance serves the model).
    pub verdict: String,
    pub winner: Option<Pick>,
    pub runner_up: Option<Pick>,
    /// Every instance serving the model, the winner first, then by cost.
    pub instances: Vec<InstanceExplained>,
    /// The alarms raised now that bear on this request: those about its engines
    /// (`hash_mismatch`, `engine_silent`), its model name (`no_model`) and the gateways
    /// (`text_approximate`, `gateway_mismatch`, `gateway_stale`), each with its likely causes.
    #[serde(default)]
    pub likely_causes: Vec<AlarmExplained>,
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
    /// Matched tokens: in GPU memory, in GPU or CPU, in any tier.
    pub matched_tokens: [u64; 3],
    /// The same in blocks, as the cost counts them.
    pub matched_blocks: [u32; 3],
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
    let policy = req
        .policy
        .validate()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("policy.{e}")))?;
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
    let hub = state.read();
    let (scope, _) = hub.scope_for(
        &req.model_name,
        tenant.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    )?;
    let answer = hub.query_tokens(
        &tokens,
        &req.model_name,
        tenant.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    )?;
    let loads: BTreeMap<_, _> = fleet
        .totals(now)
        .into_iter()
        .map(|t| (t.worker, t))
        .collect();
    let mut instances = serving(&hub, &scope.model_key(), &answer);
    let likely_causes = bearing(&alarms, &hub, &scope.model_key(), &req.model_name);
    for (id, inst) in &mut instances {
        for w in hub.workers().filter(|w| &w.reg.instance_id == id) {
            if let Some(t) = loads.get(&w.id) {
                inst.load.add_counts(kvroute::router::Counts {
                    requests: t.load.requests,
                    prefill_tokens: t.load.prefill_tokens,
                    decode_tokens: t.load.decode_tokens,
                });
                if let Some(e) = t.engine {
                    inst.engine = Some(inst.engine.map_or(e, |cur| busier(cur, e)));
                    if !e.stale {
                        inst.load.add_engine(e.sample.load);
                    }
                }
            }
        }
    }
    drop(hub);
    drop(fleet);
    let query = Query {
        blocks: answer.query_blocks,
        block_size: answer.block_size,
    };
    // The answer with the cold instances added, turned into contenders by the filter's own
    // remote-mode code (tiers to blocks, the rank holding the match).
    let full = QueryResponse {
        instances: instances
            .iter()
            .map(|(id, i)| {
                let m = InstanceMatch {
                    address: i.address.clone(),
                    ..i.matched.clone()
                };
                (id.clone(), m)
            })
            .collect(),
        ..answer.clone()
    };
    let contenders: Vec<Contender> = router::remote_contenders(&full, |load_id| {
        instances
            .iter()
            .find(|(id, _)| LoadId::instance(id) == load_id)
            .map(|(_, i)| i.load)
            .unwrap_or_default()
    })
    .into_iter()
    .map(|(c, _)| c)
    .collect();
    // The filter's seed is its own; ties here break by a fixed one.
    let decision = router::decide(&contenders, query, &policy, &mut SplitMix64(0));
    let costs = router::costs(&contenders, query, &policy);
    let ids: Vec<&String> = instances.keys().collect();
    let pick = |i: Option<usize>, cost: Option<f64>| -> Option<Pick> {
        let id = *ids.get(i?)?;
        Some(Pick {
            instance_id: id.clone(),
            address: instances[id].address.clone(),
            cost: cost?,
        })
    };
    let (verdict, winner, runner_up) = match &decision {
        Some(d) => (
            "route",
            pick(Some(d.best), Some(d.cost)),
            pick(d.runner_up, d.runner_up_cost),
        ),
        None if contenders.is_empty() => ("no_match", None, None),
        None => ("deferred", None, None),
    };
    let mut rows: Vec<InstanceExplained> = instances
        .values()
        .zip(&contenders)
        .zip(&costs)
        .map(|((i, c), cost)| InstanceExplained {
            instance_id: i.id.clone(),
            address: i.address.clone(),
            matched_tokens: [i.matched.gpu, i.matched.cpu, i.matched.disk],
            matched_blocks: c.matched,
            requests: i.load.requests,
            prefill_tokens: i.load.prefill_tokens,
            decode_tokens: i.load.decode_tokens,
            engine: i.engine.map(|e| EngineExplained {
                waiting: e.sample.load.waiting,
                running: e.sample.load.running,
                kv_usage: e.sample.load.kv_usage(),
                age_ms: e.age.as_millis().min(u64::MAX.into()) as u64,
                stale: e.stale,
            }),
            saturated: policy.saturated(&i.load),
            competes: cost.is_some(),
            cost: *cost,
        })
        .collect();
    let won = winner.as_ref().map(|w| w.instance_id.clone());
    rows.sort_by(|a, b| {
        let first = |r: &InstanceExplained| Some(&r.instance_id) != won.as_ref();
        (first(a), a.cost.unwrap_or(f64::INFINITY))
            .partial_cmp(&(first(b), b.cost.unwrap_or(f64::INFINITY)))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let model = scope.model_key();
    Ok(Json(Explanation {
        tenant: model.tenant,
        model: model.model,
        block_size: answer.block_size,
        query_tokens: tokens.len() as u64,
        query_blocks: answer.query_blocks,
        verdict: verdict.to_owned(),
        winner,
        runner_up,
        instances: rows,
        likely_causes,
    })
    .into_response())
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

/// An instance being explained: its match and its summed load.
struct Serving {
    id: String,
    address: String,
    matched: InstanceMatch,
    load: InstanceLoad,
    engine: Option<EngineReading>,
}

/// Every routable instance registered for the scope's `(tenant, model)`, with its match from
/// the answer (none: a cold instance, which competes too), by instance id.
fn serving(hub: &Hub, model: &ModelKey, answer: &QueryResponse) -> BTreeMap<String, Serving> {
    let mut out = BTreeMap::new();
    for w in hub.workers() {
        let key = ModelKey::new(w.tenant(), &w.reg.model_name);
        if &key != model || !w.status.is_routable() {
            continue;
        }
        let id = w.reg.instance_id.clone();
        out.entry(id.clone()).or_insert_with(|| Serving {
            matched: answer.instances.get(&id).cloned().unwrap_or_default(),
            address: w.address().to_owned(),
            id,
            load: InstanceLoad::default(),
            engine: None,
        });
    }
    out
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
