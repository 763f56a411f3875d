//! The truth check and the gateway alarms against the real collector: a fake engine's
//! `/metrics` (prefix-cache counters, cache config) and gateways' load reports raise
//! `hash_mismatch`, `gateway_stale`, `gateway_mismatch` and `text_approximate`; agreeing
//! figures and well-behaved gateways raise none.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use crate::fleet_common::{counter, Collector};

/// What the fake engine's page says: `(hits, queries, block_size)`.
type Page = Arc<Mutex<(u64, u64, u32)>>;

/// A fake vLLM engine serving `page` at `/metrics`; returns `ip:port`.
async fn engine(page: Page) -> String {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let (hits, queries, bs) = *page.lock().unwrap();
            async move {
                format!(
                    "vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                     vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 1.0\n\
                     vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"m\"}} {queries}.0\n\
                     vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"m\"}} {hits}.0\n\
                     vllm:cache_config_info{{block_size=\"{bs}\",enable_prefix_caching=\"True\",engine=\"0\"}} 1.0\n"
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn health(c: &Collector) -> Value {
    c.http
        .get(format!("{}/health", c.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls `/health` until `cond` holds (bounded); returns that answer.
async fn health_until(c: &Collector, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(c).await;
        if cond(&h) {
            return h;
        }
        assert!(Instant::now() < until, "{what} never happened: {h}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn alarms_of<'a>(h: &'a Value, kind: &str) -> Vec<&'a Value> {
    h["alarms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["alarm"] == kind)
        .collect()
}

/// Waits for the scraper to have read every engine at least `n` times.
async fn scraped(c: &Collector, n: f64) {
    let until = Instant::now() + Duration::from_secs(10);
    while counter(&c.metrics().await, "kvroute_engine_scrapes_total") < n {
        assert!(Instant::now() < until, "no scrape");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_reusing_what_kvroute_did_not_predict_raises_hash_mismatch() {
    let c = Collector::start(&[
        "--scrape-interval-secs",
        "0.05",
        "--hash-mismatch-min-tokens",
        "1000",
        "--hash-mismatch-hold-secs",
        "1",
    ])
    .await;
    // Engine a: kvroute predicts almost nothing of what it reuses. Engine b: they agree.
    let (pa, pb): (Page, Page) = (
        Arc::new(Mutex::new((0, 0, 4))),
        Arc::new(Mutex::new((0, 0, 4))),
    );
    let wa = c.register("a", 0, &engine(pa.clone()).await).await;
    let wb = c.register("b", 0, &engine(pb.clone()).await).await;
    let epoch = c.epoch().await;
    let report = |pred_a: u64, routed: u64, pred_b: u64| {
        json!({"gateway": "gw-1", "epoch": epoch, "workers": [
            {"worker": wa, "requests": 1, "predicted_cached_tokens": pred_a, "routed_prompt_tokens": routed},
            {"worker": wb, "requests": 1, "predicted_cached_tokens": pred_b, "routed_prompt_tokens": routed},
        ]})
    };
    // Baselines on both sides.
    c.post_load(report(0, 0, 0)).await;
    scraped(&c, 2.0).await;
    let h = health(&c).await;
    assert!(alarms_of(&h, "hash_mismatch").is_empty(), "{h}");
    // 10,000 prompt tokens each; both engines reused 8,000 of them.
    *pa.lock().unwrap() = (8000, 10_000, 4);
    *pb.lock().unwrap() = (8000, 10_000, 4);
    let (s, v) = c.post_load(report(100, 10_000, 7600)).await;
    assert_eq!(s, 200, "{v}");
    let h = health_until(&c, "hash_mismatch on a", |h| {
        !alarms_of(h, "hash_mismatch").is_empty()
    })
    .await;
    let raised = alarms_of(&h, "hash_mismatch");
    assert_eq!(raised.len(), 1, "only a: {h}");
    assert_eq!(raised[0]["subject"], "a/0");
    let reason = raised[0]["reason"].as_str().unwrap();
    assert!(reason.contains("predicted 100 cached tokens"), "{reason}");
    assert!(reason.contains("8000 reused"), "{reason}");
    assert!(reason.contains("likely causes: model_name"), "{reason}");
    let m = c.metrics().await;
    assert_eq!(
        counter(
            &m,
            "kvroute_truth_predicted_tokens{instance=\"a\",dp=\"0\"}"
        ),
        100.0,
        "{m}"
    );
    assert_eq!(
        counter(&m, "kvroute_truth_engine_tokens{instance=\"a\",dp=\"0\"}"),
        8000.0
    );
    assert_eq!(
        counter(&m, "kvroute_truth_ratio{instance=\"b\",dp=\"0\"}"),
        0.95
    );
    assert_eq!(
        counter(
            &m,
            "kvroute_truth_model_ratio{tenant=\"default\",model=\"m\"}"
        ),
        7700.0 / 16000.0
    );
    assert_eq!(
        counter(&m, "kvroute_alarm{alarm=\"hash_mismatch\",subject=\"a/0\"}"),
        1.0
    );
    // A report claiming more cached than prompt tokens is refused, nothing changed.
    let (s, v) = c.post_load(report(20_000, 10_000, 0)).await;
    assert_eq!(s, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_block_size_raises_hash_mismatch_naming_it() {
    let c = Collector::start(&["--scrape-interval-secs", "0.05"]).await;
    // Registered with 4-token blocks; the engine says 16.
    let p: Page = Arc::new(Mutex::new((0, 0, 16)));
    c.register("e", 0, &engine(p).await).await;
    let h = health_until(&c, "hash_mismatch", |h| {
        !alarms_of(h, "hash_mismatch").is_empty()
    })
    .await;
    let reason = alarms_of(&h, "hash_mismatch")[0]["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        reason.contains("block_size (registered 4, the engine's 16)"),
        "{reason}"
    );
    assert_eq!(
        alarms_of(&h, "hash_mismatch")[0]["causes"],
        json!(["block_size"])
    );
    // /v1/explain names it for a request to that model, and not for another tenant's.
    let explain = |body: Value| {
        let c = &c;
        async move {
            let r = c
                .http
                .post(format!("{}/v1/explain", c.url))
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, e) = explain(json!({"model": "m", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8]})).await;
    assert_eq!(s, 200, "{e}");
    assert_eq!(e["likely_causes"][0]["alarm"], "hash_mismatch", "{e}");
    assert_eq!(
        e["likely_causes"][0]["causes"],
        json!(["block_size"]),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_alarms_raise_on_their_conditions_and_not_otherwise() {
    let c = Collector::start(&[
        "--scrape-interval-secs",
        "0",
        "--alarm-gateway-stale-secs",
        "1",
    ])
    .await;
    let w = c.register("e", 0, "10.0.0.9:8000").await;
    let epoch = c.epoch().await;
    let contract = kvroute::hash::contract();
    let version = env!("CARGO_PKG_VERSION");
    let good = |text: Value| {
        json!({"gateway": "good", "epoch": epoch, "workers": [{"worker": w}],
            "version": version, "contract": contract, "feed_lag_ms": 150, "text": text})
    };
    c.post_load(good(json!({"exact": 0, "approx": 0}))).await;
    c.post_load(good(json!({"exact": 500, "approx": 3}))).await;
    // Another gateway: an old filter with another contract, a lagging feed, and its text
    // requests in approximate mode for want of a tokenizer.
    for (approx, lag) in [(0, 0), (40, 5000)] {
        let (s, v) = c
            .post_load(json!({"gateway": "bad", "epoch": epoch, "workers": [],
                "version": "0.0.1", "contract": "xxh3-1337-0000000000000000",
                "feed_lag_ms": lag,
                "text": {"exact": 1, "approx": approx, "no_tokenizer": approx}}))
            .await;
        assert_eq!(s, 200, "{v}");
    }
    let h = health(&c).await;
    let subjects = |kind: &str| -> Vec<String> {
        alarms_of(&h, kind)
            .iter()
            .map(|a| a["subject"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(subjects("gateway_mismatch"), ["bad"], "{h}");
    assert_eq!(subjects("gateway_stale"), ["bad"], "{h}");
    assert_eq!(subjects("text_approximate"), ["bad"], "{h}");
    let text = alarms_of(&h, "text_approximate")[0]["reason"]
        .as_str()
        .unwrap();
    assert!(text.contains("no tokenizer"), "{text}");
    let mismatch = alarms_of(&h, "gateway_mismatch")[0]["reason"]
        .as_str()
        .unwrap();
    assert!(mismatch.contains("filter version 0.0.1"), "{mismatch}");
    assert!(mismatch.contains("hashing contract"), "{mismatch}");
    // The good gateway stops reporting: stale once past the threshold.
    let h = health_until(&c, "good going stale", |h| {
        alarms_of(h, "gateway_stale")
            .iter()
            .any(|a| a["subject"] == "good")
    })
    .await;
    assert!(
        alarms_of(&h, "gateway_mismatch")
            .iter()
            .all(|a| a["subject"] != "good"),
        "{h}"
    );
}
