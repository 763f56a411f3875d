use std::collections::BTreeSet;

use kvroute::intake::encode_base64_u32;
use serde_json::json;

use crate::common::*;

/// `a` holds 4 blocks of the 64-token prompt, `b` holds 2.
fn longest_prefix_setup(extra: serde_json::Value) -> (kvroute_host_test::Gateway, Vec<u32>) {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    feed.hold(1, &prompt[..32], "default", "m", None, None);
    let mut gw = gateway(&config(extra), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    (gw, prompt)
}

#[test]
fn routes_to_the_longest_prefix_from_the_body_prompt() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    let o = complete(&mut gw, "m", &prompt);
    assert!(o.continued());
    assert_eq!(
        dest(&o),
        Some(format!("{A},{B}").as_str()),
        "best first, then the runner-up"
    );
    assert_eq!(count(&gw, "routed"), 1);
    assert!(debug(&o).contains("matched_tokens=64"), "{}", debug(&o));
    // Hand-worked: 4 query blocks, a holds all 4 (cost 0), b holds 2 (2 left to prefill).
    assert!(
        debug(&o).contains(&format!(
            "winner=a; cost=0.00; runner_up={B}; runner_up_cost=2.00"
        )),
        "{}",
        debug(&o)
    );
    assert_eq!(
        o.header("x-data-parallel-rank"),
        None,
        "single-rank instances get no rank header"
    );
    // A prompt that shares only b's... no: a prompt of which both hold 2 blocks: tie, either.
    let mut other = prompt[..32].to_vec();
    other.extend(tokens(1000, 32));
    let o = complete(&mut gw, "m", &other);
    assert!(matches!(best(&o), Some(A) | Some(B)));
}

#[test]
fn routes_from_every_body_field() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    for field in ["prompt_token_ids", "input_ids"] {
        let o = gw.request().json_body(&json!({"model": "m", field: prompt, "messages": [{"role": "user", "content": "x"}]})).send();
        assert_eq!(best(&o), Some(A), "{field}");
    }
    // A text prompt is not tokens: the next source (prompt_token_ids) is used.
    let o = gw
        .request()
        .json_body(&json!({"prompt": "hello", "model": "m", "prompt_token_ids": prompt}))
        .send();
    assert_eq!(best(&o), Some(A));
}

#[test]
fn routes_from_the_header_in_base64_and_decimal() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    let b64 = encode_base64_u32(&prompt);
    let o = gw
        .request()
        .header("x-token-ids", &b64)
        .header("x-model", "m")
        .send();
    assert_eq!(best(&o), Some(A));
    let dec: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let o = gw
        .request()
        .header("x-token-ids", &dec.join(","))
        .header("x-model", "m")
        .send();
    assert_eq!(best(&o), Some(A));
    // The header comes first in the default order: it wins over the body.
    let o = gw
        .request()
        .header("x-token-ids", &b64)
        .json_body(&json!({"model": "m", "prompt": tokens(5000, 64)}))
        .send();
    assert_eq!(best(&o), Some(A));
}

#[test]
fn header_only_sources_never_wait_for_the_body() {
    let cfg = config(json!({
        "tokens": {"sources": ["header:x-token-ids"]},
        "model": {"sources": ["header:x-model"]},
        "cache_salt": {"sources": []},
    }));
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(1, &prompt, "default", "m", None, None);
    // Envoy's default: a paused header phase gets no body. A filter that waited would hang.
    let mut gw = kvroute_host_test::Gateway::builder(wasm())
        .config(&cfg)
        .plugin_name(PLUGIN)
        .allow_on_headers_stop_iteration(false)
        .build()
        .unwrap();
    feed.attach(&mut gw);
    sync(&mut gw);
    let o = gw
        .request()
        .header("x-token-ids", &encode_base64_u32(&prompt))
        .header("x-model", "m")
        .json_body(&json!({"model": "ignored", "prompt": [1, 2, 3]}))
        .send();
    assert!(o.continued());
    assert_eq!(best(&o), Some(B));
    assert_eq!(
        o.request_body,
        serde_json::to_vec(&json!({"model": "ignored", "prompt": [1, 2, 3]})).unwrap()
    );
}

