//! Fleet-wide load and speculative holders: the lease holder's `/v1/load` reports, the fleet
//! totals and engine samples of the feed steering cold requests, and speculative entries.

use kvroute::event::WorkerId;
use kvroute::feed::{EngineSample, Op};
use kvroute::router::EngineLoad;
use std::time::Duration;

use serde_json::json;

use crate::common::*;

fn setup(extra: serde_json::Value) -> (kvroute_host_test::Gateway, FakeCollector) {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let mut gw = gateway(&config(extra), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    (gw, feed)
}

fn fleet(worker: u32, requests: u64, prefill_tokens: u64, engine: Option<EngineSample>) -> Op {
    Op::Load {
        worker: WorkerId(worker),
        requests,
        prefill_tokens,
        decode_tokens: 0,
        engine,
    }
}

fn hold(gw: &mut kvroute_host_test::Gateway, start: u32) -> (kvroute_host_test::RequestId, String) {
    let r = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(start, 64), "max_tokens": 10}))
        .hold_response()
        .start();
    let to = best(&gw.outcome(r)).unwrap_or("none").to_owned();
    (r, to)
}

#[test]
fn the_lease_holder_reports_absolute_counts() {
    let (mut gw, feed) = setup(json!({"load": {"gateway_id": "gw-1"}}));
    let (r1, to1) = hold(&mut gw, 1000);
    let (r2, to2) = hold(&mut gw, 2000);
    assert_ne!(to1, to2, "spread by load");
    sync(&mut gw);
    let last = feed.reports().last().cloned().expect("a report");
    assert_eq!(last["gateway"], "gw-1");
    assert_eq!(last["epoch"], 1);
    let mut workers = last["workers"].as_array().cloned().unwrap_or_default();
    workers.sort_by_key(|w| w["worker"].as_u64());
    assert_eq!(
        workers,
        [
            json!({"worker": 0, "requests": 1, "prefill_tokens": 64, "decode_tokens": 10,
                "predicted_cached_tokens": 0, "routed_prompt_tokens": 64}),
            json!({"worker": 1, "requests": 1, "prefill_tokens": 64, "decode_tokens": 10,
                "predicted_cached_tokens": 0, "routed_prompt_tokens": 64}),
        ]
    );
    // Absolute, not deltas: the same again on the next tick; nothing once they end.
    sync(&mut gw);
    assert_eq!(
        feed.reports().last().map(|r| r["workers"].clone()),
        Some(last["workers"].clone())
    );
    gw.respond(r1, kvroute_host_test::Response::ok("x"));
    gw.respond(r2, kvroute_host_test::Response::ok("x"));
    sync(&mut gw);
    // Nothing in flight; the cumulative truth-check counts stay.
    let last = feed.reports().last().cloned().expect("a report");
    assert!(
        last["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["requests"] == 0 && w["routed_prompt_tokens"] == 64),
        "{last}"
    );
    assert!(gw.metric("kvroute.load_reports").unwrap_or(0) >= 3);
}

#[test]
fn the_default_gateway_id_is_made_once() {
    let (mut gw, feed) = setup(json!({}));
    sync(&mut gw);
    sync(&mut gw);
    let ids: Vec<String> = feed
        .reports()
        .iter()
        .filter_map(|r| r["gateway"].as_str().map(str::to_owned))
        .collect();
    assert!(ids.len() >= 2, "{ids:?}");
    assert!(ids[0].starts_with("envoy-"), "{ids:?}");
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
}

#[test]
fn no_reports_without_fleet_mode() {
    let (mut gw, feed) = setup(json!({"load": {"fleet": false}}));
    sync(&mut gw);
    assert!(feed.reports().is_empty());
}

#[test]
fn fleet_totals_steer_a_cold_request_away_from_a_busy_engine() {
    for fleet_on in [true, false] {
        let (mut gw, feed) = setup(json!({"load": {"fleet": fleet_on}}));
        // This gateway has one request on one engine; other gateways have ten on the other.
        let (_r, on) = hold(&mut gw, 1000);
        let other = if on == A { 1 } else { 0 };
        feed.set_fleet(vec![fleet(other, 10, 5000, None)]);
        sync(&mut gw);
        let (_r2, to) = hold(&mut gw, 3000);
        // With the fleet's totals the other engine is the busy one; without, it looks idle.
        assert_eq!(to == on, fleet_on, "fleet {fleet_on}");
    }
}

#[test]
fn released_load_is_not_counted_again_from_the_collectors_totals() {
    // Honoured: the feed's totals leave this gateway out, it adds its own live books.
    // Not honoured (an older collector): its last report is subtracted from the totals, and
    // between a report's answer and the next page a released request still looks in flight.
    for honour in [true, false] {
        let (mut gw, feed) = setup(json!({"load": {"gateway_id": "gw/1 a"}}));
        feed.sum_reports(honour);
        // Two requests in flight, one per engine; the first then finishes.
        let (big, on_big) = hold(&mut gw, 1000);
        let (_small, on_small) = hold(&mut gw, 2000);
        assert_ne!(on_big, on_small);
        sync(&mut gw);
        gw.respond(big, kvroute_host_test::Response::ok("x"));
        // One more tick: the report of zero for the freed engine is answered, the page it
        // pulled in the same tick was summed before it.
        sync(&mut gw);
        let pulled = gw
            .callouts()
            .iter()
            .rfind(|c| c.path().starts_with("/v1/feed"))
            .map(|c| c.path().to_owned())
            .unwrap_or_default();
        assert!(pulled.contains("gateway=gw%2F1%20a"), "{pulled}");
        // The freed engine is now the idle one: a cold request belongs there.
        let (_next, to) = hold(&mut gw, 3000);
        // Against an older collector the released request still counts until the next page
        // (the phantom this protocol removes), so the cold request goes to the busy engine.
        assert_eq!(to == on_big, honour, "honoured {honour}: sent to {to}");
        assert_eq!(gw.metric("kvroute.load_errors").unwrap_or(0), 0);
    }
}

#[test]
fn a_saturated_engine_gets_no_cold_request_and_stale_samples_are_ignored() {
    let full = EngineSample {
        load: EngineLoad {
            waiting: 9,
            running: 4,
            kv_permille: 500,
        },
        age_ms: 100,
        stale: false,
    };
    for (sample, saturated) in [
        (full, true),
        (
            EngineSample {
                load: EngineLoad {
                    waiting: 0,
                    kv_permille: 990,
                    ..full.load
                },
                ..full
            },
            true,
        ),
        (
            EngineSample {
                stale: true,
                ..full
            },
            false,
        ),
        (
            EngineSample {
                age_ms: 60_000,
                ..full
            },
            false,
        ),
        (
            EngineSample {
                load: EngineLoad {
                    waiting: 7,
                    kv_permille: 970,
                    ..full.load
                },
                ..full
            },
            false,
        ),
    ] {
        let (mut gw, feed) = setup(json!({}));
        // This gateway has a request on one engine; the other, idle by the books, reports a
        // sample.
        let (_r, on) = hold(&mut gw, 1000);
        let other = if on == A { 1 } else { 0 };
        feed.set_fleet(vec![fleet(other, 0, 0, Some(sample))]);
        sync(&mut gw);
        let (_r2, to) = hold(&mut gw, 3000);
        assert_eq!(to == on, saturated, "{sample:?}");
    }
}

/// A request whose end never reached the books (a lost `on_log`) leaks its counts; an engine
/// that reports itself idle in two fresh samples, while the books are older than the leak
/// age, clears them.
#[test]
fn leaked_books_are_cleared_after_two_idle_samples() {
    let (mut gw, feed) = setup(json!({"load": {"gateway_id": "gw-1"}}));
    let (_held, on) = hold(&mut gw, 1000);
    let slot = if on == A { 0 } else { 1 };
    let idle = EngineSample {
        load: EngineLoad::default(),
        age_ms: 0,
        stale: false,
    };
    feed.set_fleet(vec![fleet(slot, 1, 64, Some(idle))]);
    // Fresh samples, but the booking is younger than the leak age: kept.
    for _ in 0..5 {
        sync(&mut gw);
    }
    assert_eq!(gw.metric("kvroute.leaks_repaired").unwrap_or(0), 0);
    let booked = feed.reports().last().map(|r| r["workers"].clone());
    assert_eq!(
        booked.as_ref().and_then(|w| w.as_array()).map(Vec::len),
        Some(1)
    );
    // Past the leak age, the next idle samples clear the entry, once.
    for _ in 0..10 {
        sync(&mut gw);
    }
    assert_eq!(gw.metric("kvroute.leaks_repaired"), Some(1));
    // (The worker stays listed for its cumulative truth-check counts, at no load.)
    let workers = feed.reports().last().map(|r| r["workers"].clone());
    assert!(
        workers
            .as_ref()
            .and_then(|w| w.as_array())
            .is_some_and(|w| w
                .iter()
                .all(|w| w["requests"] == 0 && w["prefill_tokens"] == 0)),
        "the report no longer counts the leaked request: {workers:?}"
    );
}

#[test]
fn a_speculative_entry_routes_a_sibling_until_it_expires() {
    let (mut gw, _feed) = setup(json!({}));
    let prompt = tokens(5000, 160);
    let (r1, first) = hold(&mut gw, 5000);
    gw.respond(r1, kvroute_host_test::Response::ok("x"));
    // Sibling: the first 64 tokens shared (stored depths 1, 2, 4), then its own.
    let mut sibling = prompt[..64].to_vec();
    sibling.extend(tokens(90_000, 64));
    let o = complete(&mut gw, "m", &sibling);
    assert_eq!(best(&o).unwrap_or(""), first, "{}", debug(&o));
    assert!(debug(&o).contains("matched_tokens=64"), "{}", debug(&o));
    // Past the TTL (2 s) the entries are gone: cold.
    for _ in 0..25 {
        sync(&mut gw);
    }
    let mut cousin = prompt[..64].to_vec();
    cousin.extend(tokens(95_000, 64));
    let o = complete(&mut gw, "m", &cousin);
    assert!(debug(&o).contains("matched_tokens=0"), "{}", debug(&o));
    assert!(debug(&o).contains("routed_cold"), "{}", debug(&o));
}

#[test]
fn speculative_entries_can_be_turned_off() {
    let (mut gw, _feed) = setup(json!({"route": {"speculative_ttl_ms": 0}}));
    let (r1, _) = hold(&mut gw, 5000);
    gw.respond(r1, kvroute_host_test::Response::ok("x"));
    let o = complete(&mut gw, "m", &tokens(5000, 64));
    assert!(debug(&o).contains("matched_tokens=0"), "{}", debug(&o));
}

/// The long prompt's engine, after `wait`, against a shorter prompt booked after it on the
/// other engine: where does a small cold request go?
fn after_a_drain(extra: serde_json::Value, wait: Duration) -> (String, String) {
    let (mut gw, _feed) = setup(extra);
    let long = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(10_000, 4096), "max_tokens": 1}))
        .hold_response()
        .start();
    let long_on = best(&gw.outcome(long)).unwrap_or("none").to_owned();
    gw.advance(wait);
    let short = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(20_000, 2048), "max_tokens": 1}))
        .hold_response()
        .start();
    assert_ne!(
        best(&gw.outcome(short)),
        Some(long_on.as_str()),
        "the idle one"
    );
    let (_r, to) = hold(&mut gw, 30_000);
    (long_on, to)
}

