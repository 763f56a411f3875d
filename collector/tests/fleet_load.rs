//! Gateway load reports against the real binary: sums over gateways, absolute values,
//! the timeout, every refusal, the read token and `/unregister`.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::fleet_common::{counter, worker, Collector};

fn entry(worker: u32, requests: i64, prefill: i64, decode: i64) -> Value {
    json!({"worker": worker, "requests": requests, "prefill_tokens": prefill, "decode_tokens": decode})
}

fn report(gateway: &str, epoch: u64, workers: Vec<Value>) -> Value {
    json!({"gateway": gateway, "epoch": epoch, "workers": workers})
}

/// A collector without scraping and two workers; returns it, their ids and the epoch.
async fn two_workers(args: &[&str]) -> (Collector, u32, u32, u64) {
    let mut all = vec!["--scrape-interval-secs", "0"];
    all.extend_from_slice(args);
    let c = Collector::start(&all).await;
    let a = c.register("10.0.0.1:8000", 0, "10.0.0.1:8000").await;
    let b = c.register("10.0.0.2:8000", 0, "10.0.0.2:8000").await;
    let epoch = c.epoch().await;
    (c, a, b, epoch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sum_and_a_report_replaces_the_last() {
    let (c, a, b, epoch) = two_workers(&[]).await;
    let (s, v) = c
        .post_load(report("gw-1", epoch, vec![entry(a, 2, 100, 10)]))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(worker(&v, a)["requests"], 2);
    let (s, v) = c
        .post_load(report(
            "gw-2",
            epoch,
            vec![entry(a, 3, 50, 5), entry(b, 1, 7, 0)],
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    // The answer already carries the fleet sums.
    assert_eq!(v["gateways"], 2);
    assert_eq!(worker(&v, a)["requests"], 5);
    let view = c.load().await;
    assert_eq!(view["epoch"], epoch);
    assert_eq!(view["workers"].as_array().unwrap().len(), 2);
    let wa = worker(&view, a);
    assert_eq!(
        (&wa["requests"], &wa["prefill_tokens"], &wa["decode_tokens"]),
        (&json!(5), &json!(150), &json!(15))
    );
    assert_eq!(wa["instance_id"], "10.0.0.1:8000");
    assert_eq!(wa["dp_rank"], 0);
    assert_eq!(wa["engine"], Value::Null);
    assert_eq!(worker(&view, b)["prefill_tokens"], 7);
    // Absolute counts: gw-1's new report replaces its old one, it does not add to it.
    c.post_load(report("gw-1", epoch, vec![entry(a, 1, 10, 1)]))
        .await;
    let view = c.load().await;
    assert_eq!(worker(&view, a)["requests"], 4);
    assert_eq!(worker(&view, a)["prefill_tokens"], 60);
    // A worker left out of a report counts 0 for that gateway.
    c.post_load(report("gw-2", epoch, vec![])).await;
    let view = c.load().await;
    assert_eq!(worker(&view, a)["requests"], 1);
    assert_eq!(worker(&view, b)["requests"], 0);
    assert_eq!(
        counter(&c.metrics().await, "kvroute_load_reports_total"),
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_stops_reporting_is_dropped() {
    let (c, a, _b, epoch) = two_workers(&["--gateway-timeout-secs", "0.5"]).await;
    c.post_load(report("quiet", epoch, vec![entry(a, 10, 0, 0)]))
        .await;
    let started = Instant::now();
    // "busy" keeps reporting; "quiet" does not.
    while started.elapsed() < Duration::from_millis(1200) {
        let (s, _) = c
            .post_load(report("busy", epoch, vec![entry(a, 1, 0, 0)]))
            .await;
        assert_eq!(s, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = c.load().await;
    assert_eq!(view["gateways"], 1);
    assert_eq!(worker(&view, a)["requests"], 1);
    let m = c.metrics().await;
    assert_eq!(counter(&m, "kvroute_fleet_gateways_expired_total"), 1.0);
    assert_eq!(counter(&m, "kvroute_fleet_gateways"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_report_is_refused_with_json_and_changes_nothing() {
    let (c, a, b, epoch) = two_workers(&["--max-gateways", "1"]).await;
    let (s, _) = c
        .post_load(report("gw", epoch, vec![entry(a, 2, 20, 2)]))
        .await;
    assert_eq!(s, StatusCode::OK);
    let baseline = c.load().await;
    let long_id = "g".repeat(129);
    let cases: Vec<(String, StatusCode, &str)> = vec![
        (
            report("gw", epoch, vec![entry(999, 1, 0, 0)]).to_string(),
            StatusCode::BAD_REQUEST,
            "unknown_worker",
        ),
        (
            report("gw", epoch, vec![entry(a, -1, 0, 0)]).to_string(),
            StatusCode::BAD_REQUEST,
            "negative",
        ),
        (
            report("gw", epoch, vec![entry(a, 1_000_001, 0, 0)]).to_string(),
            StatusCode::BAD_REQUEST,
            "absurd",
        ),
        (
            report("gw", epoch, vec![entry(a, 0, 1_000_000_001, 0)]).to_string(),
            StatusCode::BAD_REQUEST,
            "absurd",
        ),
        (
            report(
                "gw",
                epoch,
                vec![
                    entry(a, 1, 0, 0),
                    entry(b, 1, 0, 0),
                    entry(a + b + 1, 1, 0, 0),
                ],
            )
            .to_string(),
            StatusCode::BAD_REQUEST,
            "too_many_entries",
        ),
        (
            report("gw", epoch, vec![entry(a, 1, 0, 0), entry(a, 1, 0, 0)]).to_string(),
            StatusCode::BAD_REQUEST,
            "duplicate_worker",
        ),
        (
            report("gw-new", epoch, vec![entry(a, 1, 0, 0)]).to_string(),
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_gateways",
        ),
        (
            report("gw", epoch + 1, vec![entry(a, 1, 0, 0)]).to_string(),
            StatusCode::CONFLICT,
            "epoch",
        ),
        (
            report("", epoch, vec![]).to_string(),
            StatusCode::BAD_REQUEST,
            "gateway_id",
        ),
        (
            report(&long_id, epoch, vec![]).to_string(),
            StatusCode::BAD_REQUEST,
            "gateway_id",
        ),
        (
            "{\"gateway\": \"gw\", \"epoch\": ".to_owned(),
            StatusCode::BAD_REQUEST,
            "malformed",
        ),
        (
            report("gw", epoch, vec![json!({"worker": a, "requests": 1.5})]).to_string(),
            StatusCode::BAD_REQUEST,
            "invalid",
        ),
    ];
    for (body, status, reason) in &cases {
        let (s, v) = c.post_load_raw(body.clone()).await;
        assert_eq!(s, *status, "{reason}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
        assert_eq!(c.load().await, baseline, "{reason} changed the totals");
    }
    let m = c.metrics().await;
    for (_, _, reason) in &cases {
        let want = cases.iter().filter(|(_, _, r)| r == reason).count() as f64;
        assert_eq!(
            counter(
                &m,
                &format!("kvroute_load_reports_refused_total{{reason=\"{reason}\"}}")
            ),
            want,
            "{reason}"
        );
    }
    // The gateway already in keeps reporting.
    let (s, _) = c.post_load(report("gw", epoch, vec![])).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_token_guards_both_ways() {
    let c = Collector::start(&["--scrape-interval-secs", "0", "--read-token", "r"]).await;
    let r = c
        .http
        .get(format!("{}/v1/load", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = c
        .http
        .post(format!("{}/v1/load", c.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let epoch = c.epoch().await;
    let (s, v) = c.post_load(report("gw", epoch, vec![])).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["gateways"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_workers_leave_the_fleet_view() {
    let (c, a, b, epoch) = two_workers(&[]).await;
    c.post_load(report(
        "gw",
        epoch,
        vec![entry(a, 1, 0, 0), entry(b, 2, 0, 0)],
    ))
    .await;
    let r = c
        .http
        .post(format!("{}/unregister", c.url))
        .json(&json!({"instance_id": "10.0.0.2:8000", "model_name": "m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let view = c.load().await;
    assert_eq!(view["workers"].as_array().unwrap().len(), 1);
    assert_eq!(worker(&view, a)["requests"], 1);
    let (s, v) = c
        .post_load(report("gw", epoch, vec![entry(b, 2, 0, 0)]))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // A new worker taking the freed slot starts from nothing.
    let b2 = c.register("10.0.0.3:8000", 0, "10.0.0.3:8000").await;
    assert_eq!(worker(&c.load().await, b2)["requests"], 0);
}

#[test]
fn fleet_flags_have_defaults_and_are_validated() {
    use clap::Parser;
    use kvroute_collector::config::Cli;
    let parse = |args: &[&str]| {
        let mut argv = vec!["kvroute-collector"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().into_config()
    };
    let d = parse(&[]).unwrap();
    assert_eq!(d.gateway_timeout, Duration::from_secs(5));
    assert_eq!(d.max_gateways, 64);
    assert_eq!(d.scrape_interval, Duration::from_millis(500));
    assert_eq!(d.scrape_timeout, Duration::from_millis(250));
    assert_eq!(d.engine_stale, Duration::from_secs(2));
    assert_eq!(d.max_metrics_bytes, 1 << 20);
    let c = parse(&["--scrape-interval-secs", "0", "--max-gateways", "3"]).unwrap();
    assert!(c.scrape_interval.is_zero());
    assert_eq!(c.max_gateways, 3);
    for bad in [
        &["--scrape-timeout-secs", "0"][..],
        &["--max-gateways", "0"],
        &["--max-metrics-bytes", "0"],
        &["--gateway-timeout-secs=-1"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?} accepted");
    }
}

/// A `/v1/feed` answer: its `x-kvroute-load-excludes` and `x-kvroute-replica` headers and
/// its `Load` ops by worker, `(worker, requests, prefill_tokens)`.
struct FeedAnswer {
    excludes: Option<String>,
    replica: Option<String>,
    loads: Vec<(u32, u64, u64)>,
}

async fn feed_load(c: &Collector, query: &str) -> FeedAnswer {
    let r = c
        .http
        .get(format!("{}/v1/feed{query}", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let header = |name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let (excludes, replica) = (
        header("x-kvroute-load-excludes"),
        header("x-kvroute-replica"),
    );
    let page = kvroute::feed::Page::decode(&r.bytes().await.unwrap()).unwrap();
    let mut loads: Vec<(u32, u64, u64)> = page
        .ops
        .iter()
        .filter_map(|op| match op {
            kvroute::feed::Op::Load {
                worker,
                requests,
                prefill_tokens,
                ..
            } => Some((worker.0, *requests, *prefill_tokens)),
            _ => None,
        })
        .collect();
    loads.sort_unstable();
    FeedAnswer {
        excludes,
        replica,
        loads,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reads_the_feed_totals_without_its_own_report() {
    let (c, a, b, epoch) = two_workers(&[]).await;
    c.post_load(report("gw/1", epoch, vec![entry(a, 2, 100, 10)]))
        .await;
    c.post_load(report(
        "gw-2",
        epoch,
        vec![entry(a, 3, 50, 5), entry(b, 1, 7, 0)],
    ))
    .await;
    // No reader: every gateway's report, and no header.
    let FeedAnswer {
        excludes,
        loads: all,
        ..
    } = feed_load(&c, "").await;
    assert_eq!(excludes, None);
    assert_eq!(all, vec![(a, 5, 150), (b, 1, 7)]);
    // gw/1 (percent-encoded) reads gw-2's load only, and is told so.
    let FeedAnswer {
        excludes,
        loads: mine,
        ..
    } = feed_load(&c, "?gateway=gw%2F1").await;
    assert_eq!(excludes.as_deref(), Some("gw/1"));
    assert_eq!(mine, vec![(a, 3, 50), (b, 1, 7)]);
    // A gateway that never reported reads everything; a bad id is a 400 with JSON.
    assert_eq!(feed_load(&c, "?gateway=gw-3").await.loads, all);
    // Each reader is told its place among the live replicas (itself counted): ids in byte
    // order, "gw-2" < "gw-3" < "gw/1".
    let replica = |q: &'static str| {
        let c = &c;
        async move { feed_load(c, q).await.replica }
    };
    assert_eq!(replica("?gateway=gw-2").await.as_deref(), Some("0/2"));
    assert_eq!(replica("?gateway=gw%2F1").await.as_deref(), Some("1/2"));
    assert_eq!(replica("?gateway=gw-3").await.as_deref(), Some("1/3"));
    assert_eq!(replica("").await, None, "no reader, no place");
    let long = "g".repeat(200);
    let r = c
        .http
        .get(format!("{}/v1/feed?gateway={long}", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"].as_str().unwrap().contains("gateway"), "{v}");
}

/// The `Held` ops of a `/v1/feed` answer: `(worker, shard, key, blocks)`.
async fn feed_held(c: &Collector, query: &str) -> Vec<(u32, u32, u64, u32)> {
    let r = c
        .http
        .get(format!("{}/v1/feed{query}", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let page = kvroute::feed::Page::decode(&r.bytes().await.unwrap()).unwrap();
    page.ops
        .iter()
        .filter_map(|op| match op {
            kvroute::feed::Op::Held {
                worker,
                shard,
                key,
                blocks,
                ttl_ms,
            } => {
                assert!((1..=5000).contains(ttl_ms), "{ttl_ms}");
                Some((worker.0, *shard, key.0, *blocks))
            }
            _ => None,
        })
        .collect()
}

/// A gateway's `held` decisions reach every other gateway once, on a version-4 feed page
/// that names the reader; never the gateway itself, a version-3 reader or an anonymous one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_decisions_reach_the_other_gateways_once() {
    let (c, a, b, epoch) = two_workers(&[]).await;
    let held = |worker: u32, key: u64| json!({"worker": worker, "shard": 3, "key": key, "blocks": 4, "ttl_ms": 5000});
    let (s, _) = c.post_load(report("gw-2", epoch, vec![])).await;
    assert_eq!(s, StatusCode::OK);
    let mut r1 = report("gw-1", epoch, vec![entry(a, 1, 64, 0)]);
    // A u64 key above 2^53 survives JSON.
    r1["held"] = json!([held(a, u64::MAX - 7), held(b, 12), held(999, 13)]);
    let (s, v) = c.post_load(r1).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        feed_held(&c, "?v=4&gateway=gw-1").await.is_empty(),
        "not its own"
    );
    assert!(
        feed_held(&c, "?v=3&gateway=gw-2").await.is_empty(),
        "version 3"
    );
    assert!(feed_held(&c, "?v=4").await.is_empty(), "anonymous");
    // The unregistered worker 999's decision was dropped, not the report.
    assert_eq!(
        feed_held(&c, "?v=4&gateway=gw-2").await,
        [(a, 3, u64::MAX - 7, 4), (b, 3, 12, 4)]
    );
    assert!(feed_held(&c, "?v=4&gateway=gw-2").await.is_empty(), "once");
    let metrics = c.metrics().await;
    assert_eq!(counter(&metrics, "kvroute_feed_held_total"), 2.0);
    // A bad entry refuses the whole report, with JSON.
    let mut bad = report("gw-1", epoch, vec![]);
    bad["held"] = json!([{"worker": a, "shard": 0, "key": 1, "blocks": 0, "ttl_ms": 10}]);
    let (s, v) = c.post_load(bad).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(v["error"].as_str().unwrap().contains("held entry 0"), "{v}");
}
