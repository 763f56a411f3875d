//! Helpers: the built module, a gateway with the filter, and a fake collector that serves the
//! feed protocol from a list of ops (the real collector is used in `sync.rs`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute::event::{Tier, WorkerId};
use kvroute::feed::{Op, Page};
use kvroute::hash;
use kvroute::mirror::{self, Keys, LoadId};
use kvroute::scope::{BlockKey, ScopeId};
use kvroute_host_test::{built_wasm, Callout, CalloutReply, Gateway, Mode, Outcome, Response};

pub const CLUSTER: &str = "kvroute_collector";
pub const PLUGIN: &str = "kvroute";
pub const DEST: &str = "x-gateway-destination-endpoint";
pub const BS: u32 = 16;

/// The stock module. Tests never build it: `make wasm` does.
pub fn wasm() -> PathBuf {
    built_wasm("kvroute_filter").unwrap_or_else(|e| panic!("{e}: run make wasm"))
}

/// The Higress module.
pub fn wasm_higress() -> PathBuf {
    built_wasm("kvroute_filter_higress").unwrap_or_else(|e| panic!("{e}: run make wasm"))
}

/// The stock module built without wasm SIMD, for runtimes that refuse it.
pub fn wasm_scalar() -> PathBuf {
    built_wasm("kvroute_filter_scalar").unwrap_or_else(|e| panic!("{e}: run make wasm"))
}

/// A config with the collector cluster, a fixed seed, the debug header and `extra` keys laid
/// over the top level.
pub fn config(extra: serde_json::Value) -> String {
    let mut c = serde_json::json!({
        "collector": {"cluster": CLUSTER},
        "random_seed": 7,
        "debug_header": "x-kvroute-debug",
        "log_level": "debug",
    });
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            c.insert(k.clone(), v.clone());
        }
    }
    // The tests count in sync periods of 100 ms ([`sync`]), not the shipped default.
    if let Some(index) = c.get_mut("index").and_then(|i| i.as_object_mut()) {
        index
            .entry("sync_interval_ms")
            .or_insert(serde_json::json!(SYNC_MS));
    } else if let Some(c) = c.as_object_mut() {
        c.insert(
            "index".into(),
            serde_json::json!({"sync_interval_ms": SYNC_MS}),
        );
    }
    c.to_string()
}

/// The tests' sync period, milliseconds.
pub const SYNC_MS: u64 = 100;

pub fn gateway(config: &str, workers: usize) -> Gateway {
    Gateway::builder(wasm())
        .config(config)
        .plugin_name(PLUGIN)
        .allow_on_headers_stop_iteration(true)
        .workers(workers)
        .build()
        .unwrap_or_else(|e| panic!("gateway: {e}"))
}

pub fn gateway_higress(config: &str) -> Gateway {
    Gateway::builder(wasm_higress())
        .config(config)
        .plugin_name(PLUGIN)
        .mode(Mode::Higress)
        .workers(1)
        .build()
        .unwrap_or_else(|e| panic!("gateway: {e}"))
}

/// Tokens `start..start + n`.
pub fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Block keys of `tokens` in a scope.
pub fn keys_of(
    tokens: &[u32],
    tenant: &str,
    model: &str,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<BlockKey> {
    let seqs =
        hash::sequence_hashes(tokens, BS as usize, hash::seed(lora, salt)).expect("block size");
    let scope = ScopeId::of(tenant, model, lora, salt);
    seqs.into_iter().map(|s| scope.key(s)).collect()
}

/// Answers the fake collector's `/query` callouts.
pub type QueryFn = Arc<dyn Fn(&Callout) -> CalloutReply + Send + Sync>;

#[derive(Clone)]
struct QueryHandler(QueryFn);

impl std::fmt::Debug for QueryHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueryHandler")
    }
}

#[derive(Debug, Default)]
struct FeedState {
    epoch: u64,
    cursor: u64,
    /// Every op so far: replayed in order, it rebuilds the index (the snapshot).
    history: Vec<Op>,
    pending: Vec<Op>,
    down: bool,
    pulls: u64,
    feed_bytes: u64,
    /// `Load` ops appended to every page served (the fleet picture at serve time).
    fleet: Vec<Op>,
    /// Bodies of the `POST /v1/load` reports received.
    reports: Vec<serde_json::Value>,
    /// Serve the fleet as a collector does: `Load` ops summed from the last report of each
    /// gateway, leaving out the one a `gateway=` query names (then said in the answer's
    /// `x-kvroute-load-excludes`). `Some(false)`: summed, but `gateway=` ignored (a collector
    /// that predates it).
    sum_reports: Option<bool>,
    /// How `/query` is answered (404 JSON, "no tokenizer", when unset).
    query: Option<QueryHandler>,
    /// Bodies of the `/query` callouts received.
    queries: Vec<serde_json::Value>,
    /// `x-kvroute-replica` of every feed answer, when set.
    replica: Option<String>,
}

/// A collector double that speaks `/v1/feed`.
#[derive(Clone, Debug, Default)]
pub struct FakeCollector {
    state: Arc<Mutex<FeedState>>,
}

