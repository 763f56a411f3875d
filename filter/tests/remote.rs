use std::time::Duration;

use kvroute_host_test::{CalloutReply, Response};
use serde_json::json;

use crate::common::*;

fn remote_config() -> String {
    config(
        json!({"index": {"mode": "remote"}, "collector": {"cluster": CLUSTER, "query_timeout_ms": 20}}),
    )
}

fn answer() -> serde_json::Value {
    json!({"block_size": 16, "query_blocks": 4, "instances": {
        "a": {"address": A, "longest_matched": 16, "gpu": 16, "cpu": 16, "disk": 16, "dp": {"0": 16}},
        "b": {"address": B, "longest_matched": 64, "gpu": 64, "cpu": 64, "disk": 64, "dp": {"0": 32, "1": 64}},
    }})
}

#[test]
fn remote_mode_asks_query_per_request_and_routes_on_the_answer() {
    let mut gw = gateway(&remote_config(), 1);
    gw.cluster(CLUSTER, |c| {
        assert_eq!(c.path(), "/query");
        assert_eq!(c.method(), "POST");
        let q: serde_json::Value = serde_json::from_slice(&c.body).unwrap();
        assert_eq!(q["model_name"], "m");
        assert!(q["token_ids"].as_array().map_or(0, Vec::len) >= 16);
        CalloutReply::Response(Response::ok(serde_json::to_vec(&answer()).unwrap()))
    });
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert!(o.continued());
    assert_eq!(dest(&o), Some(format!("{B},{A}").as_str()));
    assert_eq!(o.header("x-data-parallel-rank"), Some("1"));
    assert_eq!(count(&gw, "routed"), 1);
    // Header intake waits for the callout too, and never for the body.
    let o = gw
        .request()
        .header("x-token-ids", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16")
        .header("x-model", "m")
        .send();
    assert_eq!(best(&o), Some(B));
}

#[test]
fn a_query_timeout_fails_open_as_collector_error() {
    let mut gw = gateway(&remote_config(), 1);
    gw.cluster(CLUSTER, |_| CalloutReply::NoReply);
    let id = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(0, 64)}))
        .start();
    assert!(gw.outcome(id).paused(), "the request waits for /query");
    gw.advance(Duration::from_millis(25));
    let o = gw.outcome(id);
    assert_fail_open(&gw, &o, "collector_error", 0);
}

#[test]
fn collector_errors_fail_open() {
    let mut gw = gateway(&remote_config(), 1);
    gw.cluster(CLUSTER, |_| CalloutReply::Reset);
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "collector_error", 0);
    gw.cluster(CLUSTER, |_| {
        CalloutReply::Response(Response::new(503).body("down"))
    });
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "collector_error", 1);
    gw.cluster(CLUSTER, |_| {
        CalloutReply::Response(Response::ok("not json"))
    });
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "collector_error", 2);
    // An undeclared cluster: the dispatch itself fails.
    let mut gw = gateway(
        &config(json!({"index": {"mode": "remote"}, "collector": {"cluster": "nowhere"}})),
        1,
    );
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "collector_error", 0);
    // A model no engine is registered for (the collector's 404): no_match, as in local mode,
    // not a collector failure.
    let mut gw = gateway(&remote_config(), 1);
    gw.cluster(CLUSTER, |_| {
        CalloutReply::Response(
            Response::new(404).body(r#"{"error":"no instance registered for model m"}"#),
        )
    });
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "no_match", 0);
    assert_eq!(count(&gw, "collector_error"), 0);
    // Nothing matched anywhere: no_match.
    let mut gw = gateway(&remote_config(), 1);
    gw.cluster(CLUSTER, |_| {
        CalloutReply::Response(Response::ok(
            r#"{"block_size":16,"query_blocks":4,"instances":{}}"#,
        ))
    });
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "no_match", 0);
}
