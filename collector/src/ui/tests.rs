//! The fleet page's routes through `app(state).oneshot(..)`: static files open, data behind
//! the read token, and what `/v1/fleet/overview` says of a seeded collector.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::decode::decode;
use axum::Router;

use crate::{app, AppState, Config, Shared};

const READ: &str = "r3ad";

async fn call(
    router: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        Some(b) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(b.to_string())
        }
        None => Body::empty(),
    };
    let res = router
        .clone()
        .oneshot(req.body(body).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes().to_vec();
    (parts.status, parts.headers, bytes)
}

async fn overview(router: &Router) -> Value {
    let (s, _, b) = call(router, Method::GET, "/v1/fleet/overview", None, Some(READ)).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).unwrap()
}

fn guarded() -> AppState {
    Shared::new(Config {
        read_token: Some(READ.into()),
        default_serving_port: Some(8000),
        ..Config::default()
    })
}

#[tokio::test]
async fn static_files_are_open_typed_and_locked_down() {
    let router = app(guarded());
    for (uri, ty) in [
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
        ("/ui/pkg/kvroute_js.js", "text/javascript; charset=utf-8"),
        ("/ui/pkg/kvroute_js_bg.wasm", "application/wasm"),
    ] {
        let (s, h, b) = call(&router, Method::GET, uri, None, None).await;
        assert_eq!(s, StatusCode::OK, "{uri}");
        assert_eq!(h[header::CONTENT_TYPE], ty, "{uri}");
        assert!(!b.is_empty(), "{uri}");
        let csp = h[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.contains("connect-src 'self'"), "{csp}");
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    }
    let (_, _, wasm) = call(
        &router,
        Method::GET,
        "/ui/pkg/kvroute_js_bg.wasm",
        None,
        None,
    )
    .await;
    assert_eq!(&wasm[..4], b"\0asm");
    let (s, h, _) = call(&router, Method::GET, "/ui", None, None).await;
    assert_eq!(s, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(h[header::LOCATION], "ui/");
    for uri in [
        "/ui/nope.js",
        "/ui/../Cargo.toml",
        "/ui/pkg/",
        "/ui/%2e%2e/src/ui.rs",
    ] {
        let (s, _, b) = call(&router, Method::GET, uri, None, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{uri}");
        let v: Value = serde_json::from_slice(&b).expect("a JSON error");
        assert!(v["error"].is_string(), "{uri}");
    }
}

#[tokio::test]
async fn overview_takes_the_read_token() {
    let router = app(guarded());
    for token in [None, Some("wrong"), Some("r3ad ")] {
        let (s, _, b) = call(&router, Method::GET, "/v1/fleet/overview", None, token).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{token:?}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(v["error"].as_str().unwrap().contains("read endpoint"));
    }
    let (s, _, _) = call(
        &router,
        Method::POST,
        "/v1/fleet/overview",
        None,
        Some(READ),
    )
    .await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "read-only: GET only");
}

#[tokio::test]
async fn overview_tells_tiers_last_events_feed_and_gateways() {
    let state = guarded();
    // One router throughout, as the binary serves: the page's memory lives in it.
    let router = app(state.clone());
    for name in ["a", "b"] {
        let body = json!({"instance_id": name, "endpoint": "tcp://127.0.0.1:1",
                          "model_name": "m", "block_size": 4});
        let (s, _, b) = call(&router, Method::POST, "/register", Some(body), None).await;
        assert_eq!(s, StatusCode::CREATED, "{}", String::from_utf8_lossy(&b));
    }
    let before = overview(&router).await;
    let ids: Vec<(String, u32)> = before["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["instance_id"].as_str().unwrap().to_owned(),
                w["worker_id"].as_u64().unwrap() as u32,
            )
        })
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(before["workers"][0]["last_event_age_ms"].is_null());
    let a = ids.iter().find(|w| w.0 == "a").unwrap().1;
    // Three GPU blocks, then two more after them on CPU: their prefix is then only as good
    // as CPU.
    let gpu = stored(None, 7, &(1..=12).collect::<Vec<_>>(), 4);
    let cpu = KvEvent::BlockStored {
        parent: Some(EngineHash(9)),
        blocks: (0..2)
            .map(|i| StoredBlock {
                hash: EngineHash(10 + i),
                tokens: vec![100 + i as u32; 4],
                block_hash: None,
            })
            .collect(),
        tier: Tier::Cpu,
        lora_name: None,
        cache_salt: None,
    };
    let batch = decode(&encode_events(
        EventFormat::Vllm033,
        Extras {
            vllm_group_fields: false,
        },
        1.0,
        &[gpu, cpu],
        Some(0),
    ))
    .unwrap();
    state
        .apply_batch(kvroute::event::WorkerId(a), 0, batch)
        .await;
    let body = json!({"gateway": "gw-1", "epoch": state.read().feed.epoch(),
                      "workers": [{"worker": a, "requests": 2}]});
    let (s, _, _) = call(&router, Method::POST, "/v1/load", Some(body), Some(READ)).await;
    assert_eq!(s, StatusCode::OK);

    let o = overview(&router).await;
    let w = |name: &str| {
        o["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["instance_id"] == name)
            .unwrap()
            .clone()
    };
    assert_eq!(o["tiers_counted"], true);
    assert_eq!(w("a")["tiers"], json!({"gpu": 3, "cpu": 2, "disk": 0}));
    assert_eq!(w("b")["tiers"], json!({"gpu": 0, "cpu": 0, "disk": 0}));
    let age = w("a")["last_event_age_ms"]
        .as_u64()
        .expect("a just applied events");
    assert!(age < 5_000, "{age}");
    assert!(w("b")["last_event_age_ms"].is_null());
    assert_eq!(o["index"]["holds"], 5);
    let epoch = state.read().feed.epoch();
    assert_eq!(
        o["feed"]["epoch"],
        epoch.to_string(),
        "a string: u64 past 2^53"
    );
    assert_eq!(o["feed"]["cursor"], state.read().feed.head());
    assert_eq!(o["gateways"][0]["id"], "gw-1");
    assert!(o["gateways"][0]["report_age_ms"].as_u64().unwrap() < 5_000);
    assert_eq!(o["history"]["interval_ms"], 2000);
    // The sampler's first tick is at once; this test's runtime runs it when the test yields.
    let mut sampled = false;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        let o = overview(&router).await;
        let samples = o["history"]["samples"].as_array().unwrap().clone();
        if let Some(s) = samples.last() {
            // Taken before or after the batch, whichever the runtime ran it at.
            assert!(s["holds"] == 5 || s["holds"] == 0, "{s}");
            sampled = true;
            break;
        }
    }
    assert!(sampled, "the sampler took no sample");
    let (s, _, b) = call(
        &router,
        Method::GET,
        "/v1/fleet/overview?history=false",
        None,
        Some(READ),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let lean: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(lean["history"]["samples"], json!([]));
    assert_eq!(lean["index"]["holds"], 5);
    let (s, _, b) = call(
        &router,
        Method::GET,
        "/v1/fleet/overview?history=maybe",
        None,
        Some(READ),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let err: Value = serde_json::from_slice(&b).expect("a JSON error");
    assert!(err["error"].as_str().unwrap().contains("history"), "{err}");
}

/// The cost of the tier split at its limit, `MAX_TIER_SCAN_HOLDS` holds:
/// `cargo test -p kvroute-collector --lib ui::tests::tier_split_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn tier_split_cost() {
    let state = guarded();
    let workers = 4u32;
    let per = (super::MAX_TIER_SCAN_HOLDS / workers as usize) as u32;
    for i in 0..workers {
        let req: kvroute::api::RegisterRequest = serde_json::from_value(json!({
            "instance_id": format!("w{i}"), "endpoint": "tcp://127.0.0.1:1",
            "model_name": "m", "block_size": 4}))
        .unwrap();
        state.write().register(req).unwrap();
        let tokens: Vec<u32> = (0..per * 4)
            .map(|t| t.wrapping_mul(2654435761) ^ i)
            .collect();
        let batch = crate::decode::Batch {
            events: vec![stored(None, 1, &tokens, 4)],
            ..Default::default()
        };
        state.apply_batch_blocking(kvroute::event::WorkerId(i), 0, batch);
    }
    let hub = state.read();
    assert_eq!(hub.index.stats().holds, super::MAX_TIER_SCAN_HOLDS);
    let t = std::time::Instant::now();
    let split = super::count_tiers(&hub).unwrap();
    let took = t.elapsed();
    assert_eq!(
        split.iter().map(|c| c[0]).sum::<u64>(),
        super::MAX_TIER_SCAN_HOLDS as u64
    );
    println!(
        "tier split of {} holds: {took:?}",
        super::MAX_TIER_SCAN_HOLDS
    );
}
