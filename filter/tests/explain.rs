//! `/v1/explain` against the filter it explains: the real collector in-process, the real
//! `.wasm` synced from it, and random fleets. For every prompt the filter's choice (its
//! destination and rank headers, its debug header's winner, runner-up and costs) must be what
//! the collector's explainer answers for the same body.
//!
//! The explainer cannot see a gateway's books since its last report, nor the speculative
//! holders of its recent decisions (`collector/src/explain.rs`). So here one gateway sends one
//! request at a time and each is answered before the next (its books are empty at every
//! decision and in every report it makes), speculative entries are off, and no time passes
//! between the sync and the prompts (the fleet's reports stay live, the samples keep their
//! side of the staleness limit). The replica place is given to the explainer as the gateway's
//! id, so other gateways' reports (which make the filter one replica of several) are in play.
//! Ties: the filter breaks them with its own seed, so its winner must be the explainer's or one
//! of those it lists as `tied`, at the same cost.
//!
//! A seeded loop rather than proptest: each case is a live collector and a synced gateway,
//! which shrinking would rebuild hundreds of times. A failure names its seed and case;
//! `KVROUTE_EXPLAIN_SEED=<n>` replays another sequence.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute::api::RegisterRequest;
use kvroute::event::{KvEvent, Tier, WorkerId};
use kvroute::router::EngineLoad;
use kvroute::select::{Random, SplitMix64};
use kvroute_collector::fleet::EngineSample;
use kvroute_collector::AppState;
use kvroute_host_test::Gateway;
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

use crate::common::*;

/// Random fleets tried, and prompts sent to each.
const CASES: u64 = 100;
const PROMPTS: usize = 8;
/// The filter's id in its load reports; the explainer is asked as this gateway.
const GATEWAY: &str = "gw-filter";
/// Debug-header costs are printed with two decimals.
const COST_TOLERANCE: f64 = 0.0051;

/// A real collector serving on a loopback port, in-process, engine scraping off (the
/// samples are the test's).
struct Collector {
    addr: SocketAddr,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
}

impl Collector {
    fn start(rt: &Runtime) -> Collector {
        let _guard = rt.enter();
        let config = kvroute_collector::Config {
            scrape_interval: Duration::ZERO,
            ..kvroute_collector::Config::default()
        };
        let state = kvroute_collector::start(config).expect("collector starts");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        rt.spawn(kvroute_collector::serve(
            listener,
            state.clone(),
            async move {
                let _ = rx.await;
            },
        ));
        Collector {
            addr,
            state,
            stop: Some(tx),
        }
    }

    /// Registers `(instance, dp_rank)` for `model`; its worker id. Its endpoint publishes
    /// nothing: its events are applied through [`Collector::store`].
    fn register(
        &self,
        rt: &Runtime,
        instance: &str,
        address: &str,
        dp_rank: u32,
        model: &str,
    ) -> WorkerId {
        let _guard = rt.enter();
        self.state
            .register(RegisterRequest {
                instance_id: instance.into(),
                endpoint: "tcp://127.0.0.1:1".into(),
                replay_endpoint: None,
                model_name: model.into(),
                tenant_id: None,
                block_size: BS,
                dp_rank: Some(dp_rank),
                lora_name: None,
                cache_salt: None,
                address: Some(address.into()),
            })
            .expect("registered");
        self.state
            .read()
            .workers()
            .find(|w| w.reg.instance_id == instance && w.dp_rank() == dp_rank)
            .map(|w| w.id)
            .expect("the worker just registered")
    }

    /// Applies `events` as batch `seq` of `worker`'s engine: encoded as vLLM sends them and
    /// decoded and ingested as the collector's subscriber does.
    fn store(&self, rt: &Runtime, worker: WorkerId, seq: u64, events: &[KvEvent]) {
        let bytes = encode_events(
            EventFormat::Vllm033,
            Extras {
                vllm_group_fields: false,
            },
            1.0,
            events,
            None,
        );
        let batch = kvroute_collector::decode::decode(&bytes).expect("a valid batch");
        rt.block_on(self.state.apply_batch(worker, seq, batch));
    }