#[test]
fn routes_from_metadata_set_by_an_earlier_filter() {
    let cfg = config(json!({
        "tokens": {"sources": ["metadata:metadata/filter_metadata/auth/token_ids"]},
        "model": {"sources": ["metadata:filter_state.model"]},
    }));
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(1, &prompt, "default", "m", None, None);
    let mut gw = gateway(&cfg, 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    let dec: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let o = gw
        .request()
        .property(
            &["metadata", "filter_metadata", "auth", "token_ids"],
            dec.join(","),
        )
        .property(&["filter_state", "model"], "m")
        .send();
    assert_eq!(best(&o), Some(B));
}

#[test]
fn equal_matches_spread_by_load() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    feed.hold(1, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    // Requests held in flight: the second goes where the first did not.
    let body = json!({"model": "m", "prompt": prompt});
    let r1 = gw.request().json_body(&body).hold_response().start();
    let r2 = gw.request().json_body(&body).hold_response().start();
    let (o1, o2) = (gw.outcome(r1), gw.outcome(r2));
    let chosen: BTreeSet<&str> = [best(&o1).unwrap(), best(&o2).unwrap()].into();
    assert_eq!(chosen, [A, B].into(), "one each");
    assert_eq!(in_flight(&gw, 0) + in_flight(&gw, 1), 2);
    // Released in on_log once the streams end.
    gw.respond(r1, kvroute_host_test::Response::ok("done"));
    gw.respond(r2, kvroute_host_test::Response::ok("done"));
    assert_eq!(in_flight(&gw, 0) + in_flight(&gw, 1), 0);
}

#[test]
fn a_heavily_loaded_best_match_loses() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None); // a: 4 blocks
    feed.hold(1, &prompt[..48], "default", "m", None, None); // b: 3 blocks
    let other = tokens(9000, 256);
    feed.hold(0, &other, "default", "m", None, None); // only a holds `other`
                                                      // No speculative holders: the request sent to b below would make b hold all of `prompt`
                                                      // too, and the last pick would be a coin toss.
    let mut gw = gateway(&config(json!({"route": {"speculative_ttl_ms": 0}})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    // Idle: a wins.
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    // Load a with requests for `other` (each sent to a, each held in flight).
    let mut held = Vec::new();
    for _ in 0..3 {
        let id = gw
            .request()
            .json_body(&json!({"model": "m", "prompt": other}))
            .hold_response()
            .start();
        assert_eq!(best(&gw.outcome(id)), Some(A));
        held.push(id);
    }
    assert_eq!(in_flight(&gw, 0), 3);
    // 3 requests in flight cost more than the one block a holds beyond b.
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(best(&o), Some(B));
    assert_eq!(dest(&o), Some(format!("{B},{A}").as_str()));
    for id in held {
        gw.respond(id, kvroute_host_test::Response::ok(""));
    }
    assert_eq!(
        best(&complete(&mut gw, "m", &prompt)),
        Some(A),
        "load released"
    );
}

#[test]
fn an_idle_engine_of_another_model_is_never_chosen() {
    let feed = FakeCollector::new();
    feed.worker_of(0, "a", 0, A, "default", "m");
    feed.worker_of(1, "b", 0, B, "default", "other");
    feed.block_size("default", "m");
    feed.block_size("default", "other");
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt[..16], "default", "m", None, None); // a: 1 block of 4
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    // Load a: 3 requests in flight cost more than its one matched block saves.
    let mut held = Vec::new();
    for _ in 0..3 {
        let id = gw
            .request()
            .json_body(&json!({"model": "m", "prompt": prompt}))
            .hold_response()
            .start();
        held.push(id);
    }
    assert_eq!(in_flight(&gw, 0), 3);
    // b is idle but serves another model: a stays the choice, with no runner-up.
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(best(&o), Some(A));
    assert_eq!(dest(&o), Some(A));
    for id in held {
        gw.respond(id, kvroute_host_test::Response::ok(""));
    }
}

