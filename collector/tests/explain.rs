//! `/v1/explain` through `app(state).oneshot`: hand-worked decisions on a real index and fleet
//! load, and bad input answered 4xx JSON with nothing changed.

use axum::http::StatusCode;
use kvroute_collector::decode::decode;
use kvroute_collector::{AppState, Shared};
use kvroute_sim::wire::{encode_events, stored, EventFormat, Extras};
use serde_json::{json, Value};

use crate::common::config;
use crate::http::{error_of, post, post_raw};

/// Instances "a" and "b" (block size 4) for model "m"; "a" holds 3 blocks of tokens 1..=12.
async fn fleet() -> (AppState, u32) {
    let state = Shared::new(config());
    for (id, port, addr) in [("a", 1, "10.0.0.1:8000"), ("b", 2, "10.0.0.2:8000")] {
        let (s, v) = post(
            &state,
            "/register",
            json!({"instance_id": id, "endpoint": format!("tcp://127.0.0.1:{port}"),
                   "model_name": "m", "block_size": 4, "address": addr}),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let a = state
        .read()
        .workers()
        .find(|w| w.reg.instance_id == "a")
        .unwrap()
        .id;
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
    state.apply_batch(a, 0, batch).await;
    (state, a.0)
}

fn instance<'v>(e: &'v Value, id: &str) -> &'v Value {
    e["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["instance_id"] == id)
        .unwrap_or_else(|| panic!("{id} in {e}"))
}

#[tokio::test]
async fn the_hit_wins_until_its_queue_costs_more_than_the_miss() {
    let (state, a) = fleet().await;
    let prompt: Vec<u32> = (1..=16).collect();
    let (s, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": prompt, "model": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{e}");
    assert_eq!(
        (e["block_size"].clone(), e["query_blocks"].clone()),
        (json!(4), json!(4))
    );
    assert_eq!(e["verdict"], "route");
    // a: 4 blocks asked, 3 cached → 1 to prefill; b: cold → 4.
    assert_eq!(
        e["winner"],
        json!({"instance_id": "a", "address": "10.0.0.1:8000", "cost": 1.0})
    );
    assert_eq!(e["runner_up"]["instance_id"], "b");
    assert_eq!(e["runner_up"]["cost"], 4.0);
    assert_eq!(instance(&e, "a")["matched_tokens"], json!([12, 12, 12]));
    assert_eq!(instance(&e, "a")["matched_blocks"], json!([3, 3, 3]));
    assert_eq!(instance(&e, "b")["matched_tokens"], json!([0, 0, 0]));
    assert_eq!(e["instances"][0]["instance_id"], "a", "the winner first");

    // A gateway reports 2 requests and 40 uncached tokens on a: 40/4 = 10 queued blocks
    // + 1 + 2 requests = 13 against b's 4.
    let (_, feed) =
        crate::http::call(&state, axum::http::Method::GET, "/v1/feed", None, None).await;
    let epoch = kvroute::feed::Page::decode(&feed).unwrap().epoch;
    let (s, _) = post(
        &state,
        "/v1/load",
        json!({"gateway": "gw", "epoch": epoch,
               "workers": [{"worker": a, "requests": 2, "prefill_tokens": 40}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (_, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": prompt, "model": "m"}),
    )
    .await;
    assert_eq!(e["winner"]["instance_id"], "b", "{e}");
    assert_eq!(e["winner"]["cost"], 4.0);
    assert_eq!(e["runner_up"]["cost"], 13.0);
    let row = instance(&e, "a");
    assert_eq!(
        (row["requests"].clone(), row["prefill_tokens"].clone()),
        (json!(2), json!(40))
    );
    assert_eq!(row["competes"], true);
    // The terms: 1 × (10 queued + (4 − 3 credited) uncached) + 1 × 2 requests = 13.
    assert_eq!(
        row["terms"],
        json!({"credit_blocks": 3.0, "uncached_blocks": 1.0, "queued_blocks": 10.0,
               "requests": 2, "overlap_weight": 1.0, "request_weight": 1.0, "guarded": false}),
        "{e}"
    );
    assert_eq!(e["reports"][0]["gateway"], "gw", "{e}");
    assert!(e["reports"][0]["age_ms"].as_u64().unwrap() < 5_000, "{e}");
    // The block hashes are the index's keys: /query_by_hash finds a's 3 blocks by them.
    let seq = e["seq_hashes"].as_array().unwrap().clone();
    assert_eq!(seq.len(), 4);
    let (s, q) = post(
        &state,
        "/query_by_hash",
        json!({"seq_hashes": seq, "model_name": "m"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{q}");
    assert_eq!(q["instances"]["a"]["longest_matched"], 12, "{q}");
    // A guard of 30 tokens: a's queue is 40 over b's empty one, so its hit earns nothing:
    // 10 + 4 + 2 = 16.
    let (_, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": prompt, "model": "m", "policy": {"max_hit_queue_tokens": 30}}),
    )
    .await;
    let row = instance(&e, "a");
    assert_eq!(
        (
            row["cost"].clone(),
            row["terms"]["guarded"].clone(),
            row["terms"]["credit_blocks"].clone()
        ),
        (json!(16.0), json!(true), json!(0.0)),
        "{e}"
    );

    // The same request under other knobs: cost = overlap × (queued + uncached blocks)
    // + request × in flight; with 0.1 and 0: a 0.1 × (10 + 1) = 1.1, b 0.1 × 4 = 0.4.
    let (_, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": prompt, "model": "m", "policy": {"request": 0, "overlap": 0.1}}),
    )
    .await;
    let cost = |id: &str| instance(&e, id)["cost"].as_f64().unwrap();
    assert!(
        (cost("a") - 1.1).abs() < 1e-9 && (cost("b") - 0.4).abs() < 1e-9,
        "{e}"
    );
    assert_eq!(e["winner"]["instance_id"], "b");
}

#[tokio::test]
async fn cold_prompts_under_defer_and_unknown_models_say_so() {
    let (state, _) = fleet().await;
    let cold: Vec<u32> = (100..116).collect();
    let (_, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": cold, "model": "m", "policy": {"cold": "defer"}}),
    )
    .await;
    assert_eq!(e["verdict"], "deferred", "{e}");
    assert_eq!(e["winner"], Value::Null);
    assert_eq!(
        e["instances"].as_array().unwrap().len(),
        2,
        "both still listed"
    );
    let (_, e) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": cold, "model": "m"}),
    )
    .await;
    assert_eq!(
        e["verdict"], "route",
        "cold requests are decided by default"
    );
}

#[tokio::test]
async fn ties_are_listed_and_a_gateway_s_replica_share_breaks_them() {
    let (state, a) = fleet().await;
    let cold: Vec<u32> = (100..116).collect();
    let ask = |extra: Value| {
        let mut body = json!({"token_ids": cold, "model": "m"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let state = state.clone();
        async move { post(&state, "/v1/explain", body).await.1 }
    };
    // Both idle and cold: 4 blocks each, an exact tie the filter breaks with its own seed.
    let e = ask(json!({})).await;
    let (w, tied) = (e["winner"]["instance_id"].clone(), e["tied"].clone());
    assert_eq!(e["replica"], "0/1");
    assert!(
        (w == "a" && tied == json!(["b"])) || (w == "b" && tied == json!(["a"])),
        "{e}"
    );
    // Gateway gw-1 reports: gw-0 and gw-2 (asking as themselves) are replicas 0/2 and 1/2,
    // and each prefers its share of the idle instances (a is the first, b the second): no
    // tie left. gw-1 alone is 0/1.
    let (_, feed) =
        crate::http::call(&state, axum::http::Method::GET, "/v1/feed", None, None).await;
    let epoch = kvroute::feed::Page::decode(&feed).unwrap().epoch;
    let (s, _) = post(
        &state,
        "/v1/load",
        json!({"gateway": "gw-1", "epoch": epoch, "workers": [{"worker": a, "requests": 0}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    for (gateway, replica, winner) in [("gw-0", "0/2", "a"), ("gw-2", "1/2", "b")] {
        let e = ask(json!({"gateway": gateway})).await;
        assert_eq!(e["replica"], replica, "{e}");
        assert_eq!(e["winner"]["instance_id"], winner, "{e}");
        assert_eq!(e["tied"], json!([]), "{e}");
    }
    assert_eq!(ask(json!({"gateway": "gw-1"})).await["replica"], "0/1");
    // Affinity off: the exact tie again.
    let e = ask(json!({"gateway": "gw-2", "policy": {"replica_tie_band": 0}})).await;
    assert_eq!(e["tied"].as_array().map(Vec::len), Some(1), "{e}");
    // A hit is no tie: a holds 3 of the 4 blocks of 1..=16.
    let e = post(
        &state,
        "/v1/explain",
        json!({"token_ids": (1..=16).collect::<Vec<u32>>(), "model": "m", "gateway": "gw-2"}),
    )
    .await
    .1;
    assert_eq!(
        (e["winner"]["instance_id"].clone(), e["tied"].clone()),
        (json!("a"), json!([])),
        "{e}"
    );
}

#[tokio::test]
async fn bad_input_is_a_json_4xx_and_changes_nothing() {
    let (state, _) = fleet().await;
    let before = state.read().worker_views().len();
    let cases: Vec<(String, StatusCode, &str)> = vec![
        ("{".into(), StatusCode::BAD_REQUEST, ""),
        (
            json!({"token_ids": [1, 2], "model": "nope"}).to_string(),
            StatusCode::NOT_FOUND,
            "unknown model",
        ),
        (
            json!({"token_ids": [1, 2], "prompt": "x", "model": "m"}).to_string(),
            StatusCode::BAD_REQUEST,
            "exactly one",
        ),
        (
            json!({"model": "m"}).to_string(),
            StatusCode::BAD_REQUEST,
            "exactly one",
        ),
        (
            json!({"token_ids": [1], "model": "m", "policy": {"temperature": 11}}).to_string(),
            StatusCode::BAD_REQUEST,
            "policy.temperature",
        ),
        (
            json!({"token_ids": [1], "model": "m", "policy": {"colder": 1}}).to_string(),
            StatusCode::BAD_REQUEST,
            "colder",
        ),
        (
            json!({"token_ids": [1], "model": "m", "gateway": ""}).to_string(),
            StatusCode::BAD_REQUEST,
            "gateway",
        ),
        (
            json!({"token_ids": [-1], "model": "m"}).to_string(),
            StatusCode::BAD_REQUEST,
            "",
        ),
    ];
    for (body, status, says) in cases {
        let (s, v) = post_raw(&state, "/v1/explain", &body).await;
        assert_eq!(s, status, "{body}: {v}");
        assert!(error_of(&v).contains(says), "{body}: {v}");
    }
    // Too many tokens: the same limit as /query.
    let huge: Vec<u32> = vec![1; 2_000_000];
    let (s, v) = post(
        &state,
        "/v1/explain",
        json!({"token_ids": huge, "model": "m"}),
    )
    .await;
    assert!(s.is_client_error(), "{s}: {v}");
    assert_eq!(state.read().worker_views().len(), before);
}