#[test]
fn booked_prefill_drains_at_the_configured_rate() {
    // 4,096 tokens at 1,000 tokens/s, 3.5 s later: 596 left, against the 2,048 just booked.
    let rate = json!({"load": {"prefill_tokens_per_s": 1000}});
    let (long_on, to) = after_a_drain(rate, Duration::from_millis(3500));
    assert_eq!(to, long_on, "the nearly drained engine");
    // Rate 0: no drain, 4,096 tokens still count in full.
    let off = json!({"load": {"prefill_tokens_per_s": 0}});
    let (long_on, to) = after_a_drain(off, Duration::from_millis(3500));
    assert_ne!(to, long_on);
    // Learned (the default): no request has measured a rate yet, so nothing drains.
    let (long_on, to) = after_a_drain(json!({}), Duration::from_millis(3500));
    assert_ne!(to, long_on);
}

/// Sends a `tokens`-token prompt (starting at `start`), answers its first bytes `after` later,
/// and returns the worker slot it went to and the prefill rate then stored for it.
fn rate_after(
    gw: &mut kvroute_host_test::Gateway,
    start: u32,
    tokens_n: u32,
    after: u64,
) -> (u32, u32) {
    rate_after_answer(
        gw,
        start,
        tokens_n,
        after,
        kvroute_host_test::Response::ok("x"),
    )
}