    /// `POST path` with a JSON body over plain HTTP/1.0: the status and the JSON answer.
    fn post(&self, rt: &Runtime, path: &str, body: &Value) -> (u16, Value) {
        rt.block_on(async {
            let body = body.to_string();
            let mut s = tokio::net::TcpStream::connect(self.addr)
                .await
                .expect("connect");
            let head = format!(
                "POST {path} HTTP/1.0\r\nhost: collector\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.expect("write");
            s.write_all(body.as_bytes()).await.expect("write");
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await.expect("read");
            let text = String::from_utf8(raw).expect("utf-8 answer");
            let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
            let status = head
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .expect("a status");
            let v = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
            (status, v)
        })
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.state.stop_subscribers();
    }
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A number in `lo..=hi`.
fn between(rng: &mut SplitMix64, lo: u64, hi: u64) -> u64 {
    lo + rng.next_u64() % (hi - lo + 1)
}

fn chance(rng: &mut SplitMix64, percent: u64) -> bool {
    rng.next_u64() % 100 < percent
}

fn random_tokens(rng: &mut SplitMix64, n: u64) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % 50_000) as u32).collect()
}

/// One random fleet: its engines, what they hold, the load on them and the policy.
struct Fleet {
    /// Each instance of model `m` and its workers.
    instances: Vec<(String, Vec<WorkerId>)>,
    /// Documents the cached prefixes and the prompts are cut from.
    documents: Vec<Vec<u32>>,
    /// The policy knobs, as the filter's config and as the explainer's `policy`.
    filter_config: Value,
    policy: Value,
}

/// Registers 2–6 instances (one or two dp ranks, registered in either order; at times one of
/// them of another model), stores random prefixes of shared documents on their workers
/// (some on the CPU tier), and loads the fleet: other gateways' reports and engine samples,
/// fresh or stale.
fn random_fleet(rt: &Runtime, c: &Collector, rng: &mut SplitMix64, case: u64) -> Fleet {
    let documents: Vec<Vec<u32>> = (0..3)
        .map(|_| random_tokens(rng, 12 * u64::from(BS)))
        .collect();
    let mut instances = Vec::new();
    let mut workers = Vec::new();
    let n = between(rng, 2, 6);
    let other = chance(rng, 30).then(|| between(rng, 0, n));
    for i in 0..=n {
        if i == n && other != Some(n) {
            break;
        }
        let model = if other == Some(i) { "other" } else { "m" };
        let id = format!("c{case}-e{i}");
        let address = format!("10.0.{}.{}:8000", case % 250, i + 1);
        let mut ranks = if chance(rng, 30) { vec![0, 1] } else { vec![0] };
        if chance(rng, 50) {
            ranks.reverse();
        }
        let ids: Vec<WorkerId> = ranks
            .iter()
            .map(|&r| c.register(rt, &id, &address, r, model))
            .collect();
        workers.extend(ids.iter().copied());
        if model == "m" {
            instances.push((id, ids));
        }
    }
    // Cached prefixes: each worker stores 0–3 chains from the root, each a document's first
    // blocks or those and a branch of its own; engine hashes are unique per worker.
    for &w in &workers {
        let mut events = Vec::new();
        let mut hash = 1u64;
        for _ in 0..between(rng, 0, 3) {
            let doc = &documents[between(rng, 0, 2) as usize];
            let shared = between(rng, 1, 10) as usize * BS as usize;
            let mut chain = doc[..shared].to_vec();
            if chance(rng, 30) {
                let n = between(rng, 1, 3) * u64::from(BS);
                chain.extend(random_tokens(rng, n));
            }
            let blocks = (chain.len() / BS as usize) as u64;
            let mut e = stored(None, hash, &chain, BS as usize);
            hash += blocks;
            if chance(rng, 20) {
                if let KvEvent::BlockStored { tier, .. } = &mut e {
                    *tier = Tier::Cpu;
                }
            }
            events.push(e);
        }
        if !events.is_empty() {
            c.store(rt, w, 0, &events);
        }
    }
    // Other gateways' in-flight load (their reports make the filter one replica of several).
    let epoch = c.state.read().feed.epoch();
    for g in 0..between(rng, 0, 2) {
        let mut entries = Vec::new();
        for w in &workers {
            if !chance(rng, 60) {
                continue;
            }
            let prefill = if chance(rng, 50) {
                between(rng, 0, 40) * u64::from(BS)
            } else {
                between(rng, 0, 700)
            };
            entries.push(json!({"worker": w.0, "requests": between(rng, 0, 4),
                "prefill_tokens": prefill, "decode_tokens": between(rng, 0, 500)}));
        }
        let (s, v) = c.post(
            rt,
            "/v1/load",
            &json!({"gateway": format!("gw-{g}"), "epoch": epoch, "workers": entries}),
        );
        assert_eq!(s, 200, "{v}");
    }
    // Engine samples: fresh (some saturated) or past the staleness limit.
    for &w in &workers {
        if chance(rng, 40) {
            let load = EngineLoad {
                waiting: between(rng, 0, 10) as u32,
                running: between(rng, 0, 8) as u32,
                kv_permille: if chance(rng, 20) {
                    between(rng, 950, 1000)
                } else {
                    between(rng, 0, 900)
                } as u16,
            };
            let age = if chance(rng, 25) {
                Duration::from_secs(30)
            } else {
                Duration::ZERO
            };
            c.state.fleet().set_engine(
                w,
                EngineSample {
                    load,
                    at: Instant::now() - age,
                },
            );
        }
    }
    // The policy: the defaults, or other weights, a hot-spot guard, another tie band, cold
    // requests deferred.
    let mut route = json!({"speculative_ttl_ms": 0});
    let mut weights = json!({});
    let mut policy = json!({});
    if chance(rng, 30) {
        let guard = between(rng, 1, 30) * 50;
        route["max_hit_queue_tokens"] = json!(guard);
        policy["max_hit_queue_tokens"] = json!(guard);
    }
    if chance(rng, 30) {
        let band = [0.0, 0.5, 4.0][between(rng, 0, 2) as usize];
        route["replica_tie_band"] = json!(band);
        policy["replica_tie_band"] = json!(band);
    }
    if chance(rng, 15) {
        route["cold"] = json!("defer");
        policy["cold"] = json!("defer");
    }
    if chance(rng, 30) {
        let request = [0.0, 0.5, 2.0][between(rng, 0, 2) as usize];
        weights["request"] = json!(request);
        policy["request"] = json!(request);
    }
    if chance(rng, 20) {
        weights["cpu"] = json!(0.25);
        policy["cpu"] = json!(0.25);
    }
    Fleet {
        instances,
        documents,
        filter_config: json!({"load": {"gateway_id": GATEWAY}, "route": route, "weights": weights}),
        policy,
    }
}

