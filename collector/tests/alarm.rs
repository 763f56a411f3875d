//! The alarms against the real collector over HTTP: each raised by a real condition, and a
//! healthy fleet raising none. `/health` stays HTTP 200 when degraded.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::fleet_common::{counter, Collector};

async fn health(c: &Collector) -> (StatusCode, Value) {
    let r = c
        .http
        .get(format!("{}/health", c.url))
        .send()
        .await
        .unwrap();
    (r.status(), r.json().await.unwrap())
}

/// One worker, registered at an endpoint no engine publishes on: it never sends an event.
async fn silent_worker(args: &[&str]) -> (Collector, u32, u64) {
    let mut all = vec!["--scrape-interval-secs", "0"];
    all.extend_from_slice(args);
    let c = Collector::start(&all).await;
    let w = c.register("10.0.0.1:8000", 0, "10.0.0.1:8000").await;
    let epoch = c.epoch().await;
    (c, w, epoch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_serving_traffic_without_events_raises_engine_silent() {
    // A window of 0 s: the first evaluation that sees traffic and no event raises it.
    let (c, w, epoch) = silent_worker(&["--alarm-silent-secs", "0"]).await;
    let (s, _) = c
        .post_load(json!({"gateway": "gw-1", "epoch": epoch,
            "workers": [{"worker": w, "requests": 3}]}))
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, h) = health(&c).await;
    assert_eq!(s, StatusCode::OK, "degraded still answers 200");
    assert_eq!(h["status"], "degraded", "{h}");
    assert_eq!(h["alarms"][0]["alarm"], "engine_silent", "{h}");
    assert_eq!(h["alarms"][0]["subject"], "10.0.0.1:8000/0");
    let reason = h["reasons"][0].as_str().unwrap();
    assert!(reason.contains("--kv-events-config"), "{reason}");
    let m = c.metrics().await;
    assert_eq!(
        counter(
            &m,
            "kvroute_alarm{alarm=\"engine_silent\",subject=\"10.0.0.1:8000/0\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(counter(&m, "kvroute_alarms_raised"), 1.0);
    // The traffic stops: the alarm clears and its series goes.
    c.post_load(json!({"gateway": "gw-1", "epoch": epoch,
        "workers": [{"worker": w, "requests": 0}]}))
        .await;
    let (_, h) = health(&c).await;
    assert_eq!(h["status"], "ok", "{h}");
    let m = c.metrics().await;
    assert!(!m.contains("kvroute_alarm{"), "{m}");
    assert_eq!(counter(&m, "kvroute_alarms_raised"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_fleet_raises_no_alarm() {
    // The default window (300 s): traffic for an engine without events is not yet an alarm,
    // and an idle one never is.
    let (c, w, epoch) = silent_worker(&[]).await;
    let (_, h) = health(&c).await;
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["alarms"], json!([]));
    c.post_load(json!({"gateway": "gw-1", "epoch": epoch,
        "workers": [{"worker": w, "requests": 3}]}))
        .await;
    let (_, h) = health(&c).await;
    assert_eq!(h["status"], "ok", "{h}");
    let m = c.metrics().await;
    assert_eq!(counter(&m, "kvroute_alarms_raised"), 0.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_an_unregistered_model_raise_no_model() {
    let (c, w, epoch) = silent_worker(&[]).await;
    // The gateway's cumulative no_model count for "alias" grows from 0 to 4.
    for n in [0, 4] {
        let (s, v) = c
            .post_load(json!({"gateway": "gw-1", "epoch": epoch,
                "workers": [{"worker": w, "requests": 1}], "no_model": {"alias": n}}))
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    let (s, h) = health(&c).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["status"], "degraded", "{h}");
    assert_eq!(h["alarms"][0]["alarm"], "no_model", "{h}");
    assert_eq!(h["alarms"][0]["subject"], "alias");
    assert!(h["reasons"][0].as_str().unwrap().contains("gw-1"), "{h}");
    let m = c.metrics().await;
    assert_eq!(
        counter(&m, "kvroute_alarm{alarm=\"no_model\",subject=\"alias\"}"),
        1.0,
        "{m}"
    );
}

/// A remote-mode filter asks `/query` per request and reports no `no_model` counts of its
/// own: the collector counts the unknown model from the `/query` call itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_for_an_unregistered_model_raises_no_model() {
    let (c, _, _) = silent_worker(&[]).await;
    let query = |model: &str, body: Value| {
        let mut body = body;
        body["model_name"] = json!(model);
        c.http.post(format!("{}/query", c.url)).json(&body).send()
    };
    // A known model, and a request that fails for another reason: no alarm.
    let r = query("m", json!({"token_ids": [1, 2, 3, 4]}))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = query("alias", json!({"token_ids": "x"})).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let (_, h) = health(&c).await;
    assert_eq!(h["status"], "ok", "{h}");
    // Token ids for a model nobody registered: 404 as before, and the alarm names it.
    let r = query("alias", json!({"token_ids": [1, 2, 3, 4]}))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let (s, h) = health(&c).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["status"], "degraded", "{h}");
    assert_eq!(h["alarms"][0]["alarm"], "no_model", "{h}");
    assert_eq!(h["alarms"][0]["subject"], "alias");
    let reason = h["reasons"][0].as_str().unwrap();
    assert!(reason.contains("/query"), "the source is named: {reason}");
    let m = c.metrics().await;
    assert_eq!(
        counter(&m, "kvroute_alarm{alarm=\"no_model\",subject=\"alias\"}"),
        1.0,
        "{m}"
    );
}