fn tie_sequence(seed: u64) -> Vec<String> {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    feed.hold(1, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({"random_seed": seed})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    (0..24)
        .map(|_| {
            best(&complete(&mut gw, "m", &prompt))
                .unwrap_or("-")
                .to_owned()
        })
        .collect()
}

#[test]
fn exact_ties_are_broken_at_random_reproducibly_with_a_seed() {
    let s = tie_sequence(7);
    let picked: BTreeSet<&str> = s.iter().map(String::as_str).collect();
    assert_eq!(
        picked,
        [A, B].into(),
        "both tied instances get requests: {s:?}"
    );
    assert_eq!(s, tie_sequence(7), "a fixed seed repeats the same choices");
    assert_ne!(s, tie_sequence(8), "another seed, other choices");
}

#[test]
fn dp_ranks_fold_into_their_instance_and_name_the_rank() {
    let feed = FakeCollector::new();
    feed.worker(0, "a", 0, A);
    feed.worker(1, "a", 1, A);
    feed.worker(2, "b", 0, B);
    feed.block_size("default", "m");
    let prompt = tokens(0, 64);
    feed.hold(1, &prompt, "default", "m", None, None);
    feed.hold(0, &prompt[..16], "default", "m", None, None);
    feed.hold(2, &prompt[..32], "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(dest(&o), Some(format!("{A},{B}").as_str()));
    assert_eq!(o.header("x-data-parallel-rank"), Some("1"));
}

#[test]
fn cold_requests_are_decided_by_load_and_booked() {
    let (mut gw, _) = longest_prefix_setup(json!({}));
    // Held: each booked request stays in flight, so the next cold one sees it.
    let mut held = Vec::new();
    let mut chosen = Vec::new();
    for i in 0..4 {
        let r = gw
            .request()
            .json_body(&json!({"model": "m", "prompt": tokens(7000 + i * 100, 64)}))
            .hold_response()
            .start();
        let o = gw.outcome(r);
        chosen.push(best(&o).unwrap_or("none").to_owned());
        held.push(r);
    }
    assert_eq!(count(&gw, "routed_cold"), 4);
    // Spread by load: two each, not four on one.
    assert_eq!(chosen.iter().filter(|c| *c == A).count(), 2, "{chosen:?}");
    assert_eq!(in_flight(&gw, 0), 2);
    assert_eq!(in_flight(&gw, 1), 2);
    // Each booked its whole prompt as prefill and the default decode budget.
    assert_eq!(booked(&gw, 0).prefill_tokens, 128);
    assert_eq!(booked(&gw, 0).decode_tokens, 512);
    for r in held {
        gw.respond(r, kvroute_host_test::Response::ok("done"));
    }
    assert_eq!(booked(&gw, 0), kvroute::mirror::Load::default());
    assert_eq!(booked(&gw, 1), kvroute::mirror::Load::default());
}

#[test]
fn a_prompt_shorter_than_a_block_is_decided_too_but_an_unknown_model_is_not() {
    let (mut gw, _) = longest_prefix_setup(json!({}));
    let o = complete(&mut gw, "m", &tokens(0, 15));
    assert!(matches!(best(&o), Some(A) | Some(B)), "{}", debug(&o));
    assert_eq!(count(&gw, "routed_cold"), 1);
    let before = count(&gw, "no_match");
    let o = complete(&mut gw, "unknown", &tokens(0, 64));
    assert_fail_open(&gw, &o, "no_match", before);
}

#[test]
fn deferred_cold_requests_get_no_header() {
    let (mut gw, prompt) = longest_prefix_setup(json!({"route": {"cold": "defer"}}));
    let before = count(&gw, "deferred");
    let o = complete(&mut gw, "m", &tokens(7000, 64));
    assert_fail_open(&gw, &o, "deferred", before);
    assert_eq!(in_flight(&gw, 0) + in_flight(&gw, 1), 0, "nothing booked");
    let o = complete(&mut gw, "m", &tokens(0, 15));
    assert_fail_open(&gw, &o, "deferred", before + 1);
    // A hit is still routed.
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
}

#[test]
fn decode_budget_comes_from_the_body_and_prefill_is_released_once() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    // a holds 4 blocks of it, b 2: a, with 2 blocks (32 tokens) to prefill.
    let mut longer = prompt.clone();
    longer.extend(tokens(9000, 32));
    let r1 = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": longer, "max_tokens": 1000}))
        .hold_response()
        .start();
    assert_eq!(best(&gw.outcome(r1)), Some(A));
    // The same prompt again: r1's speculative entry says a holds all 6 blocks (cost 2 queued
    // + 0 + 1 request = 3 against b's 4 uncached).
    let r2 = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": longer, "max_completion_tokens": 7, "max_tokens": 1000}))
        .hold_response()
        .start();
    let o2 = gw.outcome(r2);
    assert_eq!(best(&o2), Some(A), "{}", debug(&o2));
    let l = booked(&gw, 0);
    assert_eq!(
        (l.requests, l.prefill_tokens, l.decode_tokens),
        (2, 32, 1007)
    );
    // r1 ends: its prefill (32) and decode (1000) go, once; r2's stay.
    gw.respond(r1, kvroute_host_test::Response::ok("tokens"));
    let l = booked(&gw, 0);
    assert_eq!((l.requests, l.prefill_tokens, l.decode_tokens), (1, 0, 7));
    // A response without body bytes: the prefill goes at the end.
    let r3 = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(20_000, 40)}))
        .hold_response()
        .start();
    gw.respond(r3, kvroute_host_test::Response::new(204));
    gw.respond(r2, kvroute_host_test::Response::ok("tokens"));
    assert_eq!(booked(&gw, 0), kvroute::mirror::Load::default());
    assert_eq!(booked(&gw, 1), kvroute::mirror::Load::default());
}

