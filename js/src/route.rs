//! The routing decision (`kvroute::router::decide`): over instances the caller describes
//! ([`route_js`]), or over the collector's `/query` answer as the filter's remote mode reads
//! it ([`route_query_response`]). A plain object (or its JSON text) in, the chosen instance
//! and the runner-up out.

use std::collections::BTreeMap;

use kvroute::api::QueryResponse;
use kvroute::mirror::LoadId;
use kvroute::router::{
    self as core, Contender, EngineLoad, InstanceLoad, Policy, PolicyConfig, Query,
};
use kvroute::select::SplitMix64;
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

use crate::args;

/// A routing request: the prompt's size, the instances and, optionally, the policy.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteRequest {
    /// Full blocks of the prompt and tokens per block.
    pub query: QuerySpec,
    /// The request's tenant (default `default`), for [`InstanceSpec::models`].
    pub tenant: Option<String>,
    /// The request's model, for [`InstanceSpec::models`]; absent: every instance is eligible.
    pub model: Option<String>,
    /// The instances that could take the request.
    pub instances: Vec<InstanceSpec>,
    /// The policy; the filter's defaults for what is absent.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Seed of the exact-tie break; absent: a random one.
    pub seed: Option<u64>,
}

/// The prompt's size.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct QuerySpec {
    /// Full blocks of the prompt.
    pub blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
}

/// Matched blocks: one number (all in GPU memory) or cumulative `[gpu, cpu, disk]` counts.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(untagged)]
pub enum Matched {
    /// Leading blocks held in GPU memory.
    Gpu(u32),
    /// Leading blocks held in GPU, in GPU or CPU, in any tier.
    Tiers([u32; 3]),
}

impl Matched {
    fn tiers(self, at: &str) -> Result<[u32; 3], String> {
        match self {
            Matched::Gpu(n) => Ok([n; 3]),
            Matched::Tiers(t) if t[0] <= t[1] && t[1] <= t[2] => Ok(t),
            Matched::Tiers(t) => Err(format!(
                "{at}: tiers are cumulative (gpu <= cpu <= disk), got {t:?}"
            )),
        }
    }
}

/// One dp rank's match.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RankSpec {
    /// The rank.
    pub dp_rank: u32,
    /// Its leading blocks.
    pub matched: Matched,
}

/// A `(tenant, model)` an instance serves.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Default `default`.
    pub tenant: Option<String>,
    /// The served model name; empty: any.
    pub model: String,
}

/// One instance: its match, its load and what it serves.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InstanceSpec {
    /// The caller's name for it, returned in the decision.
    pub id: String,
    /// What it serves; absent: any model.
    pub models: Option<Vec<ModelSpec>>,
    /// Leading query blocks held (rank 0); give this or `ranks`.
    pub matched: Option<Matched>,
    /// Per dp rank matches; the rank with the most credit speaks for the instance.
    pub ranks: Option<Vec<RankSpec>>,
    /// Its in-flight load.
    #[serde(default)]
    pub load: LoadSpec,
}

/// In-flight load of an instance.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LoadSpec {
    /// Requests routed to it and not finished.
    #[serde(default)]
    pub requests: u32,
    /// Uncached prompt tokens of those requests.
    #[serde(default)]
    pub prefill_tokens: u64,
    /// Their decode work in tokens (not in the cost).
    #[serde(default)]
    pub decode_tokens: u64,
    /// The engine's own report (waiting queue, KV usage 0..1), for the saturation rule.
    pub engine: Option<EngineSpec>,
}

impl LoadSpec {
    fn instance_load(&self) -> InstanceLoad {
        InstanceLoad {
            requests: self.requests,
            prefill_tokens: self.prefill_tokens,
            decode_tokens: self.decode_tokens,
            others_requests: 0,
            engine: self
                .engine
                .as_ref()
                .map(|e| EngineLoad::from_gauges(e.waiting.into(), 0.0, e.kv_usage.into())),
        }
    }
}