/// [`rate_after`] with the engine's answer given.
fn rate_after_answer(
    gw: &mut kvroute_host_test::Gateway,
    start: u32,
    tokens_n: u32,
    after: u64,
    answer: kvroute_host_test::Response,
) -> (u32, u32) {
    let r = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": tokens(start, tokens_n), "max_tokens": 1}))
        .hold_response()
        .start();
    let slot = u32::from(best(&gw.outcome(r)) == Some(B));
    gw.advance(Duration::from_millis(after));
    gw.respond(r, answer);
    let table = gw
        .shared_data(keys().load())
        .map(|(v, _)| v)
        .unwrap_or_default();
    let rate = kvroute::mirror::load_rate(&table, kvroute::mirror::LoadId::slot(slot));
    (slot, rate)
}

#[test]
fn the_prefill_rate_is_learned_from_requests_that_found_the_engine_idle() {
    let (mut gw, _feed) = setup(json!({}));
    // 8,192 tokens on an idle engine, first bytes 400 ms later: 20,480 tokens/s.
    let (slot, rate) = rate_after(&mut gw, 10_000, 8192, 400);
    assert_eq!(rate, 20_480);
    // A short prompt measures mostly overhead: no sample.
    let (slot2, rate2) = rate_after(&mut gw, 40_000, 64, 400);
    assert_eq!(rate2, if slot2 == slot { 20_480 } else { 0 });
    // An error answered at once was no prefill (a prompt over the model's length): no
    // sample, where it would have read 8,192 tokens in 12 ms as 682,666 tokens/s.
    let refused = kvroute_host_test::Response::new(400).json(&json!({"error": "too long"}));
    let (mut fresh, _f) = setup(json!({}));
    assert_eq!(
        rate_after_answer(&mut fresh, 10_000, 8192, 12, refused.clone()).1,
        0
    );
    let (slot3, rate3) = rate_after_answer(&mut gw, 60_000, 8192, 12, refused);
    assert_eq!(rate3, if slot3 == slot { 20_480 } else { 0 });
    // A configured rate is not overwritten by samples.
    let (mut gw, _feed) = setup(json!({"load": {"prefill_tokens_per_s": 5000}}));
    assert_eq!(rate_after(&mut gw, 10_000, 8192, 400).1, 5000);
}