/// Shared-data writes (any key) while `f` runs: the host's CAS tokens count every write.
fn writes_during(
    gw: &mut kvroute_host_test::Gateway,
    f: impl FnOnce(&mut kvroute_host_test::Gateway),
) -> u32 {
    gw.set_shared_data("test.probe", "1");
    let before = gw.shared_data("test.probe").unwrap().1;
    f(gw);
    gw.set_shared_data("test.probe", "2");
    gw.shared_data("test.probe").unwrap().1 - before - 1
}

#[test]
fn a_response_that_arrives_whole_is_released_in_one_write() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    let start = |gw: &mut kvroute_host_test::Gateway, tail: u32| {
        // Two blocks past what a holds (new each time): prefill to release.
        let mut prompt = prompt.clone();
        prompt.extend(tokens(tail, 32));
        let r = gw
            .request()
            .json_body(&json!({"model": "m", "prompt": prompt, "max_tokens": 50}))
            .hold_response()
            .start();
        assert_eq!(best(&gw.outcome(r)), Some(A));
        let l = booked(gw, 0);
        assert_eq!((l.requests, l.prefill_tokens), (1, 32));
        r
    };
    let ok = || kvroute_host_test::Response::ok("tokens");
    let cases = [
        // Not streamed: the first body bytes end the response.
        (ok(), 1),
        // Trailers after the body (as a stream ends): the prefill at the first bytes, the
        // rest at the end.
        (ok().trailer("grpc-status", "0"), 2),
        // Envoy's HTTP/1 codec: the body, then an empty last chunk. Its content-length says
        // the first bytes were all of it.
        (ok().header("content-length", "6").trailer("x-end", "1"), 1),
        // A longer content-length: more is coming, two steps.
        (ok().header("content-length", "7").trailer("x-end", "1"), 2),
    ];
    for (tail, (resp, writes)) in (9000..).step_by(100).zip(cases) {
        let r = start(&mut gw, tail);
        let n = writes_during(&mut gw, |gw| {
            gw.respond(r, resp);
        });
        assert_eq!(n, writes, "tail {tail}");
        assert_eq!(booked(&gw, 0), kvroute::mirror::Load::default());
    }
}

#[test]
fn matched_token_ratio_and_reads_are_reported() {
    let (mut gw, prompt) = longest_prefix_setup(json!({}));
    complete(&mut gw, "m", &prompt);
    let ratio = gw
        .histogram("kvroute.matched_token_ratio_pct")
        .unwrap_or_default();
    assert_eq!(ratio, vec![100]);
    let reads = gw.histogram("kvroute.lookup_reads").unwrap_or_default();
    assert_eq!(reads.len(), 1);
    assert!(reads[0] <= 6, "{reads:?}");
    assert!(gw.metric("kvroute.sync_lag_ms").is_some());
    assert!(gw.metric("kvroute.feed_bytes").unwrap_or(0) > 0);
}
