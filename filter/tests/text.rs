use std::time::Duration;

use kvroute_host_test::{CalloutReply, Gateway, Outcome, Response};
use serde_json::{json, Value};

use crate::common::*;

/// A long, distinct text (`n` characters) so that prompts fill several 128-character blocks.
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.chars().count() < n {
        s.push_str(&format!(
            "{seed} line {i}: the quick brown fox jumps over the lazy dog. "
        ));
        i += 1;
    }
    s.chars().take(n).collect()
}

fn chat(gw: &mut Gateway, model: &str, messages: &Value) -> Outcome {
    gw.request()
        .path("/v1/chat/completions")
        .header("content-type", "application/json")
        .json_body(&json!({"model": model, "messages": messages}))
        .send()
}

fn completion(gw: &mut Gateway, model: &str, prompt: &str) -> Outcome {
    gw.request()
        .header("content-type", "application/json")
        .json_body(&json!({"model": model, "prompt": prompt}))
        .send()
}

/// A gateway with two instances `a` (slot 0) and `b` (slot 1) of model `m`, synced.
fn setup(extra: Value) -> (Gateway, FakeCollector) {
    let mut gw = gateway(&config(extra), 1);
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.attach(&mut gw);
    sync(&mut gw);
    (gw, feed)
}

fn text_metric(gw: &Gateway, name: &str) -> u64 {
    gw.metric(&format!("kvroute.text.{name}")).unwrap_or(0)
}

/// An answer in which `b` holds 48 tokens and `a` 16, of 64.
fn answer_b() -> CalloutReply {
    CalloutReply::Response(Response::ok(
        json!({"block_size": 16, "query_blocks": 4, "instances": {
            "a": {"address": A, "longest_matched": 16, "gpu": 16, "cpu": 16, "disk": 16, "dp": {"0": 16}},
            "b": {"address": B, "longest_matched": 48, "gpu": 48, "cpu": 48, "disk": 48, "dp": {"0": 48}},
        }})
        .to_string(),
    ))
}

#[test]
fn chat_and_completions_text_is_matched_by_the_collector() {
    let (mut gw, feed) = setup(json!({}));
    feed.on_query(|_| answer_b());
    let messages = json!([
        {"role": "system", "content": "You are terse. \u{00e9}\"quoted\""},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]);
    let o = chat(&mut gw, "m", &messages);
    assert!(o.continued());
    assert_eq!(dest(&o), Some(format!("{B},{A}").as_str()));
    assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
    assert!(debug(&o).contains("text=exact"), "{}", debug(&o));
    assert!(debug(&o).contains("matched_tokens=48; query_tokens=64"));
    // The messages went to the collector verbatim, with the request's scope.
    let q = feed.queries();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0]["messages"], messages);
    assert_eq!(q[0]["model_name"], "m");
    assert_eq!(q[0]["tenant_id"], "default");
    assert!(q[0].get("token_ids").is_none());
    // A completions prompt string, with a cache salt.
    let o = gw
        .request()
        .header("content-type", "application/json")
        .json_body(&json!({"model": "m", "prompt": "line\nbreak \u{1F600}", "cache_salt": "s"}))
        .send();
    assert_eq!(best(&o), Some(B));
    let q = feed.queries();
    assert_eq!(q[1]["prompt"], "line\nbreak \u{1F600}");
    assert_eq!(q[1]["cache_salt"], "s");
    assert_eq!(text_metric(&gw, "exact"), 2);
    assert_eq!(count(&gw, "routed"), 2);
    // Booked per worker slot like a token request, and released at the end.
    assert_eq!(in_flight(&gw, 1), 0);
    assert!(gw.errors().is_empty(), "{:?}", gw.errors());
    // Token ids win: a body with both is a token request, no text callout.
    let o = gw
        .request()
        .header("content-type", "application/json")
        .json_body(&json!({"model": "m", "prompt": tokens(0, 32), "messages": messages}))
        .send();
    assert!(o.continued());
    assert!(!debug(&o).contains("text="), "{}", debug(&o));
    assert_eq!(feed.queries().len(), 2);
}

#[test]
fn a_model_without_tokenizer_goes_approximate_and_is_not_asked_again() {
    let (mut gw, feed) = setup(json!({}));
    // No `/query` handler: the fake collector answers 404, no tokenizer.
    let prompt = text("doc", 1000);
    let first = completion(&mut gw, "m", &prompt);
    assert!(first.continued());
    assert!(
        debug(&first).contains("outcome=routed_cold"),
        "{}",
        debug(&first)
    );
    assert!(debug(&first).contains("text=approx"));
    let engine = best(&first).expect("cold text is decided").to_owned();
    assert_eq!(text_metric(&gw, "no_tokenizer"), 1);
    assert_eq!(feed.queries().len(), 1);
    // Same prompt, longer: no callout, and it follows the first.
    let o = completion(&mut gw, "m", &(prompt + " and more words after it"));
    assert_eq!(
        feed.queries().len(),
        1,
        "the model is known to have no tokenizer"
    );
    assert_eq!(text_metric(&gw, "callouts_skipped"), 1);
    assert_eq!(best(&o), Some(engine.as_str()));
    assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
    assert_eq!(text_metric(&gw, "approx"), 2);
    // After the memory's time-to-live the collector is asked again.
    gw.advance(Duration::from_secs(61));
    completion(&mut gw, "m", "short");
    assert_eq!(feed.queries().len(), 2);
}

