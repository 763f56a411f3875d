//! Every HTTP endpoint through `app(state).oneshot(..)`: the happy paths, each bad input, and
//! the admin and read tokens.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute::feed::{Op, Page};
use kvroute_collector::decode::decode;
use kvroute_collector::{app, AppState, Config, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::common::config;

pub(crate) async fn call(
    state: &AppState,
    method: Method,
    uri: &str,
    body: Option<String>,
    token: Option<&str>,
) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(body.map(Body::from).unwrap_or_else(Body::empty))
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, bytes)
}

pub(crate) async fn post(state: &AppState, uri: &str, body: Value) -> (StatusCode, Value) {
    let (s, b) = call(state, Method::POST, uri, Some(body.to_string()), None).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

pub(crate) async fn post_raw(state: &AppState, uri: &str, body: &str) -> (StatusCode, Value) {
    let (s, b) = call(state, Method::POST, uri, Some(body.to_owned()), None).await;
    (
        s,
        serde_json::from_slice(&b).expect("error bodies are JSON"),
    )
}

pub(crate) fn error_of(v: &Value) -> &str {
    v["error"].as_str().expect("{\"error\": ...}")
}

fn reg_body(instance: &str, bs: u32) -> Value {
    json!({"instance_id": instance, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": bs})
}

/// A collector with worker "w" (block size 4) holding 3 blocks of tokens 1..=12.
async fn seeded() -> AppState {
    let state = Shared::new(config());
    let (s, _) = post(&state, "/register", reg_body("w", 4)).await;
    assert_eq!(s, StatusCode::CREATED);
    let batch = decode(&encode_events(
        EventFormat::Vllm033,
        Extras {
            vllm_group_fields: false,
        },
        1.0,
        &[stored(None, 7, &(1..=12).collect::<Vec<_>>(), 4)],
        Some(0),
    ))
    .unwrap();
    let id = state.read().workers().next().unwrap().id;
    state.apply_batch(id, 0, batch).await;
    state
}

#[tokio::test]
async fn register_creates_and_is_idempotent() {
    let state = Shared::new(config());
    let (s, v) = post(&state, "/register", reg_body("w", 16)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        v["address"], "127.0.0.1:8000",
        "endpoint IP + --default-serving-port"
    );
    assert_eq!(v["tenant_id"], "default");
    let (s, _) = post(&state, "/register", reg_body("w", 16)).await;
    assert_eq!(s, StatusCode::CREATED, "the same registration again");
    assert_eq!(state.read().workers().count(), 1);
}

#[tokio::test]
async fn register_accepts_the_rfc_aliases() {
    let state = Shared::new(config());
    let (s, v) = post(
        &state,
        "/register",
        json!({"instance_id": 42, "endpoint": "tcp://10.1.2.3:5557", "modelname": "m", "block_size": 4,
               "additionalsalt": "salt", "dp_rank": 1, "tenant_id": "t"}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["instance_id"], "42");
    assert_eq!(v["model_name"], "m");
    assert_eq!(v["dp_rank"], 1);
    let (s, _) = post(&state, "/register", json!({"instance_id": "x", "endpoint": "tcp://10.1.2.3:5558", "model": "m2", "block_size": 4})).await;
    assert_eq!(s, StatusCode::CREATED);
}

#[tokio::test]
async fn register_conflicts_are_409() {
    let state = Shared::new(config());
    post(&state, "/register", reg_body("w", 16)).await;
    let mut other = reg_body("w", 16);
    other["endpoint"] = json!("tcp://127.0.0.2:1");
    let (s, v) = post(&state, "/register", other).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(error_of(&v).contains("already registered"), "{v}");
    let (s, v) = post(&state, "/register", reg_body("w2", 32)).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(error_of(&v).contains("block size"), "{v}");
}

#[tokio::test]
async fn register_bad_inputs_are_400_naming_the_problem() {
    let state = Shared::new(Config {
        default_serving_port: None,
        ..config()
    });
    let cases: Vec<(&str, &str)> = vec![
        ("{\"instance_id\": ", "malformed JSON"),
        ("[1,2]", "invalid request"),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":"16"}"#,
            "invalid request",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m"}"#,
            "block_size",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":0,"address":"1.2.3.4:80"}"#,
            "block_size",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":-1}"#,
            "invalid request",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":4}"#,
            "serving address",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":4,"address":"host:80"}"#,
            "ip:port",
        ),
        (
            r#"{"instance_id":"a","endpoint":"http://1.2.3.4:5","model_name":"m","block_size":4,"address":"1.2.3.4:80"}"#,
            "endpoint",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://*:5557","model_name":"m","block_size":4,"address":"1.2.3.4:80"}"#,
            "endpoint",
        ),
        (
            r#"{"instance_id":"","endpoint":"tcp://1.2.3.4:5","model_name":"m","block_size":4,"address":"1.2.3.4:80"}"#,
            "instance_id",
        ),
        (
            r#"{"instance_id":"a","endpoint":"tcp://1.2.3.4:5","model_name":"","block_size":4,"address":"1.2.3.4:80"}"#,
            "model_name",
        ),
    ];
    for (body, want) in cases {
        let (s, v) = post_raw(&state, "/register", body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert!(
            error_of(&v).contains(want),
            "{body}: {v} should name {want:?}"
        );
    }
    // instance_id as ip:port gives the address when nothing else does.
    let (s, v) = post(&state, "/register", json!({"instance_id": "10.0.0.9:8080", "endpoint": "tcp://engine:5557", "model_name": "m", "block_size": 4})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["address"], "10.0.0.9:8080");
    // The service keeps serving after all that.
    let (s, _) = call(&state, Method::GET, "/health", None, None).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let state = Shared::new(Config {
        max_body_bytes: 1000,
        ..config()
    });
    let big = format!(
        "{{\"token_ids\": [{}], \"model_name\": \"m\"}}",
        vec!["1"; 1000].join(",")
    );
    let (s, v) = post_raw(&state, "/query", &big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error_of(&v).contains("too large"));
    let (s, _) = post_raw(&state, "/register", &big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn unregister_drops_the_worker_and_its_blocks() {
    let state = seeded().await;
    let (s, v) = post(
        &state,
        "/unregister",
        json!({"instance_id": "w", "model_name": "nope"}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = post_raw(&state, "/unregister", "{\"instance_id\": 1").await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = post_raw(&state, "/unregister", r#"{"instance_id": "w"}"#).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(error_of(&v).contains("model_name"), "{v}");
    let (s, v) = post(
        &state,
        "/unregister",
        json!({"instance_id": "w", "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["removed"], 1);
    assert_eq!(state.read().index.stats().holds, 0);
    let (s, _) = post(
        &state,
        "/query",
        json!({"token_ids": [1, 2, 3, 4], "model_name": "m"}),
    )
    .await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "the model went with its last worker"
    );
}

#[tokio::test]
async fn workers_lists_registrations_with_status() {
    let state = seeded().await;
    let (s, b) = call(&state, Method::GET, "/workers", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let w = &v["workers"][0];
    assert_eq!(w["instance_id"], "w");
    assert_eq!(w["blocks"], 3);
    assert_eq!(w["last_seq"], 0);
    assert_eq!(w["events"], 1);
    assert!(w.get("connected").is_some() && w.get("gaps").is_some());
}

#[tokio::test]
async fn query_answers_in_tokens_per_instance_and_rank() {
    let state = seeded().await;
    let (s, v) = post(
        &state,
        "/query",
        json!({"token_ids": (1..=14).collect::<Vec<u32>>(), "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["block_size"], 4);
    assert_eq!(v["query_blocks"], 3);
    let w = &v["instances"]["w"];
    assert_eq!(w["longest_matched"], 12);
    assert_eq!(
        (w["gpu"].clone(), w["cpu"].clone(), w["disk"].clone()),
        (json!(12), json!(12), json!(12))
    );
    assert_eq!(w["dp"]["0"], 12);
    assert_eq!(w["address"], "127.0.0.1:8000");
    // A miss: no instances.
    let (_, v) = post(
        &state,
        "/query",
        json!({"token_ids": [9, 9, 9, 9], "model": "m"}),
    )
    .await;
    assert_eq!(v["instances"], json!({}));
}

#[tokio::test]
async fn query_bad_inputs() {
    let state = Shared::new(Config {
        max_query_tokens: 100,
        ..config()
    });
    post(&state, "/register", reg_body("w", 4)).await;
    let (s, v) = post(
        &state,
        "/query",
        json!({"token_ids": [1, 2], "model_name": "unknown"}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(error_of(&v).contains("unknown model"), "{v}");
    let (s, v) = post(
        &state,
        "/query",
        json!({"token_ids": vec![1; 101], "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error_of(&v).contains("token_ids has 101"), "{v}");
    let (s, v) = post(
        &state,
        "/query",
        json!({"token_ids": [1, -2], "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(error_of(&v).contains("invalid request"), "{v}");
    let (s, v) = post(
        &state,
        "/query",
        json!({"token_ids": "1,2", "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = post_raw(&state, "/query", "not json").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(error_of(&v).contains("malformed JSON"), "{v}");
}

#[tokio::test]
async fn query_by_hash_takes_local_or_sequence_hashes_in_any_form() {
    let state = seeded().await;
    let tokens: Vec<u32> = (1..=12).collect();
    let locals = kvroute::hash::block_hashes(&tokens, 4, kvroute::hash::seed(None, None)).unwrap();
    let seqs = kvroute::hash::sequence_hashes(&tokens, 4, kvroute::hash::seed(None, None)).unwrap();
    // u64, i64 and decimal strings.
    let forms = json!([locals[0].0, locals[1].0 as i64, locals[2].0.to_string()]);
    let (s, v) = post(
        &state,
        "/query_by_hash",
        json!({"block_hashes": forms, "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["instances"]["w"]["longest_matched"], 12);
    let (_, v) = post(
        &state,
        "/query_by_hash",
        json!({"seq_hashes": [seqs[0].0.to_string(), seqs[1].0], "model_name": "m"}),
    )
    .await;
    assert_eq!(v["instances"]["w"]["longest_matched"], 8);
    let (s, v) = post(
        &state,
        "/query_by_hash",
        json!({"seq_hashes": [1], "block_hashes": [1], "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(error_of(&v).contains("exactly one"), "{v}");
    let (s, v) = post(
        &state,
        "/query_by_hash",
        json!({"seq_hashes": ["12x"], "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(error_of(&v).contains("\"12x\" is not a u64"), "{v}");
    let (s, _) = post(
        &state,
        "/query_by_hash",
        json!({"seq_hashes": [1], "model_name": "zzz"}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn feed_serves_a_snapshot_then_deltas() {
    let state = seeded().await;
    let (s, b) = call(&state, Method::GET, "/v1/feed", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let page = Page::decode(&b).unwrap();
    assert!(page.is_reset());
    assert!(page
        .ops
        .iter()
        .any(|op| matches!(op, Op::Worker { instance_id, .. } if instance_id == "w")));
    assert!(page
        .ops
        .iter()
        .any(|op| matches!(op, Op::BlockSize { block_size: 4, .. })));
    let keys: usize = page
        .ops
        .iter()
        .map(|op| {
            if let Op::Blocks { keys, .. } = op {
                keys.len()
            } else {
                0
            }
        })
        .sum();
    assert_eq!(keys, 3);
    // Nothing new: an empty delta page at the same cursor.
    let uri = format!("/v1/feed?epoch={}&since={}", page.epoch, page.cursor);
    let (_, b) = call(&state, Method::GET, &uri, None, None).await;
    let delta = Page::decode(&b).unwrap();
    assert!(!delta.is_reset() && delta.ops.is_empty());
    // A removal arrives as a delta (expanded by the cascade: all 3 blocks go).
    let id = state.read().workers().next().unwrap().id;
    let batch = decode(&encode_events(
        EventFormat::Vllm033,
        Extras {
            vllm_group_fields: false,
        },
        1.0,
        &[kvroute::event::KvEvent::BlockRemoved {
            hashes: vec![kvroute::event::EngineHash(7)],
            tier: kvroute::event::Tier::Gpu,
        }],
        Some(0),
    ))
    .unwrap();
    state.apply_batch(id, 1, batch).await;
    let (_, b) = call(&state, Method::GET, &uri, None, None).await;
    let delta = Page::decode(&b).unwrap();
    assert_eq!(delta.ops.len(), 1);
    match &delta.ops[0] {
        Op::Blocks {
            added: false, keys, ..
        } => assert_eq!(keys.len(), 3),
        other => panic!("{other:?}"),
    }
    // Another epoch (a restarted collector's reader) gets a snapshot.
    let (_, b) = call(
        &state,
        Method::GET,
        &format!("/v1/feed?epoch=1&since={}", delta.cursor),
        None,
        None,
    )
    .await;
    assert!(Page::decode(&b).unwrap().is_reset());
    // Garbage in the query string.
    let (s, b) = call(&state, Method::GET, "/v1/feed?since=abc", None, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&b).contains("error"));
}

#[tokio::test]
async fn health_and_metrics() {
    let state = seeded().await;
    let (s, b) = call(&state, Method::GET, "/health", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["status"], "ok");
    post(
        &state,
        "/query",
        json!({"token_ids": [1, 2, 3, 4], "model_name": "m"}),
    )
    .await;
    call(&state, Method::GET, "/v1/feed", None, None).await;
    let (s, b) = call(&state, Method::GET, "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8(b).unwrap();
    for want in [
        "kvroute_events_total{instance=\"w\",dp=\"0\",type=\"BlockStored\"} 1",
        "kvroute_index_blocks 3",
        "kvroute_index_holders 3",
        "kvroute_query_duration_seconds_count{endpoint=\"query\"} 1",
        "kvroute_feed_requests_total{kind=\"snapshot\"} 1",
        "kvroute_feed_bytes_total",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[tokio::test]
async fn unknown_paths_are_json_404() {
    let state = Shared::new(config());
    let (s, b) = call(&state, Method::GET, "/nope", None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(serde_json::from_slice::<Value>(&b).unwrap()["error"].is_string());
}

#[tokio::test]
async fn admin_and_read_tokens_are_enforced() {
    let state = Shared::new(Config {
        admin_token: Some("adm".into()),
        read_token: Some("rd".into()),
        ..config()
    });
    let body = Some(reg_body("w", 4).to_string());
    let (s, b) = call(&state, Method::POST, "/register", body.clone(), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(String::from_utf8_lossy(&b).contains("bearer token"));
    let (s, _) = call(&state, Method::POST, "/register", body.clone(), Some("rd")).await;
    assert_eq!(
        s,
        StatusCode::UNAUTHORIZED,
        "the read token is not an admin token"
    );
    let (s, _) = call(&state, Method::POST, "/register", body, Some("adm")).await;
    assert_eq!(s, StatusCode::CREATED);
    let q = Some(json!({"token_ids": [1, 2, 3, 4], "model_name": "m"}).to_string());
    for (method, uri, body) in [
        (Method::POST, "/query", q.clone()),
        (
            Method::POST,
            "/query_by_hash",
            Some(json!({"seq_hashes": [1], "model_name": "m"}).to_string()),
        ),
        (Method::GET, "/workers", None),
        (Method::GET, "/v1/feed", None),
    ] {
        let (s, _) = call(&state, method.clone(), uri, body.clone(), None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{uri} without a token");
        let (s, _) = call(&state, method.clone(), uri, body.clone(), Some("wrong")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{uri} with a wrong token");
        let (s, _) = call(&state, method, uri, body, Some("rd")).await;
        assert_eq!(s, StatusCode::OK, "{uri} with the read token");
    }
    let (s, _) = call(
        &state,
        Method::POST,
        "/unregister",
        Some(json!({"instance_id": "w", "model_name": "m"}).to_string()),
        Some("rd"),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(&state, Method::GET, "/health", None, None).await;
    assert_eq!(s, StatusCode::OK, "health is open");
    let (s, _) = call(&state, Method::GET, "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK, "metrics are open");
}

#[tokio::test]
async fn feed_pages_carry_the_fleet_load_at_serve_time() {
    let state = seeded().await;
    let (_, b) = call(&state, Method::GET, "/v1/feed", None, None).await;
    let page = Page::decode(&b).unwrap();
    assert!(
        !page.ops.iter().any(|op| matches!(op, Op::Load { .. })),
        "no report, no sample: no load op"
    );
    let worker = state.read().workers().next().unwrap().id;
    let report = json!({"gateway": "gw", "epoch": page.epoch,
        "workers": [{"worker": worker.0, "requests": 3, "prefill_tokens": 40, "decode_tokens": 9}]});
    let (s, _) = post(&state, "/v1/load", report).await;
    assert_eq!(s, StatusCode::OK);
    // The same cached delta page, now with the load appended.
    let uri = format!("/v1/feed?epoch={}&since={}", page.epoch, page.cursor);
    for _ in 0..2 {
        let (_, b) = call(&state, Method::GET, &uri, None, None).await;
        let delta = Page::decode(&b).unwrap();
        assert_eq!(
            delta.ops,
            [Op::Load {
                worker,
                requests: 3,
                prefill_tokens: 40,
                decode_tokens: 9,
                engine: None,
            }]
        );
    }
}