/// An engine's own load report.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EngineSpec {
    /// Requests waiting in its queue.
    pub waiting: u32,
    /// Share of its KV cache in use, 0.0 to 1.0.
    pub kv_usage: f32,
}

/// The filter's policy from the caller's knobs (the core checks them). A browser or Node
/// caller decides alone: no replica share.
fn policy(knobs: &PolicyConfig) -> Result<Policy, String> {
    knobs.validate().map_err(|e| format!("policy.{e}"))
}

/// The decision: the instance to route to and the next best.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RouteDecision {
    /// `id` of the chosen instance.
    pub best: String,
    /// Its index in `instances`.
    pub best_index: usize,
    /// `id` of the runner-up, the fallback.
    pub runner_up: Option<String>,
    /// Its index.
    pub runner_up_index: Option<usize>,
    /// The dp rank of `best` holding its match.
    pub dp_rank: u32,
    /// Blocks of the prompt `best` holds (any tier).
    pub matched_blocks: u32,
}

/// Decides where a request goes, as the filter would. `request` is a [`RouteRequest`]
/// object or its JSON text. Returns `null` when nothing is decided: no eligible instance, or
/// a cold request under `cold: "defer"`. Throws with the field at fault on bad input.
#[wasm_bindgen(js_name = route, unchecked_return_type = "RouteDecision | null")]
pub fn route_js(
    #[wasm_bindgen(unchecked_param_type = "RouteRequest | string")] request: JsValue,
) -> Result<JsValue, JsError> {
    let req: RouteRequest = args::from_js(&request, "route request")?;
    let decision = decide(&req, seed_or_random(req.seed))
        .map_err(|e| args::js(format!("route request: {e}")))?;
    decision_to_js(decision)
}

/// Without a seed, ties break at random like the filter's (seeded from the clock there).
fn seed_or_random(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| (js_sys::Math::random() * u64::MAX as f64) as u64)
}

fn decision_to_js(decision: Option<RouteDecision>) -> Result<JsValue, JsError> {
    let text =
        serde_json::to_string(&decision).map_err(|e| args::js(format!("route decision: {e}")))?;
    js_sys::JSON::parse(&text).map_err(|_| args::js("route decision: not JSON".into()))
}

/// What the filter's remote mode adds to the collector's answer.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RemoteOptions {
    /// In-flight load per instance id; absent instances carry none.
    #[serde(default)]
    pub loads: BTreeMap<String, LoadSpec>,
    /// The policy; the filter's defaults for what is absent.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Seed of the exact-tie break; absent: a random one.
    pub seed: Option<u64>,
}

/// Decides over the collector's `/query` or `/query_by_hash` answer (its JSON object or
/// text) exactly as the filter's remote mode does: each instance's rank with the most
/// matched tokens, tiers from its totals, the load from `options.loads`. Instances absent
/// from the answer hold nothing and do not compete. Returns `null` when nothing is decided.
#[wasm_bindgen(js_name = routeQueryResponse, unchecked_return_type = "RouteDecision | null")]
pub fn route_query_response(
    #[wasm_bindgen(unchecked_param_type = "QueryResponse | string")] response: JsValue,
    options: Option<RemoteOptionsArg>,
) -> Result<JsValue, JsError> {
    let resp: QueryResponse = args::from_js(&response, "query response")?;
    let opts: RemoteOptions = match options {
        None => RemoteOptions::default(),
        Some(o) => args::from_js(o.as_ref(), "route options")?,
    };
    let decision = decide_remote(&resp, &opts, seed_or_random(opts.seed))
        .map_err(|e| args::js(format!("route options: {e}")))?;
    decision_to_js(decision)
}