/// A prompt sharing 0–11 blocks with a document, then tokens of its own (at times none, at
/// times a partial block).
fn random_prompt(rng: &mut SplitMix64, f: &Fleet) -> Vec<u32> {
    let doc = &f.documents[between(rng, 0, 2) as usize];
    let shared = between(rng, 0, 11) as usize * BS as usize;
    let mut p = doc[..shared].to_vec();
    let own = if shared == 0 || chance(rng, 70) {
        between(rng, 1, 40)
    } else {
        0
    };
    p.extend(random_tokens(rng, own));
    p
}

/// The debug header's `key=value` fields.
fn fields(debug: &str) -> BTreeMap<String, String> {
    debug
        .split("; ")
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn row<'e>(e: &'e Value, instance: &str) -> &'e Value {
    e["instances"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["instance_id"] == instance))
        .unwrap_or_else(|| panic!("{instance} not explained: {e}"))
}

/// Checks one prompt: the filter's decision is one the explainer allows, at its costs.
/// Returns whether the explainer saw a tie the filter could break otherwise.
fn check(gw: &mut Gateway, c: &Collector, rt: &Runtime, f: &Fleet, prompt: &[u32]) -> bool {
    let o = complete(gw, "m", prompt);
    let d = fields(&debug(&o));
    let mut ask = json!({"token_ids": prompt, "model": "m", "gateway": GATEWAY});
    ask["policy"] = f.policy.clone();
    let (s, e) = c.post(rt, "/v1/explain", &ask);
    assert_eq!(s, 200, "{e}");
    let ctx = format!(
        "prompt of {} tokens\nfilter: {d:?}\nexplain: {e:#}",
        prompt.len()
    );
    let outcome = d.get("outcome").map(String::as_str).unwrap_or("none");
    if e["verdict"] == "deferred" {
        assert_eq!(outcome, "deferred", "{ctx}");
        assert_eq!(dest(&o), None, "{ctx}");
        return false;
    }
    assert_eq!(e["verdict"], "route", "{ctx}");
    let winner = d.get("winner").unwrap_or_else(|| panic!("routed: {ctx}"));
    let mut allowed = vec![e["winner"]["instance_id"].as_str().unwrap_or("")];
    allowed.extend(
        e["tied"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str),
    );
    assert!(
        allowed.contains(&winner.as_str()),
        "the filter's winner {winner} is not among {allowed:?}: {ctx}"
    );
    // The same costs: the winner's, and the cheapest of the others as its runner-up.
    let w = row(&e, winner);
    assert_eq!(best(&o), w["address"].as_str(), "{ctx}");
    let cost = |v: &Value| v.as_f64().unwrap_or_else(|| panic!("a cost: {ctx}"));
    let near = |a: f64, b: f64| (a - b).abs() <= COST_TOLERANCE;
    let filter_cost: f64 = d["cost"].parse().expect("a number");
    assert!(near(filter_cost, cost(&w["cost"])), "winner's cost: {ctx}");
    let others: Vec<&Value> = e["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["instance_id"] != winner.as_str() && r["competes"] == true)
        .collect();
    match (d.get("runner_up"), d.get("runner_up_cost")) {
        (Some(addr), Some(rc)) => {
            let rc: f64 = rc.parse().expect("a number");
            let least = others
                .iter()
                .map(|r| cost(&r["cost"]))
                .fold(f64::INFINITY, f64::min);
            assert!(
                near(rc, least),
                "runner-up's cost is the least of the others: {ctx}"
            );
            let r = others
                .iter()
                .find(|r| r["address"] == addr.as_str())
                .unwrap_or_else(|| panic!("the runner-up {addr} competes: {ctx}"));
            assert!(near(rc, cost(&r["cost"])), "runner-up's cost: {ctx}");
        }
        _ => assert!(others.is_empty(), "a runner-up was there: {ctx}"),
    }
    // Every competing instance's terms add up to its cost.
    for r in e["instances"].as_array().into_iter().flatten() {
        if r["competes"] != true {
            continue;
        }
        let t = &r["terms"];
        let sum = cost(&t["overlap_weight"])
            * (cost(&t["queued_blocks"]) + cost(&t["uncached_blocks"]))
            + cost(&t["request_weight"]) * cost(&t["requests"]);
        assert!(
            (sum - cost(&r["cost"])).abs() < 1e-9,
            "terms of {}: {ctx}",
            r["instance_id"]
        );
    }
    // What the winner holds, and the rank that holds it.
    let blocks = w["matched_blocks"][2].as_u64().expect("blocks");
    let matched = (blocks * u64::from(BS)).min(prompt.len() as u64);
    assert_eq!(d["matched_tokens"], matched.to_string(), "{ctx}");
    let routed = if blocks > 0 { "routed" } else { "routed_cold" };
    assert_eq!(outcome, routed, "{ctx}");
    let ranks = f
        .instances
        .iter()
        .find(|(id, _)| id == winner)
        .map_or(0, |(_, w)| w.len());
    let rank = o.header("x-data-parallel-rank").map(str::to_owned);
    let want = (ranks > 1).then(|| w["dp_rank"].to_string());
    assert_eq!(rank, want, "{ctx}");
    allowed.len() > 1
}

/// The property: over random fleets, loads and policies, every decision of the filter is the
/// explainer's (its winner or one tied with it, at the same costs).
#[test]
fn explain_decides_as_the_filter_does_on_random_fleets() {
    let rt = runtime();
    let seed = std::env::var("KVROUTE_EXPLAIN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(21);
    let mut rng = SplitMix64(seed);
    let (mut decided, mut ties, mut replicas) = (0, 0, 0);
    for case in 0..CASES {
        let c = Collector::start(&rt);
        let f = random_fleet(&rt, &c, &mut rng, case);
        let mut gw = gateway(&config(f.filter_config.clone()), 1);
        gw.cluster_forward(CLUSTER, c.addr);
        sync(&mut gw);
        sync(&mut gw);
        let shared = gw
            .callouts()
            .iter()
            .any(|c| c.path().starts_with("/v1/feed"));
        assert!(shared, "case {case}: the filter pulled the feed");
        for _ in 0..PROMPTS {
            let prompt = random_prompt(&mut rng, &f);
            let tie = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                check(&mut gw, &c, &rt, &f, &prompt)
            }))
            .unwrap_or_else(|p| {
                std::panic::resume_unwind(Box::new(format!(
                    "seed {seed}, case {case}: {}",
                    p.downcast_ref::<String>().map_or("?", String::as_str)
                )))
            });
            ties += u32::from(tie);
            decided += 1;
        }
        let (_, e) = c.post(
            &rt,
            "/v1/explain",
            &json!({"token_ids": [1], "model": "m", "gateway": GATEWAY}),
        );
        replicas += u32::from(e["replica"] != "0/1");
        assert!(gw.errors().is_empty(), "no trap: {:?}", gw.errors());
    }
    // The generator reaches what the property is about.
    assert_eq!(decided, CASES as usize * PROMPTS);
    assert!(ties > 10, "ties seen: {ties}");
    assert!(replicas > 5, "cases with several replicas: {replicas}");
}

