use serde_json::json;

use crate::common::*;

fn synced(extra: serde_json::Value) -> kvroute_host_test::Gateway {
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.hold(0, &tokens(0, 64), "default", "m", None, None);
    let mut gw = gateway(&config(extra), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    assert_eq!(
        best(&complete(&mut gw, "m", &tokens(0, 64))),
        Some(A),
        "the good request routes"
    );
    gw
}

fn json_req(gw: &mut kvroute_host_test::Gateway, body: &str) -> kvroute_host_test::Outcome {
    gw.request()
        .header("content-type", "application/json")
        .body(body.as_bytes().to_vec())
        .send()
}

#[test]
fn bad_bodies_fail_open_as_bad_body() {
    let mut gw = synced(json!({}));
    let cases = [
        "{not json",
        r#"{"model":"m","prompt":[1,2,3"#,
        r#"{"model":"m","prompt":[1,2.5,3]}"#,
        r#"{"model":"m","prompt":[1,"2",3]}"#,
        r#"{"model":"m","prompt":[1,-2,3]}"#,
        r#"{"model":"m","prompt":[1,4294967296]}"#,
        r#"{"model":"m","prompt":[1e3]}"#,
        r#"{"model":"m","prompt":[1,2]} trailing"#,
        r#"[1,2,3]"#,
        "\u{0}\u{1}binary",
    ];
    for (i, body) in cases.iter().enumerate() {
        let o = json_req(&mut gw, body);
        assert_fail_open(&gw, &o, "bad_body", i as u64);
        assert_eq!(
            o.request_body,
            body.as_bytes(),
            "the body goes on untouched"
        );
    }
}

#[test]
fn a_body_over_max_body_bytes_goes_on_unrouted_without_413() {
    let mut gw = synced(json!({"max_body_bytes": 2000}));
    let big = json!({"model": "m", "prompt": tokens(0, 1000)});
    let o = gw.request().json_body(&big).send();
    assert_fail_open(&gw, &o, "too_large", 0);
    assert_eq!(o.status(), Some(200));
    // Streamed in chunks (the size is only known as it grows).
    let body = serde_json::to_vec(&big).unwrap();
    let o = gw
        .request()
        .header("content-type", "application/json")
        .body_chunks(body.chunks(500).map(<[u8]>::to_vec).collect())
        .send();
    assert!(o.continued());
    assert_eq!(dest(&o), None);
    assert!(count(&gw, "too_large") >= 2);
    assert_eq!(o.request_body, body);
}

#[test]
fn default_limit_stays_under_envoys_buffer_limit() {
    // 1,000,000 bytes by default; the host's (Envoy's) buffer limit is 1 MiB: a 1.2 MB body
    // must not get a 413.
    let mut gw = synced(json!({}));
    let prompt: Vec<u32> = (0..150_000).map(|i| 1_000_000 + i).collect();
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "too_large", 0);
}

#[test]
fn empty_body_no_tokens_and_wrong_content_type() {
    let mut gw = synced(json!({}));
    let o = gw
        .request()
        .method("POST")
        .header("content-type", "application/json")
        .send();
    assert_fail_open(&gw, &o, "no_tokens", 0);
    let o = json_req(&mut gw, "   ");
    assert_fail_open(&gw, &o, "no_tokens", 1);
    // Text without ids is a text request now (tests/text.rs), not `no_tokens`.
    let o = json_req(
        &mut gw,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert!(debug(&o).contains("text=approx"), "{}", debug(&o));
    assert_eq!(count(&gw, "no_tokens"), 2);
    let o = json_req(&mut gw, r#"{"model":"m","prompt":[]}"#);
    assert_fail_open(&gw, &o, "no_tokens", 2);
    let body = serde_json::to_vec(&json!({"model": "m", "prompt": tokens(0, 64)})).unwrap();
    let o = gw
        .request()
        .header("content-type", "text/plain")
        .body(body)
        .send();
    assert_fail_open(&gw, &o, "bad_body", 0);
}

#[test]
fn bad_header_values_fail_open() {
    let mut gw = synced(json!({}));
    let o = gw
        .request()
        .header("x-token-ids", "%%%not base64%%%")
        .header("x-model", "m")
        .send();
    assert_fail_open(&gw, &o, "bad_header", 0);
    let o = gw
        .request()
        .header("x-token-ids", "1,2,-3")
        .header("x-model", "m")
        .send();
    assert_fail_open(&gw, &o, "bad_header", 1);
    let o = gw
        .request()
        .header_bytes("x-token-ids", &[0xff, 0xfe, 0x80, 0x41])
        .header("x-model", "m")
        .send();
    assert_fail_open(&gw, &o, "bad_header", 2);
    // A model header that is not UTF-8 is no model.
    let o = gw
        .request()
        .header("x-token-ids", "1,2,3")
        .header_bytes("x-model", &[0xc3, 0x28])
        .send();
    assert_fail_open(&gw, &o, "no_model", 0);
}

#[test]
fn a_missing_model_fails_open_as_no_model() {
    let mut gw = synced(json!({}));
    let o = gw
        .request()
        .json_body(&json!({"prompt": tokens(0, 64)}))
        .send();
    assert_fail_open(&gw, &o, "no_model", 0);
    let o = gw
        .request()
        .json_body(&json!({"prompt": tokens(0, 64), "model": 42}))
        .send();
    assert_fail_open(&gw, &o, "no_model", 1);
}

#[test]
fn a_stale_index_fails_open() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.hold(0, &tokens(0, 64), "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    // Never synced.
    let o = complete(&mut gw, "m", &tokens(0, 64));
    assert_fail_open(&gw, &o, "stale_index", 0);
}