impl FakeCollector {
    pub fn new() -> Self {
        let f = FakeCollector::default();
        f.state.lock().unwrap().epoch = 1;
        f
    }

    /// Serves `CLUSTER` of `gw`.
    pub fn attach(&self, gw: &mut Gateway) {
        self.attach_as(gw, CLUSTER);
    }

    /// Serves the cluster `name` of `gw`.
    pub fn attach_as(&self, gw: &mut Gateway, name: &str) {
        let me = self.clone();
        gw.cluster(name, move |c| me.answer(c));
    }

    fn answer(&self, c: &Callout) -> CalloutReply {
        let mut s = self.state.lock().unwrap();
        if s.down {
            return CalloutReply::Reset;
        }
        if c.path() == "/query" {
            s.queries
                .push(serde_json::from_slice(&c.body).unwrap_or(serde_json::Value::Null));
            return match &s.query {
                Some(h) => (h.0)(c),
                None => CalloutReply::Response(
                    Response::new(404).body(r#"{"error":"no tokenizer for this model"}"#),
                ),
            };
        }
        if c.path() == "/v1/load" {
            let report = serde_json::from_slice(&c.body).unwrap_or_default();
            s.reports.push(report);
            return CalloutReply::Response(Response::ok("{}"));
        }
        s.pulls += 1;
        let path = c.path().to_owned();
        let epoch = query_param(&path, "epoch");
        let page = if epoch == Some(s.epoch) {
            let ops = std::mem::take(&mut s.pending);
            if !ops.is_empty() {
                s.cursor += 1;
            }
            Page {
                flags: 0,
                epoch: s.epoch,
                cursor: s.cursor,
                ops,
            }
        } else {
            s.pending.clear();
            Page {
                flags: Page::RESET,
                epoch: s.epoch,
                cursor: s.cursor,
                ops: s.history.clone(),
            }
        };
        let mut page = page;
        page.ops.extend(s.fleet.iter().cloned());
        let reader = s
            .sum_reports
            .filter(|honour| *honour)
            .and_then(|_| text_param(&path, "gateway"));
        if s.sum_reports.is_some() {
            page.ops
                .extend(summed_reports(&s.reports, reader.as_deref()));
        }
        let bytes = page.to_bytes();
        s.feed_bytes += bytes.len() as u64;
        let mut resp = Response::ok(bytes).header("content-type", "application/x-kvroute-feed");
        if let Some(r) = reader {
            resp = resp.header("x-kvroute-load-excludes", &r);
        }
        if let Some(r) = &s.replica {
            resp = resp.header("x-kvroute-replica", r);
        }
        CalloutReply::Response(resp)
    }

    /// Answers every feed pull with `x-kvroute-replica: {replica}` (`index/count`).
    pub fn set_replica(&self, replica: &str) {
        self.state.lock().unwrap().replica = Some(replica.to_owned());
    }

    /// Serves `Load` ops summed from the gateways' reports (see `sum_reports`).
    pub fn sum_reports(&self, honour_gateway: bool) {
        self.state.lock().unwrap().sum_reports = Some(honour_gateway);
    }

    pub fn push(&self, op: Op) {
        let mut s = self.state.lock().unwrap();
        s.history.push(op.clone());
        s.pending.push(op);
    }

    /// A worker registered without a model: a candidate for any request.
    pub fn worker(&self, id: u32, instance: &str, dp_rank: u32, address: &str) {
        self.worker_of(id, instance, dp_rank, address, "", "");
    }

    /// A worker registered for `(tenant, model)`.
    pub fn worker_of(
        &self,
        id: u32,
        instance: &str,
        dp_rank: u32,
        address: &str,
        tenant: &str,
        model: &str,
    ) {
        self.push(Op::Worker {
            id: WorkerId(id),
            live: true,
            dp_rank,
            instance_id: instance.into(),
            address: address.into(),
            tenant: tenant.into(),
            model: model.into(),
        });
    }

    pub fn block_size(&self, tenant: &str, model: &str) {
        self.push(Op::BlockSize {
            tenant: tenant.into(),
            model: model.into(),
            block_size: BS,
        });
    }

    /// Worker `id` holds every full block of `tokens` in the scope.
    pub fn hold(
        &self,
        id: u32,
        tokens: &[u32],
        tenant: &str,
        model: &str,
        lora: Option<&str>,
        salt: Option<&str>,
    ) {
        self.push(Op::Blocks {
            worker: WorkerId(id),
            tier: Tier::Gpu,
            added: true,
            keys: keys_of(tokens, tenant, model, lora, salt),
        });
    }

    /// A collector restart: a new epoch (readers must resync), with an empty index unless ops
    /// are pushed again.
    pub fn restart(&self, keep: bool) {
        let mut s = self.state.lock().unwrap();
        s.epoch += 1;
        s.cursor = 0;
        s.pending.clear();
        if !keep {
            s.history.clear();
        }
    }

    pub fn set_down(&self, down: bool) {
        self.state.lock().unwrap().down = down;
    }

    /// Sets the fleet picture served with every page from now on.
    pub fn set_fleet(&self, ops: Vec<Op>) {
        self.state.lock().unwrap().fleet = ops;
    }

    /// Answers `/query` with `f` from now on.
    pub fn on_query(&self, f: impl Fn(&Callout) -> CalloutReply + Send + Sync + 'static) {
        self.state.lock().unwrap().query = Some(QueryHandler(Arc::new(f)));
    }

    /// The `/query` bodies received so far.
    pub fn queries(&self) -> Vec<serde_json::Value> {
        self.state.lock().unwrap().queries.clone()
    }

    /// The load reports received so far.
    pub fn reports(&self) -> Vec<serde_json::Value> {
        self.state.lock().unwrap().reports.clone()
    }

    pub fn pulls(&self) -> u64 {
        self.state.lock().unwrap().pulls
    }
}

/// `Load` ops from the last report of each gateway but `reader`.
fn summed_reports(reports: &[serde_json::Value], reader: Option<&str>) -> Vec<Op> {
    let mut last: std::collections::BTreeMap<String, &serde_json::Value> = Default::default();
    for r in reports {
        last.insert(r["gateway"].as_str().unwrap_or_default().to_owned(), r);
    }
    let mut sums: std::collections::BTreeMap<u64, [u64; 3]> = Default::default();
    for (gw, r) in last {
        for w in r["workers"].as_array().into_iter().flatten() {
            let sum = sums.entry(w["worker"].as_u64().unwrap_or(0)).or_default();
            if Some(gw.as_str()) != reader {
                for (i, k) in ["requests", "prefill_tokens", "decode_tokens"]
                    .iter()
                    .enumerate()
                {
                    sum[i] += w[*k].as_u64().unwrap_or(0);
                }
            }
        }
    }
    sums.into_iter()
        .map(|(w, [requests, prefill_tokens, decode_tokens])| Op::Load {
            worker: kvroute::event::WorkerId(w as u32),
            requests,
            prefill_tokens,
            decode_tokens,
            engine: None,
        })
        .collect()
}

/// A query parameter's text, percent-decoded.
pub fn text_param(path: &str, name: &str) -> Option<String> {
    let q = path.split_once('?')?.1;
    let raw = q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then_some(v)
    })?;
    let mut out = Vec::new();
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex: String = bytes.by_ref().take(2).map(char::from).collect();
            out.push(u8::from_str_radix(&hex, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

pub fn query_param(path: &str, name: &str) -> Option<u64> {
    let q = path.split_once('?')?.1;
    q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

/// Two instances, `a` (10.0.0.1:8000) and `b` (10.0.0.2:8000), model `m`, tenant `default`.
pub fn two_instances(feed: &FakeCollector) {
    feed.worker(0, "a", 0, "10.0.0.1:8000");
    feed.worker(1, "b", 0, "10.0.0.2:8000");
    feed.block_size("default", "m");
}

pub const A: &str = "10.0.0.1:8000";
pub const B: &str = "10.0.0.2:8000";

/// Lets one sync interval pass (every VM ticks; the lease holder pulls).
pub fn sync(gw: &mut Gateway) {
    gw.advance(Duration::from_millis(SYNC_MS));
}

/// Sends a completions request with a token prompt.
pub fn complete(gw: &mut Gateway, model: &str, prompt: &[u32]) -> Outcome {
    gw.request()
        .header("content-type", "application/json")
        .json_body(&serde_json::json!({"model": model, "prompt": prompt}))
        .send()
}

pub fn dest(o: &Outcome) -> Option<&str> {
    o.header(DEST)
}

/// First address of the destination header.
pub fn best(o: &Outcome) -> Option<&str> {
    dest(o).map(|d| d.split(',').next().unwrap_or(d))
}

pub fn count(gw: &Gateway, outcome: &str) -> u64 {
    gw.metric(&format!("kvroute.requests.{outcome}"))
        .unwrap_or(0)
}

pub fn debug(o: &Outcome) -> String {
    o.response
        .as_ref()
        .and_then(|r| r.headers.get("x-kvroute-debug"))
        .unwrap_or("")
        .to_owned()
}

pub fn keys() -> Keys {
    Keys::new(PLUGIN)
}

/// In-flight requests the filter recorded for worker slot `slot`.
pub fn in_flight(gw: &Gateway, slot: u32) -> u32 {
    booked(gw, slot).requests
}

/// Everything the filter booked for worker slot `slot`.
pub fn booked(gw: &Gateway, slot: u32) -> mirror::Load {
    let table = gw
        .shared_data(keys().load())
        .map(|(v, _)| v)
        .unwrap_or_default();
    mirror::load_get(&table, LoadId::slot(slot), u64::MAX, u64::MAX)
}

/// The request went on unrouted, the VM is healthy, and the counter says why.
pub fn assert_fail_open(gw: &Gateway, o: &Outcome, outcome: &str, before: u64) {
    assert!(o.continued(), "request must continue: {:?}", o.state);
    assert_eq!(dest(o), None, "no route header");
    assert_eq!(
        count(gw, outcome),
        before + 1,
        "counter {outcome}; debug: {}",
        debug(o)
    );
    assert!(gw.errors().is_empty(), "no trap: {:?}", gw.errors());
    assert_ne!(o.status(), Some(413));
}