#[test]
fn a_timeout_or_a_collector_down_falls_to_approximate() {
    let (mut gw, feed) = setup(json!({"collector": {"cluster": CLUSTER, "query_timeout_ms": 20}}));
    feed.on_query(|_| CalloutReply::NoReply);
    let id = gw
        .request()
        .header("content-type", "application/json")
        .json_body(&json!({"model": "m", "prompt": text("t", 600)}))
        .start();
    assert!(gw.outcome(id).paused(), "waits for the text query");
    gw.advance(Duration::from_millis(25));
    let o = gw.outcome(id);
    assert!(o.continued());
    assert!(best(&o).is_some(), "approximate mode decided");
    assert!(debug(&o).contains("text=approx"), "{}", debug(&o));
    assert_eq!(text_metric(&gw, "exact_errors"), 1);
    feed.on_query(|_| CalloutReply::Reset);
    let o = completion(&mut gw, "m", &text("t", 700));
    assert!(
        debug(&o).contains("outcome=routed;"),
        "shares the first prompt's blocks"
    );
    assert_eq!(text_metric(&gw, "exact_errors"), 2);
    // Exact only: a failure is a collector error, no header.
    let (mut gw, feed) = setup(json!({"text": {"approx": false}}));
    feed.on_query(|_| CalloutReply::Reset);
    let before = count(&gw, "collector_error");
    let o = completion(&mut gw, "m", &text("t", 600));
    assert_fail_open(&gw, &o, "collector_error", before);
}

#[test]
fn the_next_turn_of_a_conversation_lands_where_the_first_did() {
    let (mut gw, feed) = setup(json!({"text": {"exact": false}}));
    let mut engines = Vec::new();
    for c in 0..6 {
        let system = text(&format!("conversation {c}"), 700);
        let turn1 = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "What is in the document?"},
        ]);
        let o = chat(&mut gw, "m", &turn1);
        assert!(debug(&o).contains("text=approx"), "{}", debug(&o));
        engines.push(best(&o).expect("decided").to_owned());
    }
    for (c, engine) in engines.iter().enumerate() {
        let system = text(&format!("conversation {c}"), 700);
        let turn2 = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "What is in the document?"},
            {"role": "assistant", "content": "A fox, a dog, and many numbered lines."},
            {"role": "user", "content": [{"type": "text", "text": "Which line mentions 7?"}]},
        ]);
        let o = chat(&mut gw, "m", &turn2);
        assert_eq!(best(&o), Some(engine.as_str()), "conversation {c}");
        assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
    }
    assert_eq!(feed.queries().len(), 0, "text.exact off: no callout");
    assert_eq!(text_metric(&gw, "approx"), 12);
    // Another tenant shares nothing.
    let turn1 = json!([{"role": "system", "content": text("conversation 0", 700)}]);
    let o = gw
        .request()
        .header("content-type", "application/json")
        .header("x-tenant-id", "other")
        .json_body(&json!({"model": "m", "messages": turn1}))
        .send();
    assert!(!debug(&o).contains("outcome=routed;"), "{}", debug(&o));
}

#[test]
fn a_flood_of_distinct_prompts_keeps_the_table_bounded() {
    let (mut gw, _feed) = setup(json!({"text": {"exact": false, "max_entries": 1024}}));
    let prefix = format!("{}/text/", keys().prefix());
    for i in 0..400 {
        // 8 blocks each: 4 stored depths, 1,600 entries for a table of 1,024.
        let o = completion(&mut gw, "m", &text(&format!("{i:05}"), 1024));
        assert!(best(&o).is_some());
    }
    let shards: Vec<String> = gw
        .shared_data_keys()
        .into_iter()
        .filter(|k| k.starts_with(&prefix))
        .collect();
    assert_eq!(shards.len(), 2, "{shards:?}");
    for k in &shards {
        let (v, _) = gw.shared_data(k).unwrap();
        assert_eq!(v.len(), 1 + 512 * 24, "fixed size");
    }
    let evicted = text_metric(&gw, "evictions");
    assert!(evicted >= 1600 - 1024, "evictions counted: {evicted}");
    assert_eq!(text_metric(&gw, "lost_writes"), 0);
    assert!(gw.errors().is_empty());
}