#[test]
fn each_gateway_replica_prefers_its_share_of_the_engines() {
    // Where do eight cold requests go (each finished before the next), as replica `replica`?
    let spread = |extra: serde_json::Value, replica: &str| {
        let (mut gw, feed) = setup(extra);
        feed.set_fleet(vec![fleet(0, 0, 0, None)]);
        feed.set_replica(replica);
        sync(&mut gw);
        let mut to = std::collections::BTreeSet::new();
        for i in 0..8 {
            let (r, on) = hold(&mut gw, 1000 * (i + 1));
            gw.respond(r, kvroute_host_test::Response::ok("x"));
            to.insert(on);
        }
        to.into_iter().collect::<Vec<_>>()
    };
    assert_eq!(spread(json!({}), "0/2"), [A]);
    assert_eq!(spread(json!({}), "1/2"), [B]);
    assert_eq!(spread(json!({}), "0/1"), [A, B], "alone: both");
    assert_eq!(spread(json!({}), "junk"), [A, B], "unreadable: alone");
    let off = json!({"route": {"replica_tie_band": 0}});
    assert_eq!(spread(off, "0/2"), [A, B], "affinity off");
    let no_fleet = json!({"load": {"fleet": false}});
    assert_eq!(spread(no_fleet, "0/2"), [A, B], "without fleet load: alone");
    // Affinity is only a tie-break: three requests in flight on A through another gateway
    // (no prefill queued; three blocks of cost, past the two-block band) send replica 0's
    // cold requests to the free B; one decoding request is within the band and stays home.
    for (in_flight, to) in [(3, B), (1, A)] {
        let (mut gw, feed) = setup(json!({}));
        feed.set_fleet(vec![fleet(0, in_flight, 0, None)]);
        feed.set_replica("0/2");
        sync(&mut gw);
        assert_eq!(hold(&mut gw, 5000).1, to, "{in_flight} in flight on A");
    }
    // The configuration of the old additive spread still loads, and changes nothing.
    assert_eq!(
        spread(json!({"route": {"replica_spread_tokens": 8192}}), "1/2"),
        [B]
    );
}