// Issue 21 (`issues show 21`): the explainer folded an instance's dp ranks as remote mode
// does, into the best of each tier over its ranks, while the local-mode filter takes the one
// rank with the most credit. Rank 0 holding the whole prompt on CPU and rank 1 half of it on
// GPU read as one rank holding both, and the explainer named the wrong winner.
#[test]
fn issue_21_ranks_fold_by_credit_as_in_the_filter() {
    let rt = runtime();
    let c = Collector::start(&rt);
    let prompt = tokens(1000, 8 * BS);
    let a0 = c.register(&rt, "a", A, 0, "m");
    let a1 = c.register(&rt, "a", A, 1, "m");
    let b = c.register(&rt, "b", B, 0, "m");
    let mut on_cpu = stored(None, 1, &prompt, BS as usize);
    if let KvEvent::BlockStored { tier, .. } = &mut on_cpu {
        *tier = Tier::Cpu;
    }
    c.store(&rt, a0, 0, &[on_cpu]);
    c.store(&rt, a1, 0, &[stored(None, 1, &prompt[..64], BS as usize)]);
    c.store(&rt, b, 0, &[stored(None, 1, &prompt[..112], BS as usize)]);
    let mut gw = gateway(&config(json!({"route": {"speculative_ttl_ms": 0}})), 1);
    gw.cluster_forward(CLUSTER, c.addr);
    sync(&mut gw);
    // a: rank 0's 8 CPU blocks earn 6 (rank 1's 4 GPU blocks 4): cost 8 − 6 = 2. b: 7 GPU
    // blocks, cost 1. (Tiers taken over both ranks, a earned 4 + 4 × 0.75 = 7: cost 1, a tie.)
    let o = complete(&mut gw, "m", &prompt);
    let d = fields(&debug(&o));
    assert_eq!(dest(&o), Some(format!("{B},{A}").as_str()), "{d:?}");
    assert_eq!(
        (d["cost"].as_str(), d["runner_up_cost"].as_str()),
        ("1.00", "2.00")
    );
    let (s, e) = c.post(
        &rt,
        "/v1/explain",
        &json!({"token_ids": prompt, "model": "m"}),
    );
    assert_eq!(s, 200, "{e}");
    assert_eq!(e["winner"]["instance_id"], "b", "{e:#}");
    assert_eq!(e["tied"], json!([]), "{e:#}");
    let a = row(&e, "a");
    assert_eq!(
        (
            a["cost"].clone(),
            a["matched_blocks"].clone(),
            a["dp_rank"].clone()
        ),
        (json!(2.0), json!([0, 8, 8]), json!(0)),
        "{e:#}"
    );
}