#[test]
fn bad_text_fails_open_counted_and_asks_nobody() {
    let (mut gw, feed) = setup(json!({}));
    feed.on_query(|_| answer_b());
    let mut n = count(&gw, "bad_text");
    // Invalid UTF-8 inside the prompt string; a lone surrogate escape.
    for body in [
        b"{\"model\":\"m\",\"prompt\":\"ab\xff\xfecd\"}".to_vec(),
        br#"{"model":"m","prompt":"a\ud800b"}"#.to_vec(),
    ] {
        let o = gw
            .request()
            .header("content-type", "application/json")
            .body(body)
            .send();
        assert_fail_open(&gw, &o, "bad_text", n);
        n += 1;
    }
    // Content parts that are not text; content of the wrong type; 10k messages.
    let many: Vec<Value> = (0..10_000)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    for messages in [
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
        json!([{"role": "user", "content": 42}]),
        json!([{"content": "no role"}]),
        json!({"role": "user", "content": "not an array"}),
        Value::Array(many),
    ] {
        let o = chat(&mut gw, "m", &messages);
        assert_fail_open(&gw, &o, "bad_text", n);
        n += 1;
    }
    assert_eq!(feed.queries().len(), 0, "nothing sent on");
    // A 10 MB text is never buffered.
    let before = count(&gw, "too_large");
    let o = completion(&mut gw, "m", &"x".repeat(10 << 20));
    assert_fail_open(&gw, &o, "too_large", before);
    // And the next good request still routes.
    let o = completion(&mut gw, "m", "fine");
    assert_eq!(best(&o), Some(B));
}

#[test]
fn remote_mode_routes_text_on_the_answer_and_has_no_approximate_mode() {
    let mut gw = gateway(
        &config(json!({"index": {"mode": "remote"}, "collector": {"cluster": CLUSTER}})),
        1,
    );
    gw.cluster(CLUSTER, |c| {
        let q: Value = serde_json::from_slice(&c.body).unwrap();
        if q["model_name"] == "m" {
            answer_b()
        } else {
            CalloutReply::Response(Response::new(404).body("{}"))
        }
    });
    let o = completion(&mut gw, "m", "some text");
    assert_eq!(best(&o), Some(B));
    assert!(debug(&o).contains("text=exact"));
    let before = count(&gw, "no_match");
    let o = completion(&mut gw, "other", "some text");
    assert_fail_open(&gw, &o, "no_match", before);
}

#[test]
fn worker_vms_share_the_recorded_prefixes() {
    let mut gw = gateway(&config(json!({"text": {"exact": false}})), 2);
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.attach(&mut gw);
    sync(&mut gw);
    for c in 0..4 {
        let doc = text(&format!("shared {c}"), 900);
        let first = gw
            .request()
            .worker(c % 2)
            .header("content-type", "application/json")
            .json_body(&json!({"model": "m", "prompt": doc}))
            .send();
        let engine = best(&first).expect("decided").to_owned();
        // The next request lands on the other worker VM, which reads the same table.
        let o = gw
            .request()
            .worker(1 - c % 2)
            .header("content-type", "application/json")
            .json_body(&json!({"model": "m", "prompt": doc + " and a question"}))
            .send();
        assert_eq!(best(&o), Some(engine.as_str()), "prompt {c}");
        assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
    }
    assert!(gw.errors().is_empty());
}

#[test]
fn a_long_text_under_the_body_limit_routes() {
    let (mut gw, feed) = setup(json!({}));
    feed.on_query(|_| answer_b());
    // 900 KB of text (7,000 blocks): hashed in full, stored at 14 depths.
    let o = completion(&mut gw, "m", &text("long", 900_000));
    assert_eq!(best(&o), Some(B));
    feed.on_query(|_| CalloutReply::Reset);
    let o = completion(&mut gw, "m", &(text("long", 900_000) + "?"));
    assert_eq!(
        best(&o),
        Some(B),
        "approximate: follows the exact decision's record"
    );
    assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
    assert!(gw.errors().is_empty());
}

#[test]
fn exact_siblings_follow_a_recent_decision_before_the_events_do() {
    let (mut gw, feed) = setup(json!({}));
    // The collector tokenizes but holds nothing yet (the engine's KV events are not in).
    feed.on_query(|_| {
        CalloutReply::Response(Response::ok(
            r#"{"block_size":16,"query_blocks":64,"instances":{}}"#,
        ))
    });
    let doc = text("burst", 4096);
    let first = completion(&mut gw, "m", &doc);
    assert!(
        debug(&first).contains("outcome=routed_cold"),
        "{}",
        debug(&first)
    );
    let engine = best(&first).unwrap().to_owned();
    for i in 0..4 {
        let o = completion(&mut gw, "m", &format!("{doc} sibling {i}"));
        assert_eq!(best(&o), Some(engine.as_str()), "sibling {i}");
        assert!(debug(&o).contains("outcome=routed;"), "{}", debug(&o));
        assert!(debug(&o).contains("text=exact"));
    }
    // Past the speculative time-to-live the exact answer alone decides: cold again.
    gw.advance(Duration::from_millis(2100));
    let o = completion(&mut gw, "m", &format!("{doc} late"));
    assert!(debug(&o).contains("outcome=routed_cold"), "{}", debug(&o));
}