#[test]
fn the_speculative_table_is_sixteen_fixed_shards() {
    let (mut gw, _feed) = setup(json!({}));
    for i in 0..200 {
        let (r, _) = hold(&mut gw, 10_000 + 100 * i);
        gw.respond(r, kvroute_host_test::Response::ok("x"));
    }
    let prefix = format!("{}/spec/", keys().prefix());
    let shards: Vec<String> = gw
        .shared_data_keys()
        .into_iter()
        .filter(|k| k.starts_with(&prefix))
        .collect();
    assert!((2..=16).contains(&shards.len()), "{shards:?}");
    for k in &shards {
        let (v, _) = gw.shared_data(k).unwrap();
        assert_eq!(v.len(), 1 + 64 * 24, "{k}: fixed size");
    }
    assert!(gw
        .shared_data(&format!("{}/spec", keys().prefix()))
        .is_none());
    assert!(gw.errors().is_empty());
}

/// The report carries, cumulative, the tokens predicted as cached per worker and their
/// prompt tokens (the collector's truth check), requests for unregistered models by name
/// (bounded), the text counters, the feed lag, the version and the hashing contract.
#[test]
fn the_report_carries_predicted_reuse_unknown_models_and_the_contract() {
    let (mut gw, feed) = setup(json!({"load": {"gateway_id": "gw-1"}}));
    let prefix = tokens(5000, 48);
    feed.hold(1, &prefix, "default", "m", None, None);
    sync(&mut gw);
    // Two prompts sharing the held 48-token prefix, each with a block of its own.
    for tail in [7000, 8000] {
        let p: Vec<u32> = prefix.iter().copied().chain(tokens(tail, 16)).collect();
        assert_eq!(best(&complete(&mut gw, "m", &p)), Some(B));
    }
    let prompt = tokens(9000, 64);
    for model in ["alias", "alias", &"x".repeat(1000)] {
        complete(&mut gw, model, &prompt);
    }
    // More names than the bound: counted up to it only.
    for i in 0..100 {
        complete(&mut gw, &format!("typo-{i}"), &prompt);
    }
    sync(&mut gw);
    let last = feed.reports().last().cloned().expect("a report");
    let b = last["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == 1)
        .cloned()
        .unwrap_or_default();
    assert_eq!(b["predicted_cached_tokens"], 96, "{last}");
    assert_eq!(b["routed_prompt_tokens"], 128, "{last}");
    let no_model = last["no_model"].as_object().unwrap();
    assert_eq!(no_model["alias"], 2, "{last}");
    assert_eq!(no_model.len(), 64, "bounded");
    assert!(no_model.keys().all(|k| k.len() <= 128));
    assert_eq!(last["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(last["contract"], kvroute::hash::contract());
    assert!(last["feed_lag_ms"].as_u64().unwrap() < 1000, "{last}");
    assert_eq!(last["text"]["approx"], 0);
}

/// The `Held` ops another gateway's report becomes at the collector (every `held` entry).
fn held_ops(report: &serde_json::Value) -> Vec<Op> {
    report["held"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|h| Op::Held {
            worker: WorkerId(h["worker"].as_u64().unwrap() as u32),
            shard: h["shard"].as_u64().unwrap() as u32,
            key: kvroute::scope::BlockKey(h["key"].as_u64().unwrap()),
            blocks: h["blocks"].as_u64().unwrap() as u32,
            ttl_ms: h["ttl_ms"].as_u64().unwrap() as u32,
        })
        .collect()
}

/// Gateway 1's decision reaches gateway 2 through the report and the feed, before any KV
/// event: a sibling prompt through gateway 2 follows it, and gateway 2 does not pass it back.
#[test]
fn a_decision_through_one_gateway_routes_a_sibling_through_another() {
    let (mut gw1, feed1) = setup(json!({"load": {"gateway_id": "gw-1"}}));
    let (r1, first) = hold(&mut gw1, 5000);
    gw1.respond(r1, kvroute_host_test::Response::ok("x"));
    sync(&mut gw1);
    let report = feed1.reports().last().cloned().expect("a report");
    let ops = held_ops(&report);
    // Stored depths 1, 2 and 4 of the 64-token prompt, on the engine it went to.
    let on = u32::from(first != A);
    assert_eq!(ops.len(), 3, "{report}");
    assert!(
        ops.iter()
            .all(|o| matches!(o, Op::Held { worker, ttl_ms, .. }
            if worker.0 == on && (1000..=2000).contains(ttl_ms))),
        "{ops:?}"
    );
    // Sent once: the next report has nothing new.
    sync(&mut gw1);
    let next = feed1.reports().last().cloned().expect("a report");
    assert!(held_ops(&next).is_empty(), "{next}");

    // Gateway 2 sees a request in flight on that engine through another gateway, so that a
    // cold request goes to the other one.
    let sibling: Vec<u32> = tokens(5000, 64)
        .into_iter()
        .chain(tokens(90_000, 64))
        .collect();
    let through_gw2 = |ops: &[Op]| {
        let (mut gw2, feed2) = setup(json!({"load": {"gateway_id": "gw-2"}}));
        feed2.set_fleet(vec![fleet(on, 1, 0, None)]);
        for op in ops {
            feed2.push(op.clone());
        }
        sync(&mut gw2);
        sync(&mut gw2);
        // What it took is not reported back.
        let echoed = feed2.reports().iter().any(|r| !held_ops(r).is_empty());
        (
            complete(&mut gw2, "m", &sibling),
            gw2.metric("kvroute.peer_holds"),
            echoed,
        )
    };
    let (o, taken, echoed) = through_gw2(&ops);
    assert_eq!(best(&o), Some(first.as_str()), "{}", debug(&o));
    assert!(debug(&o).contains("matched_tokens=64"), "{}", debug(&o));
    assert_eq!(taken, Some(3));
    assert!(!echoed);
    // Without them the sibling is cold (no KV events anywhere) and goes by load.
    let (o, _, _) = through_gw2(&[]);
    assert!(debug(&o).contains("matched_tokens=0"), "{}", debug(&o));
    assert_ne!(best(&o), Some(first.as_str()), "{}", debug(&o));
}