/// [`route_query_response`] without JS types.
pub fn decide_remote(
    resp: &QueryResponse,
    opts: &RemoteOptions,
    seed: u64,
) -> Result<Option<RouteDecision>, String> {
    let policy = policy(&opts.policy)?;
    // The core names loads by a hash of the instance id; the caller names them by the id.
    let loads: Vec<(LoadId, InstanceLoad)> = opts
        .loads
        .iter()
        .map(|(id, l)| (LoadId::instance(id), l.instance_load()))
        .collect();
    let load_of = |id: LoadId| {
        loads
            .iter()
            .find(|(l, _)| *l == id)
            .map_or_else(InstanceLoad::default, |(_, l)| *l)
    };
    let contenders: Vec<Contender> = core::remote_contenders(resp, load_of)
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    let query = Query {
        blocks: resp.query_blocks,
        block_size: resp.block_size.max(1),
    };
    let ids: Vec<&String> = resp.instances.keys().collect();
    let decision = core::decide(&contenders, query, &policy, &mut SplitMix64(seed));
    Ok(decision.map(|d| RouteDecision {
        best: ids[d.best].clone(),
        best_index: d.best,
        runner_up: d.runner_up.map(|i| ids[i].clone()),
        runner_up_index: d.runner_up,
        dp_rank: d.dp_rank,
        matched_blocks: d.matched_blocks,
    }))
}

/// The decision without JS types: contenders built from the request, then the core decides.
pub fn decide(req: &RouteRequest, seed: u64) -> Result<Option<RouteDecision>, String> {
    let policy = policy(&req.policy)?;
    if req.query.block_size == 0 {
        return Err("query.blockSize: must be at least 1".into());
    }
    let tenant = req
        .tenant
        .as_deref()
        .unwrap_or(kvroute::scope::DEFAULT_TENANT);
    let mut contenders = Vec::with_capacity(req.instances.len());
    for (i, inst) in req.instances.iter().enumerate() {
        let eligible = match (&req.model, &inst.models) {
            (Some(model), Some(models)) => core::Instance {
                models: models
                    .iter()
                    .map(|m| {
                        let t = m
                            .tenant
                            .as_deref()
                            .unwrap_or(kvroute::scope::DEFAULT_TENANT);
                        (t.to_owned(), m.model.clone())
                    })
                    .collect(),
                ..core::Instance::default()
            }
            .serves(tenant, model),
            _ => true,
        };
        let mut c = Contender::new(eligible, inst.load.instance_load());
        let at = format!("instances[{i}]");
        match (&inst.matched, &inst.ranks) {
            (Some(_), Some(_)) => return Err(format!("{at}: give matched or ranks, not both")),
            (Some(m), None) => c.offer(0, m.tiers(&format!("{at}.matched"))?, &policy.weights),
            (None, Some(ranks)) => {
                for (r, rank) in ranks.iter().enumerate() {
                    let tiers = rank.matched.tiers(&format!("{at}.ranks[{r}].matched"))?;
                    c.offer(rank.dp_rank, tiers, &policy.weights);
                }
            }
            (None, None) => c.offer(0, [0; 3], &policy.weights),
        }
        contenders.push(c);
    }
    let query = Query {
        blocks: req.query.blocks,
        block_size: req.query.block_size,
    };
    let decision = core::decide(&contenders, query, &policy, &mut SplitMix64(seed));
    Ok(decision.map(|d| RouteDecision {
        best: req.instances[d.best].id.clone(),
        best_index: d.best,
        runner_up: d.runner_up.map(|i| req.instances[i].id.clone()),
        runner_up_index: d.runner_up,
        dp_rank: d.dp_rank,
        matched_blocks: d.matched_blocks,
    }))
}

#[wasm_bindgen]
extern "C" {
    /// The `RemoteOptions` object as it arrives (typed for TypeScript, read by serde).
    #[wasm_bindgen(typescript_type = "RemoteOptions")]
    pub type RemoteOptionsArg;
}

