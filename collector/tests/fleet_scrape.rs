//! The engine scraper against fake engines (axum servers in the test): a full queue shows in
//! `/v1/load` per dp rank; a failing engine goes stale; a page that is huge, malformed or never
//! ends is cut off and counted while `/query` keeps answering.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use serde_json::Value;

use crate::fleet_common::{counter, worker, Collector};

/// Serves `app` on a loopback port; returns `ip:port`.
async fn engine(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Polls `cond` on the fleet view until it holds (bounded).
async fn view_until(c: &Collector, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let v = c.load().await;
        if cond(&v) {
            return v;
        }
        assert!(Instant::now() < until, "{what} never happened: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const FULL_QUEUE: &str = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 48.0\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 256.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 17.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.97\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.4\n\
vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 123456.0\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"38912\"} 1.0\n\
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"999999999\"} 1.0\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_shows_per_rank_and_a_dead_engine_goes_stale() {
    let up = Arc::new(AtomicBool::new(true));
    let flag = up.clone();
    let addr = engine(Router::new().route(
        "/metrics",
        get(move || {
            let up = flag.load(Ordering::SeqCst);
            async move {
                if up {
                    FULL_QUEUE.into_response()
                } else {
                    StatusCode::SERVICE_UNAVAILABLE.into_response()
                }
            }
        }),
    ))
    .await;
    let c = Collector::start(&[
        "--scrape-interval-secs",
        "0.05",
        "--engine-stale-secs",
        "0.4",
        "--max-blocks-per-worker",
        "100000",
    ])
    .await;
    let r0 = c.register("eng", 0, &addr).await;
    let r1 = c.register("eng", 1, &addr).await;
    let view = view_until(&c, "a sample of both ranks", |v| {
        !worker(v, r0)["engine"].is_null() && !worker(v, r1)["engine"].is_null()
    })
    .await;
    // The index is sized for each rank's cache, never past its own limit.
    let until = Instant::now() + Duration::from_secs(10);
    let sized = loop {
        let ws = c.workers().await;
        let of = |id: u32| {
            ws.iter()
                .find(|w| w["worker_id"] == id)
                .map_or(Value::Null, |w| w["cache_blocks"].clone())
        };
        let sized = (of(r0), of(r1));
        if !sized.0.is_null() && !sized.1.is_null() {
            break sized;
        }
        assert!(Instant::now() < until, "the index never sized: {ws:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(sized, (38_912.into(), 100_000.into()));
    let e0 = &worker(&view, r0)["engine"];
    assert_eq!(e0["waiting"], 48);
    assert_eq!(e0["running"], 256);
    assert_eq!(e0["kv_usage"], 0.97);
    assert_eq!(e0["stale"], false);
    assert!(e0["age_ms"].as_u64().unwrap() < 1000);
    let e1 = &worker(&view, r1)["engine"];
    assert_eq!((&e1["waiting"], &e1["running"]), (&2.into(), &17.into()));
    // No gateway reports: the engine's figures stand alone.
    assert_eq!(worker(&view, r0)["requests"], 0);
    assert!(counter(&c.metrics().await, "kvroute_engine_scrapes_total") >= 1.0);

    up.store(false, Ordering::SeqCst);
    let view = view_until(&c, "the sample going stale", |v| {
        worker(v, r0)["engine"]["stale"] == true
    })
    .await;
    // The last figures stay visible, marked stale.
    assert_eq!(worker(&view, r0)["engine"]["waiting"], 48);
    let m = c.metrics().await;
    assert!(
        counter(
            &m,
            "kvroute_engine_scrape_failures_total{reason=\"status\"}"
        ) >= 1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_malformed_and_endless_pages_are_cut_off_while_queries_answer() {
    // 64 KiB chunks without end and without a length: only the size cap stops it.
    let huge = engine(Router::new().route(
        "/metrics",
        get(|| async {
            let line = Bytes::from("# filler\n".repeat(64 * 1024 / 9));
            let chunks =
                futures_util::stream::repeat_with(move || Ok::<_, std::io::Error>(line.clone()));
            Response::new(Body::from_stream(chunks))
        }),
    ))
    .await;
    let malformed = engine(Router::new().route(
        "/metrics",
        get(|| async {
            "vllm:num_requests_waiting{engine=\"0\" 12\nvllm:num_requests_running 1\n"
        }),
    ))
    .await;
    // A valid start, then a byte a second: only the timeout stops it.
    let endless = engine(Router::new().route(
        "/metrics",
        get(|| async {
            let head = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from_static(b"vllm:num_requests_waiting 1\n"))
            });
            let drip = futures_util::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Some((Ok::<_, std::io::Error>(Bytes::from_static(b"#")), ()))
            });
            Response::new(Body::from_stream(futures_util::StreamExt::chain(
                head, drip,
            )))
        }),
    ))
    .await;
    // A long timeout, so that a query held up by a scrape would show.
    let c = Collector::start(&[
        "--scrape-interval-secs",
        "0.05",
        "--scrape-timeout-secs",
        "2",
    ])
    .await;
    let ids = [
        c.register("huge", 0, &huge).await,
        c.register("malformed", 0, &malformed).await,
        c.register("endless", 0, &endless).await,
    ];
    let until = Instant::now() + Duration::from_secs(10);
    let mut slowest = Duration::ZERO;
    loop {
        let (status, took) = c.query().await;
        assert_eq!(status, reqwest::StatusCode::OK);
        slowest = slowest.max(took);
        let m = c.metrics().await;
        let failed = |reason: &str| {
            counter(
                &m,
                &format!("kvroute_engine_scrape_failures_total{{reason=\"{reason}\"}}"),
            )
        };
        if failed("too_large") >= 1.0 && failed("malformed") >= 1.0 && failed("timeout") >= 1.0 {
            break;
        }
        assert!(Instant::now() < until, "not every failure counted:\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Queries never waited for a scrape (the endless one takes the 2 s timeout).
    assert!(
        slowest < Duration::from_secs(1),
        "slowest /query {slowest:?}"
    );
    let view = c.load().await;
    for id in ids {
        assert!(worker(&view, id)["engine"].is_null(), "{view}");
    }
    assert_eq!(
        counter(&c.metrics().await, "kvroute_engine_scrapes_total"),
        0.0
    );
}