/// A remote-mode filter's request for a model no engine is registered for: the collector's
/// `/query` answers 404 and the filter fails open, and the `no_model` alarm names the model
/// (the filter's reports carry no `no_model` count in remote mode).
#[test]
fn a_remote_mode_request_for_an_unknown_model_raises_no_model() {
    let rt = runtime();
    let c = Collector::start(&rt);
    let w = c.register(&rt, "e0", A, 0, "m");
    c.store(&rt, w, 0, &[stored(None, 1, &tokens(0, 64), BS as usize)]);
    let remote = json!({"index": {"mode": "remote"}, "load": {"gateway_id": GATEWAY}});
    let mut gw = gateway(&config(remote), 1);
    gw.cluster_forward(CLUSTER, c.addr);
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_eq!(best(&o), Some(A), "{}", debug(&o));
    let o = complete(&mut gw, "alias", &tokens(0, 64));
    assert!(o.continued());
    assert_eq!(dest(&o), None, "fails open: {}", debug(&o));
    sync(&mut gw);
    let (_, e) = c.post(&rt, "/v1/explain", &json!({"token_ids": [1], "model": "m"}));
    assert_eq!(e["likely_causes"], json!([]), "nothing about m: {e}");
    let alarms = kvroute_collector::health::evaluate_alarms(&c.state);
    let no_model: Vec<&str> = alarms
        .iter()
        .filter(|a| a.kind.as_str() == "no_model")
        .map(|a| a.subject.as_str())
        .collect();
    assert_eq!(no_model, ["alias"], "{alarms:?}");
    // Its reports did not carry it: the collector counted the `/query` itself.
    let reports: Vec<Value> = gw
        .callouts()
        .iter()
        .filter(|c| c.path() == "/v1/load")
        .filter_map(|c| serde_json::from_slice(&c.body).ok())
        .collect();
    assert!(
        reports
            .iter()
            .all(|r| r.get("no_model").is_none_or(|m| m.get("alias").is_none())),
        "{reports:?}"
    );
}