#[wasm_bindgen(typescript_custom_section)]
const ROUTE_TYPES: &str = r#"
/** Matched leading blocks: a number (all in GPU memory) or cumulative [gpu, cpu, disk]. */
export type Matched = number | [number, number, number];

/** A routing request for `route`. */
export interface RouteRequest {
  /** Full blocks of the prompt and tokens per block. */
  query: { blocks: number; blockSize: number };
  /** The request's tenant, default "default". */
  tenant?: string;
  /** The request's model; instances with `models` not serving it are not eligible. */
  model?: string;
  instances: Array<{
    id: string;
    /** What it serves (tenant default "default"; model "" serves any); absent: any. */
    models?: Array<{ tenant?: string; model: string }>;
    /** Leading blocks held (dp rank 0); or give `ranks`. */
    matched?: Matched;
    ranks?: Array<{ dpRank: number; matched: Matched }>;
    load?: {
      requests?: number;
      prefillTokens?: number;
      decodeTokens?: number;
      /** The engine's own report, for the saturation rule. */
      engine?: { waiting: number; kvUsage: number };
    };
  }>;
  /** The filter's defaults for absent knobs. */
  policy?: {
    gpu?: number; cpu?: number; disk?: number; overlap?: number; request?: number;
    cold?: "decide" | "defer";
    maxWaiting?: number; maxKvUsage?: number;
    maxHitQueueTokens?: number | null;
  };
  /** Seed of the exact-tie break; absent: random. */
  seed?: number;
}

/** The collector's `/query` and `/query_by_hash` answer (matches in tokens). */
export interface QueryResponse {
  block_size: number;
  query_blocks: number;
  instances: Record<string, {
    address: string;
    longest_matched: number;
    gpu: number;
    cpu: number;
    disk: number;
    /** Each dp rank's best, keyed by the rank in decimal. */
    dp: Record<string, number>;
  }>;
}

/** What `routeQueryResponse` adds to the collector's answer. */
export interface RemoteOptions {
  /** In-flight load per instance id. */
  loads?: Record<string, { requests?: number; prefillTokens?: number; decodeTokens?: number; engine?: { waiting: number; kvUsage: number } }>;
  policy?: RouteRequest["policy"];
  seed?: number;
}

/** Where `route` and `routeQueryResponse` send the request. `bestIndex` is the instance's position in the request's `instances` (for a query response: among its instance ids, sorted). */
export interface RouteDecision {
  best: string;
  bestIndex: number;
  runnerUp: string | null;
  runnerUpIndex: number | null;
  dpRank: number;
  matchedBlocks: number;
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> RouteRequest {
        args::from_json(json).unwrap()
    }

    #[test]
    fn the_longest_prefix_wins_at_equal_load() {
        let r = req(r#"{"query":{"blocks":8,"blockSize":16},"seed":1,
            "instances":[{"id":"a","matched":2},{"id":"b","matched":6},{"id":"c"}]}"#);
        let d = decide(&r, 1).unwrap().unwrap();
        assert_eq!((d.best.as_str(), d.matched_blocks), ("b", 6));
        assert_eq!(d.runner_up.as_deref(), Some("a"));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = args::from_json::<RouteRequest>(
            r#"{"query":{"blocks":8,"blockSize":16},"instances":[{"id":"a","load":{"requests":-1}}]}"#,
        )
        .unwrap_err();
        assert!(e.starts_with("instances[0].load.requests:"), "{e}");
        let r = req(
            r#"{"query":{"blocks":8,"blockSize":16},"instances":[{"id":"a","matched":[3,2,1]}]}"#,
        );
        assert!(decide(&r, 0).unwrap_err().contains("instances[0].matched"));
        let r = req(
            r#"{"query":{"blocks":8,"blockSize":16},"instances":[{"id":"a"}],"policy":{"replicaTieBand":65}}"#,
        );
        let e = decide(&r, 0).unwrap_err();
        assert!(e.starts_with("policy.replica_tie_band:"), "{e}");
    }
}
